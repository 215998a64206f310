"""The generated scripts under a real Slurm: Debian's slurmctld + three slurmd emulating node1 to node3 on this one
machine (tests/slurm/cluster.sh, which installs Slurm when it is missing), at an address the host name does not
resolve to. compile.sbatch, run.sbatch, eval.sbatch chained with --dependency=afterok, a 2-node torchrun rendezvous
over gloo; the pre-timeout USR1 saves, requeues and resumes bitwise; a crash is requeued and resumes bitwise; a
failure at start is not requeued; a node failing the health check is excluded from the requeued job; a job asking
for more nodes than exist is refused at submit time."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from conftest import run_cli
from safetensors.torch import load_file

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

MAX_STEPS = 60
# Quick on 2 cores: one worker per emulated node (DP 2), 32-token sequences. The reference and the preempted run
# differ only in run_dir.
# The emulated nodes have 2 CPUs each; an eval job asks for 32 by default.
SMALL = ("cluster.workers_per_node=1 batch.seq_len=32 batch.global_batch=4 batch.micro_batch=2 train.log_every=1 "
         f"train.val_every=1000 train.max_steps={MAX_STEPS} checkpoint.every_steps=50 eval.cpus=2")  # fmt: skip
NAME = "llama2-tiny-2n"
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def slurm(env: dict[str, str], *cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)


def render(
    job: Path, run_dir: Path, nodes: int = 2, overrides: str = SMALL, recipe: str = "llama2-tiny", *flags: str
) -> None:
    done = run_cli("sbatch", "--recipe", recipe, "--nodes", str(nodes), "--out", str(job),
                   "--overrides", f"{overrides} run_dir={run_dir}", *flags)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def submit(env: dict[str, str], *args: str) -> str:
    done = slurm(env, "sbatch", "--parsable", *args)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def job_info(env: dict[str, str], job_id: str) -> dict[str, str]:
    done = slurm(env, "scontrol", "show", "job", "--oneliner", job_id)
    assert done.returncode == 0, done.stderr
    return dict(re.findall(r"(\w+)=(\S*)", done.stdout))


def wait_done(
    env: dict[str, str], job_id: str, log: Path, timeout: float = 300, state: str = "COMPLETED"
) -> dict[str, str]:
    """Poll scontrol (no slurmdbd here, so no sacct) until the job ends in `state`; its log in the message if not."""
    deadline = time.monotonic() + timeout
    while True:
        info = job_info(env, job_id)
        if info["JobState"] in FINAL:
            break
        assert time.monotonic() < deadline, f"job {job_id} still {info['JobState']} after {timeout} s"
        time.sleep(0.5)
    text = log.read_text() if log.exists() else f"(no log {log})"
    assert info["JobState"] == state, f"job {job_id}: {info['JobState']} {info.get('Reason')}\n{text[-4000:]}"
    return info


def metrics(run: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}  # a replayed step's later entry wins


def weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "checkpoints" / f"step_{MAX_STEPS}" / "model.safetensors")


def assert_same_run(run: Path, reference: Path) -> None:
    """Losses of every step and the final weights bitwise equal to the uninterrupted run's."""
    ours, ref = metrics(run), metrics(reference)
    assert [ours[s] for s in range(1, MAX_STEPS + 1)] == [ref[s] for s in range(1, MAX_STEPS + 1)]
    a, b = weights(run), weights(reference)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def reference(slurm_env, tmp_path_factory):
    """compile.sbatch, then run.sbatch after it (afterok): the uninterrupted run, also the resume reference."""
    tmp = tmp_path_factory.mktemp("slurm-ref")
    job, run = tmp / "job", tmp / "run"
    render(job, run)
    compile_id = submit(slurm_env, str(job / "compile.sbatch"))
    run_id = submit(slurm_env, f"--dependency=afterok:{compile_id}", str(job / "run.sbatch"))
    # eval.sbatch's arguments go to `trnrecipes eval run`: a quick GSM8K + HumanEval on the newest checkpoint
    eval_id = submit(slurm_env, f"--dependency=afterok:{run_id}", str(job / "eval.sbatch"),
                     "--tasks", "gsm8k,humaneval", "--limit", "1", "--max-gen-toks", "8")  # fmt: skip
    compile_info = wait_done(slurm_env, compile_id, job / "logs" / f"{NAME}-compile-{compile_id}.out")
    run_info = wait_done(slurm_env, run_id, job / "logs" / f"{NAME}-{run_id}.out")
    return {"job": job, "run": run, "compile_id": compile_id, "run_id": run_id, "eval_id": eval_id,
            "compile_info": compile_info, "run_info": run_info, "addr": slurm_env["NODE_ADDR"]}  # fmt: skip


