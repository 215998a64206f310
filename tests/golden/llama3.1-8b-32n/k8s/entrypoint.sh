#!/bin/bash
# entrypoint.sh for llama3.1-8b-32n: every pod of this k8s dir runs it, its first argument the pod's job:
#   compile  each pod of compile-pytorchjob.yaml (one pod per node): the same launch as `run` through the compiler
#   run      each pod of pytorchjob.yaml: the pre-flight, the health check, then training
#   eval     the one pod of eval-job.yaml: the run dir's newest checkpoint evaluated (further arguments go to
#            `trnrecipes eval run`, as eval.sbatch's do)
# Made by trnrecipes from recipe llama3.1-8b. Do not edit; re-create with:
#   trnrecipes k8s --recipe llama3.1-8b --nodes 32 --overrides 'k8s.pvc=fsx-claim k8s.mount=/opt/trnrecipes'
# Layout: 32 node(s) x 32 workers = 1024; TP 32 x PP 1 x DP 32
# Exit codes, read by the training operator's ExitCode restart policy, which fails the job on 1-127 and recreates the
# pod on 128-255 (kubeflow/training-operator v1.9.0, pkg/apis/kubeflow.org/v1/common_types.go RestartPolicyExitCode;
# IsRetryableExitCode: >= 128), and by the eval Job's podFailurePolicy (129 retried, any other failure final). The
# operator's runPolicy.backoffLimit does not bound those recreations (below, "The restart budget"): this script
# gives up, with 2, at a pod's failure beyond slurm.max_restarts (3).
#   0 done; 2 bad input, never retried (the same input fails the same way); 129 a node or transient fault
#   (the sbatch scripts' exit 1), retried; 143 stopped on SIGTERM (an eviction) after the trainer's save, retried: resumes.
set -euo pipefail

# ---- Settings from the resolved recipe (every value quoted; edit recipe.yaml and re-create instead) ----
JOB_DIR=/opt/trnrecipes/jobs/llama3.1-8b-32n/k8s
REPO=/opt/trnrecipes
RUN_DIR=/opt/trnrecipes/runs/llama3.1-8b-32n
RECIPE="$JOB_DIR/recipe.yaml"
EXPECTED_NODES=32
WORKERS_PER_NODE=32
RETRYABLE=129
BAD_INPUT=2

MODE=${1:-}
case "$MODE" in
  compile | run) PYTHON=/usr/local/bin/python ;;  # cluster.python, else the Neuron training container's
  # As eval.sbatch: scoring runs lm-eval and transformers at the checkout's pins, which a Neuron venv must not take.
  eval) PYTHON=/opt/trnrecipes/.venv/bin/python ;;
  *)
    echo "error: entrypoint.sh takes the pod's job first: compile, run or eval (got '$MODE'); the manifests in $JOB_DIR pass it" >&2
    exit "$BAD_INPUT"
    ;;
esac
shift
PYTHON="${TRNRECIPES_PYTHON:-$PYTHON}"
JOB_ID=${TRNRECIPES_JOB_NAME:-llama3.1-8b-32n}
POD=${TRNRECIPES_POD:-$(hostname)}
LOG_DIR="$JOB_DIR/logs/$JOB_ID/$POD-$(date +%Y%m%d-%H%M%S)"
cd "$REPO"
PATH="$(dirname "$PYTHON"):$PATH"
export PATH
export TRNRECIPES_JOB_ID="$JOB_ID" TRNRECIPES_RESTART=0 TRNRECIPES_RUN_DIR="$RUN_DIR"
MAX_RESTARTS=3
FAILURES=""  # the eval Job's retries are counted by its own backoffLimit
# Exit 2 once this pod's failures, counted in $FAILURES, are beyond slurm.max_restarts (below, "The restart budget").
give_up_if_spent() {
  local failed=0
  if [[ -n "$FAILURES" && -f "$FAILURES" ]]; then failed=$(wc -l <"$FAILURES"); fi
  if ((failed > MAX_RESTARTS)); then
    echo "error: pod $POD failed $failed times, more than slurm.max_restarts ($MAX_RESTARTS) restarts: not retried again (exit 2). Its failures:" >&2
    sed 's/^/  /' "$FAILURES" >&2
    exit "$BAD_INPUT"
  fi
}

