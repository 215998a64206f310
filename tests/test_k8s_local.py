"""k8s/entrypoint.sh run for real: two local processes given the environment the training operator sets for a 2-pod
PyTorchJob (MASTER_ADDR/MASTER_PORT, PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK) train pythia-tiny on the cpu
backend through the pre-flight, the health check and the static torchrun launch; SIGTERM to one pod saves and
stops both with the retryable 143, a second start resumes and ends 0, and the eval pod scores its last checkpoint; a
missing corpus is exit 2 on both pods."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trnrecipes import REPO_ROOT
from trnrecipes.config.recipe import load_recipe
from trnrecipes.jobs.k8s import entrypoint_script, job_name, kubectl_steps
from trnrecipes.jobs.render import render_job


def write_job(tmp: Path, overrides: str = "") -> Path:
    """pythia-tiny at 2 nodes x 1 worker, its recipe.yaml and entrypoint.sh in tmp/k8s."""
    base = "cluster.workers_per_node=1 train.log_every=1 checkpoint.every_steps=2 checkpoint.async_save=false"
    recipe = load_recipe("pythia-tiny", nodes=2, overrides=f"{base} run_dir={tmp}/run {overrides}")
    job_dir = tmp / "k8s"
    job = render_job(recipe, job_dir, "test", REPO_ROOT)
    job_dir.mkdir(exist_ok=True)
    (job_dir / "recipe.yaml").write_text(job.files["recipe.yaml"])
    script = entrypoint_script(recipe, job.layout, job_dir, "test", REPO_ROOT, tmp / "run")
    (job_dir / "entrypoint.sh").write_text(script)
    return job_dir


def start_pods(job_dir: Path, tmp: Path, tag: str) -> list[subprocess.Popen]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pods = []
    for rank in range(2):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PET_NNODES": "2",
               "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": str(rank), "RANK": str(rank), "WORLD_SIZE": "2",
               "TRNRECIPES_JOB_NAME": "job", "TRNRECIPES_POD": f"pod{rank}", "TRNRECIPES_PYTHON": sys.executable,
               "PYTHONPATH": str(REPO_ROOT), "TMPDIR": str(tmp)}  # fmt: skip
        log = open(tmp / f"{tag}-pod{rank}.log", "w")  # the pod's whole life
        argv = ["bash", str(job_dir / "entrypoint.sh"), "run"]
        pods.append(subprocess.Popen(argv, env=env, stdout=log, stderr=log))
    return pods


def wait(pods: list[subprocess.Popen], tmp: Path, tag: str) -> tuple[list[int], str]:
    codes = [pod.wait(timeout=240) for pod in pods]
    logs = "".join((tmp / f"{tag}-pod{rank}.log").read_text()[-2000:] for rank in range(2))
    return codes, logs


@pytest.mark.slow  # ~95 s on 2 busy cores: two starts of 2 pods, each through doctor, health and train; an eval
def test_sigterm_stops_both_pods_retryably_a_restart_resumes_and_the_eval_pod_scores_the_end(tmp_path):
    # 12 steps, not 4: on a fast host steps 3 and 4 took less than one look at the run dir, and the SIGTERM found the
    # run ended (step_4 saved): it must land with steps still to do.
    job_dir = write_job(tmp_path, "train.max_steps=12 train.val_every=12")
    pods = start_pods(job_dir, tmp_path, "first")
    saved = tmp_path / "run" / "checkpoints" / "step_2"
    deadline = time.time() + 180
    while not saved.exists() and time.time() < deadline and all(p.poll() is None for p in pods):
        time.sleep(0.05)
    assert saved.exists(), wait(pods, tmp_path, "first")
    pods[1].send_signal(signal.SIGTERM)  # as the kubelet does to the container's first process on an eviction
    codes, logs = wait(pods, tmp_path, "first")
    assert codes == [143, 143], logs  # retryable under ExitCode: the operator recreates the pods
    steps = sorted(int(p.name.split("_")[1]) for p in saved.parent.glob("step_*"))
    assert steps and steps[-1] < 12, steps  # stopped before the end, after a save

    codes, logs = wait(start_pods(job_dir, tmp_path, "second"), tmp_path, "second")
    assert codes == [0, 0], logs
    whole = "".join((tmp_path / f"second-pod{rank}.log").read_text() for rank in range(2))  # not only the tails
    assert "resum" in whole.lower() and (saved.parent / "step_12").exists(), logs

    # The eval Job's pod: no rendezvous, the run dir's newest checkpoint scored (one task, one item: ~15 s)
    env = {**os.environ, "TRNRECIPES_JOB_NAME": "job-eval", "TRNRECIPES_POD": "eval", "PYTHONPATH": str(REPO_ROOT),
           "TRNRECIPES_PYTHON": sys.executable, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}  # fmt: skip
    argv = ["bash", str(job_dir / "entrypoint.sh"), "eval", "--tasks", "boolq", "--limit", "1"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert (tmp_path / "run" / "eval" / "step_12" / "results.json").exists(), done.stdout[-2000:]


def test_a_missing_corpus_is_exit_2_on_every_pod(tmp_path):
    job_dir = write_job(tmp_path, f"train.max_steps=2 data.path={tmp_path}/missing.arrow")
    codes, logs = wait(start_pods(job_dir, tmp_path, "bad"), tmp_path, "bad")
    assert codes == [2, 2], logs
    assert "missing.arrow" in logs and "training exited" not in logs


def test_a_pod_that_keeps_failing_gives_up_beyond_max_restarts(tmp_path):
    """The operator recreates a pod exiting 129 by deleting it: runPolicy.backoffLimit (restartCounts) never stops
    it, so a node fault that repeats was retried forever. The pod counts its own failures on the claim."""
    recipe = load_recipe("pythia-tiny", overrides=f"slurm.max_restarts=2 run_dir={tmp_path}/run")
    job = render_job(recipe, tmp_path / "k8s", "test", REPO_ROOT)
    (tmp_path / "k8s").mkdir()
    (tmp_path / "k8s/recipe.yaml").write_text(job.files["recipe.yaml"])
    script = tmp_path / "k8s/entrypoint.sh"
    script.write_text(entrypoint_script(recipe, job.layout, tmp_path / "k8s", "test", REPO_ROOT, tmp_path / "run"))
    faulty = tmp_path / "python"  # its doctor exits 1, as on a node whose devices fail: this node's fault
    faulty.write_text("#!/bin/bash\nexit 1\n")
    faulty.chmod(0o755)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "PET_NNODES": "1",
           "PET_NPROC_PER_NODE": str(recipe.workers_per_node), "PET_NODE_RANK": "0", "TRNRECIPES_JOB_NAME": "job",
           "TRNRECIPES_POD": "job-master-0", "TRNRECIPES_PYTHON": str(faulty), "TRNRECIPES_WHEELS": ""}  # fmt: skip
    starts = [subprocess.run(["bash", str(script), "run"], env=env, capture_output=True, text=True) for _ in range(3)]
    assert [s.returncode for s in starts] == [129, 129, 2], [s.stderr[-500:] for s in starts]
    assert "(failure 2 of at most 3)" in starts[1].stderr  # the third ends it: no recreation only to give up
    assert "error: pod job-master-0 failed 3 times, more than slurm.max_restarts (2) restarts" in starts[2].stderr
    failures = tmp_path / "k8s/logs/job/failures"
    assert not any(failures.iterdir())  # the pod that gave up cleared its count: the next apply starts anew
    (failures / "run-job-master-0").write_text("x\n" * 3)  # a pod of a deleted job kept its count
    left = subprocess.run(["bash", str(script), "run"], env=env, capture_output=True, text=True)
    assert left.returncode == 2 and "failed 3 times" in left.stderr and "x" in left.stderr  # gives up at its start
    steps = kubectl_steps(recipe, tmp_path / "k8s")  # so the README's steps clear the counts before each apply
    run = job_name(recipe, "run")
    assert steps[steps.index(f"kubectl apply -f {tmp_path / 'k8s/pytorchjob.yaml'}") - 1] == (
        f"rm -rf {tmp_path / 'k8s/logs' / run / 'failures'}"
    )