def test_compile_then_run_on_two_nodes(reference):
    job, run, cid, rid = reference["job"], reference["run"], reference["compile_id"], reference["run_id"]
    for info in (reference["compile_info"], reference["run_info"]):
        assert info["NumNodes"] == "2" and info["NodeList"] == "node[1-2]" and info["ExitCode"] == "0:0"
    assert reference["run_info"]["Dependency"] == "(null)" and reference["run_info"]["Restarts"] == "0"

    # Log names carry the job id; each attempt's torchrun logs carry the job id and the restart count.
    compile_log = (job / "logs" / f"{NAME}-compile-{cid}.out").read_text()
    addr = reference["addr"]
    assert f"compile job {cid} restart 0: 2 node(s) x 1 workers, rendezvous {addr}:" in compile_log
    compiled = "compile (tracing every graph; nothing is written): llama2-tiny on cpu, 2 rank(s) = PP 1 x DP 2"
    assert compiled in compile_log
    assert f"compile job {cid} done" in compile_log
    out = (job / "logs" / f"{NAME}-{rid}.out").read_text()
    assert f"run job {rid} restart 0: 2 node(s) x 1 workers, rendezvous {addr}:" in out
    # One torchrun agent per node and launch (srun --ntasks-per-node=1); by default the workers' own log files stay
    # node-local: compile.sbatch launches once (train --compile), run.sbatch twice (health check, train).
    for job_id, launches in ((cid, 1), (rid, 2)):
        assert not [p for p in (job / "logs" / f"{job_id}.r0").iterdir() if p.is_dir()]
        local = Path(os.environ.get("TMPDIR", "/tmp")) / "trnrecipes-logs" / f"{job_id}.r0"
        assert len([p for p in local.iterdir() if p.is_dir()]) == 2 * launches, sorted(local.iterdir())
    assert re.search(r"\[health\] .* rank 0/2: cpu matmul", out) and re.search(r"\[health\] .* rank 1/2: cpu", out)
    assert "[health] collectives over 2 ranks: ok" in out
    # The nodes' Slurm address is one the host name does not resolve to (tests/slurm/cluster.sh), so torchrun's
    # c10d rendezvous would find no node to host its store; the static rendezvous (node 0 hosts) does not ask.
    assert addr not in {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None)}, addr
    assert "--rdzv-backend=static" in out
    # Every node's torchrun advertised its Slurm NodeAddr, not its host name: the workers' MASTER_ADDR (and
    # Neuron's root comm id) is that address.
    assert len(re.findall(rf"\[health\] .*: cpu matmul .* rendezvous host {re.escape(addr)}$", out, re.M)) == 2, out
    assert "train: llama2-tiny on cpu, 2 rank(s) = PP 1 x DP 2 x TP 1" in out
    assert f"step {MAX_STEPS}/{MAX_STEPS} | loss" in out and "training exited with status 0" in out
    assert "resuming from" not in out

    losses = metrics(run)
    assert sorted(losses) == list(range(1, MAX_STEPS + 1))
    last = [losses[s] for s in range(MAX_STEPS - 9, MAX_STEPS + 1)]
    assert sum(last) / len(last) < losses[1] - 1.0, (losses[1], last)  # the loss fell
    assert (run / "checkpoints" / f"step_{MAX_STEPS}" / "done").exists()
    assert (run / "checkpoints" / f"step_{MAX_STEPS}" / "model.safetensors").exists()