if [[ "$MODE" != eval ]]; then
  # ---- The restart budget. The operator recreates a pod that exits 128-255 by deleting it, so the new pod's
  # restartCount is 0, and runPolicy.backoffLimit counts only restartCounts (v1.9.0 pkg/core/job.go
  # PastBackoffLimit; kubeflow/trainer issue 2045): a node fault that repeats would be retried forever. Each pod
  # counts its own retryable exits on the claim, and gives up with 2 beyond slurm.max_restarts; an eviction's 143 is
  # not counted, and the pod's end (0, or 2) clears its count. A pod killed or deleted keeps it: the README's steps
  # remove logs/<job>/failures/ before each apply, and a pod starting beyond the budget gives up at once. ----
  FAILURES="$JOB_DIR/logs/$JOB_ID/failures/$MODE-$POD"
  mkdir -p "$(dirname "$FAILURES")"
  trap 'rc=$?; if ((rc == 0 || rc == BAD_INPUT)); then rm -f "$FAILURES"; fi' EXIT
  give_up_if_spent
  # ---- The rendezvous the training operator gives each pod (pkg/controller.v1/pytorch/envvar.go and master.go,
  # v1.9.0): MASTER_ADDR/MASTER_PORT (the Master pod's service), PET_NNODES (pods), PET_NPROC_PER_NODE (nprocPerNode)
  # and PET_NODE_RANK (Master 0, Worker i: i + 1). Static, as run.sbatch's: node rank = pod rank, the Master hosts
  # the store. The env table (trnrecipes/jobs/neuron_env.py) is set by the manifest. ----
  for name in MASTER_ADDR MASTER_PORT PET_NNODES PET_NPROC_PER_NODE PET_NODE_RANK; do
    if [[ -z "${!name:-}" ]]; then
      echo "error: $name is not set: entrypoint.sh $MODE runs in a pod of a PyTorchJob in $JOB_DIR (the training operator sets it)" >&2
      exit "$BAD_INPUT"
    fi
  done
  if [[ "$PET_NNODES" != "$EXPECTED_NODES" || "$PET_NPROC_PER_NODE" != "$WORKERS_PER_NODE" ]]; then
    echo "error: this job was made for $EXPECTED_NODES pod(s) x $WORKERS_PER_NODE workers, the operator gives $PET_NNODES x $PET_NPROC_PER_NODE; re-create it with --nodes $PET_NNODES" >&2
    exit "$BAD_INPUT"
  fi
  NNODES=$PET_NNODES
  NODE_RANK=$PET_NODE_RANK
  export MASTER_ADDR MASTER_PORT
  echo "[trnrecipes] $MODE pod $POD: node $NODE_RANK of $NNODES x $WORKERS_PER_NODE workers, rendezvous $MASTER_ADDR:$MASTER_PORT; logs in $LOG_DIR"
else
  echo "[trnrecipes] eval pod $POD on $(hostname); logs in $LOG_DIR"
fi

# ---- Pre-flight, as the sbatch scripts' on each node: (compile, run) the job's Python made ready from the
# wheelhouse, then trnrecipes doctor --node for this job. Exit 1 is this node's fault (devices, disk): retried.
# Anything else is the image's or the input's, the same on every pod: bad input. ----
# A retryable exit of this pod (a node or transient fault): counted against slurm.max_restarts, then 129.
retry() {  # WHAT
  local count=""
  if [[ -n "$FAILURES" ]]; then
    echo "$(date +%Y-%m-%dT%H:%M:%S) $1" >>"$FAILURES" || true
    give_up_if_spent  # the budget spent: no recreation whose only act would be to give up
    count=" (failure $(wc -l <"$FAILURES" 2>/dev/null || echo '?') of at most $((MAX_RESTARTS + 1)))"
  fi
  echo "[trnrecipes] $1: exit $RETRYABLE, the pod is recreated$count" >&2
  exit "$RETRYABLE"
}
WHEELS=/opt/trnrecipes/wheels/neuron-2.26
WHEELS="${TRNRECIPES_WHEELS:-$WHEELS}"
preflight() {
  if [[ ! -x "$PYTHON" ]]; then
    echo "error: $POD: the job's Python $PYTHON does not exist in this image; set cluster.python (or TRNRECIPES_PYTHON)" >&2
    return 4
  fi
  if [[ "$MODE" != eval && -n "$WHEELS" ]]; then
    "$PYTHON" -m trnrecipes.ops.ready --wheels "$WHEELS" --python "$PYTHON" || return $?
  fi
  "$PYTHON" -m trnrecipes.ops.doctor --config "$RECIPE" --job "$MODE" --run-dir "$RUN_DIR" --python "$PYTHON" --node
}
rc=0
preflight || rc=$?
if ((rc == 1)); then
  retry "the pre-flight found a fault of this node (above)"
