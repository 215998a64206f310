#!/usr/bin/env bash
# Peak GPU memory of trnrecipes' own training step over shapes, micro-batches, dtypes and activation-checkpointing
# modes: the measurements a memory estimate is calibrated against (issue "First run on a real Trainium cluster 2/2":
# the estimate must come within 15% of measured peak memory on every shape measured). Each line of the output is
# one bench/bench_gpu.py run (rows "ours" eager, "ours-compile" for two shapes; 1 warm-up + 2 timed steps, accum 1:
# peak memory, not speed, is the point). On a GPU machine, from a copy of the repository:
#     bash bench/sweep_gpu_memory.sh OUT_DIR      (writes OUT_DIR/sweep.jsonl and OUT_DIR/sweep.log)
# Results kept in bench/results/ with the date and the GPU.
set -uo pipefail
out=${1:?usage: bash bench/sweep_gpu_memory.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.." || exit 1
py=${PYTHON:-python3}
wide=(--hidden 4096 --layers 4 --heads 32 --ffn 11008 --vocab 32000)
narrow=(--hidden 2048 --layers 8 --heads 16 --ffn 5504 --vocab 32000)
run() {  # NAME ARGS...: one bench_gpu run, its JSON appended as one line
  local name=$1
  shift
  echo "=== $name: $*" | tee -a "$out/sweep.log"
  if "$py" bench/bench_gpu.py --accum 1 --warmup 1 --steps 2 --json "/tmp/sweep-$name.json" "$@" >>"$out/sweep.log" 2>&1; then
    "$py" -c 'import json, sys; print(json.dumps({"name": sys.argv[2], "argv": sys.argv[3:], **json.load(open(sys.argv[1]))}))' \
      "/tmp/sweep-$name.json" "$name" "$@" >>"$out/sweep.jsonl"
  else
    echo "=== $name FAILED (exit $?)" | tee -a "$out/sweep.log"
  fi
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >>"$out/sweep.log" 2>&1
for ac in none selective full; do
  run "wide-s4096-mb2-$ac" "${wide[@]}" --seq 4096 --micro-batch 2 --dtype bf16 --rows ours --activation-checkpointing "$ac"
done
run wide-s4096-mb1-selective "${wide[@]}" --seq 4096 --micro-batch 1 --dtype bf16 --rows ours --activation-checkpointing selective
run wide-s2048-mb2-selective "${wide[@]}" --seq 2048 --micro-batch 2 --dtype bf16 --rows ours --activation-checkpointing selective
for ac in none selective full; do
  run "narrow-s2048-mb4-$ac" "${narrow[@]}" --seq 2048 --micro-batch 4 --dtype bf16 --rows ours --activation-checkpointing "$ac"
done
run narrow-s2048-mb2-fp32-selective "${narrow[@]}" --seq 2048 --micro-batch 2 --dtype fp32 --rows ours --activation-checkpointing selective
run wide-s4096-mb2-selective-compile "${wide[@]}" --seq 4096 --micro-batch 2 --dtype bf16 --rows ours-compile --activation-checkpointing selective
run narrow-s2048-mb4-none-compile "${narrow[@]}" --seq 2048 --micro-batch 4 --dtype bf16 --rows ours-compile --activation-checkpointing none
echo "=== done" | tee -a "$out/sweep.log"