def test_eval_job_after_the_run_evaluates_its_newest_checkpoint(slurm_env, reference):
    job, run, eval_id = reference["job"], reference["run"], reference["eval_id"]
    info = wait_done(slurm_env, eval_id, job / "logs" / f"{NAME}-eval-{eval_id}.out", timeout=600)
    assert info["NumNodes"] == "1" and info["ExitCode"] == "0:0"
    out = (job / "logs" / f"{NAME}-eval-{eval_id}.out").read_text()
    assert f"evaluating {run / 'checkpoints' / f'step_{MAX_STEPS}'}, the newest complete checkpoint" in out
    assert "| Math: gsm8k | 8 | exact_match |" in out and "| Code: humaneval | 0 | pass@1 |" in out
    report = json.loads((run / "eval" / f"step_{MAX_STEPS}" / "results.json").read_text())
    assert [r["task"] for r in report["results"]] == ["gsm8k", "humaneval"] and report["limit"] == 1


def test_a_pipeline_over_two_nodes_trains_saves_both_stages_and_is_evaluated(slurm_env, tmp_path):
    """neox-tiny at layout.pp=2: stage 0 (embedding, layer 0) on node1, stage 1 (layer 1, norm, head) on node2."""
    job, run, steps = tmp_path / "job", tmp_path / "run", 40
    render(job, run, recipe="neox-tiny", overrides=f"{SMALL} layout.pp=2 train.max_steps={steps}")
    compile_id = submit(slurm_env, str(job / "compile.sbatch"))
    run_id = submit(slurm_env, f"--dependency=afterok:{compile_id}", str(job / "run.sbatch"))
    eval_id = submit(slurm_env, f"--dependency=afterok:{run_id}", str(job / "eval.sbatch"),
                     "--tasks", "gsm8k", "--limit", "1", "--max-gen-toks", "8")  # fmt: skip
    wait_done(slurm_env, compile_id, job / "logs" / f"neox-tiny-2n-compile-{compile_id}.out")
    wait_done(slurm_env, run_id, job / "logs" / f"neox-tiny-2n-{run_id}.out")
    out = (job / "logs" / f"neox-tiny-2n-{run_id}.out").read_text()
    assert "train: neox-tiny on cpu, 2 rank(s) = PP 2 x DP 1 x TP 1" in out
    losses = metrics(run)
    assert sorted(losses) == list(range(1, steps + 1))
    last = [losses[s] for s in range(steps - 9, steps + 1)]
    assert sum(last) / len(last) < losses[1] - 1.0, (losses[1], last)  # the loss fell
    saved = {p.name for p in (run / "checkpoints" / f"step_{steps}").iterdir()}
    assert {"model-pp00-of-02-tp00-of-01.safetensors", "model-pp01-of-02-tp00-of-01.safetensors"} <= saved
    info = wait_done(slurm_env, eval_id, job / "logs" / f"neox-tiny-2n-eval-{eval_id}.out", timeout=600)
    assert info["ExitCode"] == "0:0"
    report = json.loads((run / "eval" / f"step_{steps}" / "results.json").read_text())
    assert [r["task"] for r in report["results"]] == ["gsm8k"]