elif ((rc != 0)); then
  echo "[trnrecipes] the pre-flight failed (above): bad input, not retried. Fix it and re-apply" >&2
  exit "$BAD_INPUT"
fi
mkdir -p "$LOG_DIR" "$RUN_DIR"
export TRNRECIPES_FATAL_FILE="$LOG_DIR/fatal"

if [[ "$MODE" == eval ]]; then
  # ---- Evaluate, as eval.sbatch: the 128-node Llama 2 post's table (eval/registry.py; lm-eval, offline) and
  # HumanEval pass@k (sandboxed: this job opts in with --allow-code-execution) on the newest complete checkpoint in
  # the run dir, into RUN_DIR/eval/step_N; on the pod's GPUs where eval.gpus asks for them, else its CPUs. ----
  EVAL=("$PYTHON" -m trnrecipes eval run --ckpt "$RUN_DIR" --allow-code-execution "$@")
  echo "[trnrecipes] command: $(printf '%q ' "${EVAL[@]}")"
  "${EVAL[@]}"
  echo "[trnrecipes] eval job $JOB_ID done"
  exit 0
fi

# The open-files limit up to 65535, as AWS's train_setup.sh do (ulimit -n 65535), never above the hard limit.
soft=$(ulimit -Sn) hard=$(ulimit -Hn)
if [[ "$soft" != unlimited ]] && ((soft < 65535)); then
  if [[ "$hard" == unlimited ]] || ((hard >= 65535)); then ulimit -Sn 65535; else ulimit -Sn "$hard"; fi
fi

# ---- One launcher per pod; torchrun starts the workers (the same launch as the sbatch scripts', node rank from
# the pod) ----
TORCHRUN=("$PYTHON" -m torch.distributed.run --nnodes="$NNODES" --nproc-per-node="$WORKERS_PER_NODE"
  --node-rank="$NODE_RANK" --rdzv-backend=static --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT"
  --log-dir="${TMPDIR:-/tmp}/trnrecipes-logs" --tee=3 --local-ranks-filter=0)
TRAIN=("${TORCHRUN[@]}" -m trnrecipes train --config "$RECIPE")

# A launch that failed: on something a restart would repeat (the trainer's fatal file), bad input; else retried.
launch_failed() {  # WHAT STATUS
  if [[ -s "$TRNRECIPES_FATAL_FILE" ]]; then
    echo "[trnrecipes] $1 failed on something a restart would repeat; not retried. Fix it and re-apply:" >&2
    sed 's/^[^:]*: //' "$TRNRECIPES_FATAL_FILE" | sort | uniq -c | sed 's/^ */  /' >&2
    exit "$BAD_INPUT"
  fi
  retry "$1 failed (exit status $2)"
}

# ---- The compile cache. Each pod compiles into its node's cache (NEURON_COMPILE_CACHE_URL, a hostPath: many
# writers on one shared dir corrupt and slow it), and the compile job may land on other nodes than the run. So, as
# compile.sbatch and run.sbatch do: after compiling, one pod per distinct set of graphs (node ranks $CACHE_LEADERS:
# pods holding the same pipeline stages compile the same graphs) copies its cache to $CACHE_COPY on the shared
# claim, and each run pod merges that copy into its node's cache before training. ----
CACHE_COPY="$JOB_DIR/neuron-cache"
CACHE_LEADERS=0