def test_pre_timeout_signal_saves_requeues_and_resumes_bitwise(slurm_env, reference, tmp_path):
    job, run = tmp_path / "job", tmp_path / "run"
    render(job, run)
    job_id = submit(slurm_env, str(job / "run.sbatch"))
    log = job / "logs" / f"{NAME}-{job_id}.out"

    # Wait until training is under way, then send what Slurm sends before the time limit (--signal=B:USR1@N).
    deadline = time.monotonic() + 240
    while not ((run / "metrics.jsonl").exists() and len((run / "metrics.jsonl").read_text().splitlines()) >= 5):
        assert time.monotonic() < deadline, log.read_text() if log.exists() else "no log"
        assert job_info(slurm_env, job_id)["JobState"] in {"PENDING", "RUNNING"}
        time.sleep(0.1)
    done = slurm(slurm_env, "scancel", "--signal=USR1", "--batch", job_id)
    assert done.returncode == 0, done.stderr

    info = wait_done(slurm_env, job_id, log)
    assert info["Restarts"] == "1" and info["NumNodes"] == "2"
    out = log.read_text()  # --open-mode=append: both attempts in one file
    first, second = out.split(f"run job {job_id} restart 1:")
    assert f"run job {job_id} restart 0:" in first
    assert "timeout: asking training to save and stop" in first
    saved = re.search(r"stop requested \(stop file\): saved at step (\d+), exiting", first)
    assert saved, first[-3000:]
    step = int(saved.group(1))
    assert 5 <= step < MAX_STEPS
    assert f"checkpoint saved at step {step} before the time limit: requeueing job {job_id}" in first
    assert f"resuming from {run}/checkpoints/step_{step} (step {step})" in second
    assert f"steps {step + 1}-{MAX_STEPS}" in second and "training exited with status 0" in second
    assert (job / "logs" / f"{job_id}.r0").is_dir() and (job / "logs" / f"{job_id}.r1").is_dir()
    assert not (job / "logs" / f"{job_id}.failures").exists()  # progress, not a failure

    # The interrupted run ends exactly where the uninterrupted one did.
    assert_same_run(run, reference["run"])


def crash_at_step_25(env: dict[str, str], slurm_env: dict[str, str], tmp_path: Path) -> tuple[Path, str, dict, str]:
    """A 2-node run checkpointing every 10 steps whose rank 1 (node2) is SIGKILLed after step 25, once, submitted
    with `env`: (run dir, job id, its final job info, its log), the job having completed."""
    job, run = tmp_path / "job", tmp_path / "run"
    render(job, run, overrides=f"{SMALL} checkpoint.every_steps=10")
    crashed = tmp_path / "crashed"
    job_id = submit({**env, "TRNRECIPES_CRASH_ONCE": f"{crashed}:25:1"}, str(job / "run.sbatch"))
    log = job / "logs" / f"{NAME}-{job_id}.out"
    info = wait_done(slurm_env, job_id, log, timeout=420)
    assert info["ExitCode"] == "0:0" and crashed.read_text().strip() == "25"
    return run, job_id, info, log.read_text()


def test_a_crash_mid_run_is_requeued_and_resumes_bitwise(slurm_env, reference, tmp_path):
    """Rank 1 (node2) is killed (SIGKILL) after step 25, once: the job requeues itself, resumes from step 20 and ends
    where the uninterrupted run did."""
    run, job_id, info, out = crash_at_step_25(slurm_env, slurm_env, tmp_path)
    job = tmp_path / "job"
    assert info["Restarts"] == "1"
    first, second = out.split(f"run job {job_id} restart 1:")
    assert "training exited with status 0" not in first
    assert re.search(rf"training failed \(exit status \d+\): requeueing job {job_id} \(failure requeue 1 of 3\)", first)
    assert "running the health check again to find a failed node" in first
    assert "excluded node" not in first  # the health check after the crash found every node healthy
    assert f"resuming from {run}/checkpoints/step_20 (step 20)" in second
    assert "training exited with status 0" in second
    assert len((job / "logs" / f"{job_id}.failures").read_text().splitlines()) == 1
    assert_same_run(run, reference["run"])


def hyperpod_env(slurm_env: dict[str, str], tmp: Path, give_up: bool = False) -> tuple[dict[str, str], Path]:
    """A stand-in SageMaker HyperPod: its marker directory, and an `srun` first on PATH that logs its arguments and,
    given --auto-resume=1 (which stock Slurm does not know), runs the step and, when it fails, once more, as
    HyperPod does after replacing the failed node (unless `give_up`: then it fails as HyperPod does when it cannot)."""
    real = subprocess.run(["bash", "-c", "command -v srun"], capture_output=True, text=True, env=slurm_env)
    assert real.returncode == 0, real.stderr
    marker, bin_dir, calls = tmp / "sagemaker_cluster", tmp / "bin", tmp / "srun-calls"
    marker.mkdir()
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f"""#!/bin/bash
{{ printf '%q ' "$@"; echo; }} >>{calls}  # one line a call: the inner script's newlines escaped
args=() auto=0
for arg in "$@"; do if [[ "$arg" == --auto-resume=1 ]]; then auto=1; else args+=("$arg"); fi; done
if ((auto)); then
  {real.stdout.strip()} "${{args[@]}}" && exit 0
  {"exit 1" if give_up else 'echo "[hyperpod stand-in] the step failed: node replaced, step restarted" >&2'}
fi
exec {real.stdout.strip()} "${{args[@]}}"
""")
    (bin_dir / "srun").chmod(0o755)
    env = {**slurm_env, "PATH": f"{bin_dir}:{slurm_env['PATH']}", "TRNRECIPES_HYPERPOD_MARKER": str(marker)}
    return env, calls


def test_on_hyperpod_its_auto_resume_restarts_a_crashed_step_and_the_job_is_not_requeued(
    slurm_env, reference, tmp_path
):
    """slurm.hyperpod null (auto) with the marker present: the training step runs under srun --auto-resume=1 (the health
    check and pre-flight do not), rank 1 is killed after step 25, the stand-in restarts the step once, training
    resumes from step 20 in the same job (no requeue) and ends where the uninterrupted run did."""
    env, calls = hyperpod_env(slurm_env, tmp_path)
    run, _, info, out = crash_at_step_25(env, slurm_env, tmp_path)
    assert info["Restarts"] == "0"
    assert "SageMaker HyperPod (slurm.hyperpod null:" in out and "exists)" in out
    assert "requeueing" not in out and f"resuming from {run}/checkpoints/step_20 (step 20)" in out
    resumed = [line for line in calls.read_text().splitlines() if "--auto-resume=1" in line]
    assert len(resumed) == 1 and "trnrecipes train" in resumed[0]  # the training step only
    assert out.count("training exited with status 0") == 1
    assert_same_run(run, reference["run"])


def test_when_hyperpod_cannot_recover_the_job_fails_without_a_requeue(slurm_env, tmp_path):
    """slurm.hyperpod true, and the stand-in gives up on the crashed step: run.sbatch adds no requeue of its own."""
    job, run = tmp_path / "job", tmp_path / "run"
    render(job, run, overrides=f"{SMALL} checkpoint.every_steps=10 slurm.hyperpod=true")
    env, calls = hyperpod_env(slurm_env, tmp_path, give_up=True)
    env.pop("TRNRECIPES_HYPERPOD_MARKER")  # true: no marker needed
    job_id = submit({**env, "TRNRECIPES_CRASH_ONCE": f"{tmp_path / 'crashed'}:5:1"}, str(job / "run.sbatch"))
    log = job / "logs" / f"{NAME}-{job_id}.out"
    info = wait_done(slurm_env, job_id, log, timeout=300, state="FAILED")
    assert info["Restarts"] == "0" and info["ExitCode"] == "1:0"
    out = log.read_text()
    assert "SageMaker HyperPod (slurm.hyperpod true)" in out and "this script does not requeue" in out
    assert "requeueing job" not in out and not (job / "logs" / f"{job_id}.failures").exists()
    assert any("--auto-resume=1" in line for line in calls.read_text().splitlines())