if [[ "$MODE" == compile ]]; then
  # SIGTERM while compiling has nothing to save: the pod is killed at the end of its grace period (Kubernetes'
  # default, 30 s) and recreated (137).
  # ---- Compile: neuron_parallel_compile around the very same launch as training, as compile.sbatch: it runs the
  # trainer to collect its graphs (4 steps through one validation and one checkpoint pass, nothing written), then
  # compiles them in parallel into the node's cache. ----
  COPIED="$JOB_DIR/logs/$JOB_ID/cache-copied"  # one file per cache leader whose copy is whole
  if ((NODE_RANK == 0)); then rm -rf "$COPIED"; fi  # before the launch: none can end before the Master has joined it
  COMPILE=(neuron_parallel_compile "${TRAIN[@]}" --compile)
  echo "[trnrecipes] command: $(printf '%q ' "${COMPILE[@]}")"
  COMPILE_LOG="$LOG_DIR/neuron_parallel_compile.log"
  status=0
  "${COMPILE[@]}" 2>&1 | tee "$COMPILE_LOG" || status=$?
  # A graph that failed to compile is cached as failed and training would not retry it: the same input fails again.
  if FAILED=$(grep -Eo 'Total failed compilations: [1-9][0-9]*' "$COMPILE_LOG"); then
    echo "error: neuron_parallel_compile reports '${FAILED//$'\n'/, }'; see $COMPILE_LOG. After fixing the cause," >&2
    echo "       re-create the job with --retry_failed_compilation in compile.extra_flags (cached failures are not retried)." >&2
    exit "$BAD_INPUT"
  fi
  if ((status != 0)); then launch_failed "neuron_parallel_compile" "$status"; fi
  if [[ " $CACHE_LEADERS " == *" $NODE_RANK "* ]]; then
    mkdir -p "$CACHE_COPY" "$COPIED"
    if cp -a -u "$NEURON_COMPILE_CACHE_URL/." "$CACHE_COPY/"; then
      echo "[trnrecipes] compiled graphs of node $NODE_RANK copied to $CACHE_COPY"
    else  # the claim full or not writable: the run compiles these graphs itself (slower, not wrong)
      echo "[trnrecipes] warning: copying node $NODE_RANK's compiled graphs to $CACHE_COPY failed; the run will compile them again" >&2
    fi
    : >"$COPIED/$NODE_RANK"
  fi
  # The operator marks the job Succeeded when the Master ends (pkg/controller.v1/pytorch/pytorchjob_controller.go):
  # the Master waits (30 minutes at most) for the other leaders' copies, so the run never starts with half of them.
  if ((NODE_RANK == 0)); then
    for leader in $CACHE_LEADERS; do
      for _ in $(seq 180); do [[ -e "$COPIED/$leader" ]] && break; sleep 10; done
      [[ -e "$COPIED/$leader" ]] || echo "[trnrecipes] warning: node $leader's graphs did not reach $CACHE_COPY in 30 minutes: the run compiles what they lack" >&2
    done
  fi
  echo "[trnrecipes] compile job $JOB_ID done"
  exit 0
fi

# Seed this node's compile cache from the compile job's copy (node-local while running, never the shared claim).
if [[ -d "$CACHE_COPY" ]]; then
  if ! { mkdir -p "$NEURON_COMPILE_CACHE_URL" && cp -a -u "$CACHE_COPY/." "$NEURON_COMPILE_CACHE_URL/"; }; then
    echo "[trnrecipes] warning: merging $CACHE_COPY into $NEURON_COMPILE_CACHE_URL failed; graphs not there compile again" >&2
  fi
fi

# Health check first (a matmul per device, collectives over the job's group): a failing pod is retried.
if ! "${TORCHRUN[@]}" -m trnrecipes health --config "$RECIPE" --collectives; then
  if [[ -s "$TRNRECIPES_FATAL_FILE" ]]; then exit "$BAD_INPUT"; fi
  retry "the health check failed"
fi

# ---- Stop requests: SIGTERM (an eviction, kubectl delete) asks the trainer to save and stop, as run.sbatch's
# pre-timeout signal does: it polls this file every step. The file is on the shared run dir, so every pod's ranks
# stop with it. Removed only after the health check: its rendezvous needs every pod of this start, so none of the
# previous start is still reading it. ----
STOP_FILE="$RUN_DIR/.stop-$JOB_ID"
export TRNRECIPES_STOP_FILE="$STOP_FILE"
rm -f "$STOP_FILE" "$STOP_FILE.saved"
STOP_REASON=""
# shellcheck disable=SC2317  # called by the trap
request_stop() {
  STOP_REASON=terminated
  echo "[trnrecipes] SIGTERM: asking training to save and stop (terminationGracePeriodSeconds 277)"
  : >"$STOP_FILE"
}
trap request_stop TERM INT

echo "[trnrecipes] command: $(printf '%q ' "${TRAIN[@]}")"
"${TRAIN[@]}" &
LAUNCHER=$!
while kill -0 "$LAUNCHER" 2>/dev/null; do
  wait "$LAUNCHER" || true
done
wait "$LAUNCHER" && status=0 || status=$?
echo "[trnrecipes] training exited with status $status"
if ((status == 0)); then
  if [[ -n "$STOP_REASON" || -e "$STOP_FILE" ]]; then
    echo "[trnrecipes] stopped after a save: exit 143, the pod is recreated and resumes from the newest checkpoint"
    exit 143
  fi
  exit 0
fi
launch_failed "training" "$status"