def test_a_run_failing_at_start_on_bad_input_is_not_requeued(slurm_env, tmp_path):
    """The corpus passes every check before training (it exists, it is Arrow with a text column and no nulls, it has
    documents enough: what sbatch and the pre-flight read) but half its rows are not UTF-8, which only reading the
    texts finds: each rank stops as bad input naming a row, and the job is not requeued. (A corpus without its text
    column, or a missing one, is refused earlier: by sbatch, and by the pre-flight on the nodes.)"""
    job, run, corpus = tmp_path / "job", tmp_path / "run", tmp_path / "bad.arrow"
    render(job, run, 2, f"{SMALL} data.path={corpus}", "llama2-tiny", "--no-data-check")
    texts = [b"\xff\xfe not UTF-8" if i % 2 == 0 else f"a good document {i}".encode() for i in range(40)]
    offsets = pa.py_buffer(np.cumsum([0] + [len(t) for t in texts]).astype(np.int64).tobytes())
    column = pa.Array.from_buffers(pa.large_string(), len(texts), [None, offsets, pa.py_buffer(b"".join(texts))])
    with pa.OSFile(str(corpus), "wb") as sink, pa.ipc.new_stream(sink, pa.schema([("text", pa.large_string())])) as w:
        w.write_batch(pa.record_batch([column], names=["text"]))
    job_id = submit(slurm_env, str(job / "run.sbatch"))
    log = job / "logs" / f"{NAME}-{job_id}.out"
    info = wait_done(slurm_env, job_id, log, state="FAILED")
    assert info["Restarts"] == "0" and info["ExitCode"] == "2:0"
    out = log.read_text()
    assert "training failed on something a requeue would repeat; not requeueing" in out, out[-3000:]
    # each message once, with the number of ranks that reported it
    bad = re.escape(f"{corpus}: row ") + r"\d+ cannot be read or tokenized"
    assert re.search(rf"^  [12] error: {bad}", out, re.M), out[-3000:]
    assert "requeueing job" not in out and not (job / "logs" / f"{job_id}.failures").exists()


def test_a_node_failing_the_health_check_is_excluded_from_the_requeued_job(slurm_env, tmp_path):
    """node2 reports a wrong matmul and wrong collective data: the job requeues without it and trains on node1 and
    node3 (the test cluster's third node)."""
    job, run = tmp_path / "job", tmp_path / "run"
    render(job, run, overrides=f"{SMALL} train.max_steps=5")
    job_id = submit({**slurm_env, "TRNRECIPES_HEALTH_FAULT_NODE": "node2"}, str(job / "run.sbatch"))
    log = job / "logs" / f"{NAME}-{job_id}.out"
    info = wait_done(slurm_env, job_id, log, timeout=420)
    assert info["Restarts"] == "1" and info["ExcNodeList"] == "node2" and info["NodeList"] == "node[1,3]"
    out = log.read_text()
    first, second = out.split(f"run job {job_id} restart 1:")
    assert "FAILED on node node2" in first and "train:" not in first
    requeued = f"health check failed (the health check names node2): requeueing job {job_id} (failure requeue 1 of 3)"
    assert requeued in first
    assert f"excluded node(s) node2 from job {job_id}" in first
    assert "[health] collectives over 2 ranks: ok" in second and "step 5/5" in second
    assert (job / "logs" / f"{job_id}.r0" / "bad-nodes").read_text().split() == ["node2"]


def test_a_job_larger_than_the_cluster_is_refused_at_submit(slurm_env, tmp_path):
    render(tmp_path / "job", tmp_path / "run", nodes=4, overrides="cluster.workers_per_node=1 batch.global_batch=8")
    for args in (["--test-only"], []):
        done = slurm(slurm_env, "sbatch", *args, str(tmp_path / "job" / "run.sbatch"))
        assert done.returncode == 1
        assert "Node count specification invalid" in done.stderr, done.stderr
    assert "llama2-tiny-4n" not in slurm(slurm_env, "squeue", "--noheader", "--format=%j").stdout
