"""The generated scripts run as plain `bash` on one machine with no Slurm: the `make demo` path."""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import uuid
from pathlib import Path

import pytest
from conftest import run_cli

from trnrecipes.config.recipe import load_recipe

pytestmark = pytest.mark.slow


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _bash(script, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return subprocess.run(
        ["bash", str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**clean, "MASTER_PORT": _free_port(), **env},
    )


def test_run_sbatch_runs_locally_with_quoted_paths(tmp_path):
    canary = f"/tmp/trnrecipes-canary-{uuid.uuid4().hex}"
    run_dir = tmp_path / f"it's a $(touch {canary}) run"
    job = tmp_path / "job"
    done = run_cli(
        "sbatch",
        "--recipe",
        "neox-tiny",
        "--nodes",
        "1",
        "--out",
        str(job),
        "--overrides",
        f"{shlex.quote(f'run_dir={run_dir}')} train.max_steps=6 train.val_every=3 checkpoint.every_steps=3",
    )
    assert done.returncode == 0, done.stderr
    done = _bash(job / "run.sbatch")
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    # The job log shows local rank 0 only (--local-ranks-filter=0); rank 1's output stays in its node-local file.
    assert re.findall(r"\[health\] .* rank [01]/2: cpu matmul 512\^3 ok", out) == [
        re.search(r"\[health\] .* rank 0/2: cpu matmul 512\^3 ok", out).group(0)
    ]
    assert "train: neox-tiny on cpu, 2 rank(s) = PP 1 x DP 2 x TP 1" in out
    assert re.search(r"step 6/6 \| loss [0-9.]+ \| val [0-9.]+", out)
    # what a person watching needs: the parameter norm, the tokens seen, elapsed time and ETA (0 at the end)
    batch = load_recipe("neox-tiny").batch
    tokens = 6 * batch.global_batch * batch.seq_len
    last = re.search(r"step 6/6 \|.*", out).group(0)
    ending = rf"\| {tokens / 1000:.4g}k tokens \| \d+:\d\d:\d\d elapsed, ETA 0:00:00$"
    assert re.search(r"\| param [0-9.]+ \|.* " + ending, last), last
    assert "training exited with status 0" in out
    assert (run_dir / "checkpoints/step_6/done").exists() and (run_dir / "metrics.jsonl").exists()
    job_id = re.search(r"run job (local-[0-9-]+) restart 0", out).group(1)
    # Logs carry the job id (and, per attempt, the restart count).
    assert (job / "logs" / f"neox-tiny-1n-{job_id}.out").read_text() == out
    assert (job / "logs" / f"{job_id}.r0").is_dir()
    local_logs = Path(os.environ.get("TMPDIR", "/tmp")) / "trnrecipes-logs" / f"{job_id}.r0"
    rank1 = "".join(p.read_text() for p in local_logs.glob("*/attempt_0/1/stdout.log"))
    assert re.search(r"\[health\] .* rank 1/2: cpu matmul 512\^3 ok", rank1), sorted(local_logs.rglob("*"))
    assert run_dir.is_dir() and not os.path.exists(canary)


def test_qwen3_moe_trains_under_run_sbatch_with_its_experts_over_two_ranks(tmp_path):
    job, run_dir = tmp_path / "job", tmp_path / "run"
    overrides = f"layout.ep=2 run_dir={run_dir} train.max_steps=4 train.val_every=4"
    done = run_cli("sbatch", "--recipe", "qwen3-moe-tiny", "--nodes", "1", "--out", str(job), "--overrides", overrides)
    assert done.returncode == 0, done.stderr
    done = _bash(job / "run.sbatch")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "train: qwen3-moe-tiny on cpu, 2 rank(s) = PP 1 x DP 2 (experts over EP 2) x TP 1" in done.stdout
    assert re.search(r"step 4/4 \| loss [0-9.]+ \| val [0-9.]+ \|.* \| aux [0-9.]+ busiest [0-9.]+x \|", done.stdout)
    assert (run_dir / "checkpoints/step_4/done").exists()


def test_compile_sbatch_runs_locally(tmp_path):
    job = tmp_path / "job"
    run_dir = tmp_path / "run"  # not the checkout's runs/llama2-tiny-1n, which the job's setup would make
    sbatch = ["sbatch", "--recipe", "llama2-tiny", "--nodes", "1", "--out", str(job)]
    assert run_cli(*sbatch, "--overrides", f"run_dir={run_dir}").returncode == 0
    done = _bash(job / "compile.sbatch")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "compile (tracing every graph; nothing is written): llama2-tiny on cpu, 2 rank(s)" in done.stdout
    assert "compile job local-" in done.stdout and "step 2/2" in done.stdout
    assert run_dir.is_dir()  # the job's setup made the run dir it was given


def test_a_multi_node_job_refuses_to_run_outside_slurm(tmp_path):
    job = tmp_path / "job"
    assert run_cli("sbatch", "--recipe", "neox-tiny", "--nodes", "2", "--out", str(job)).returncode == 0
    done = _bash(job / "run.sbatch")
    assert done.returncode == 2
    assert "this job was made for 2 node(s) but has 1" in done.stdout  # outside Slurm, stderr goes to the log too


def test_a_world_size_that_does_not_match_the_layout_fails_before_training(tmp_path):
    job = tmp_path / "job"
    assert run_cli("sbatch", "--recipe", "neox-tiny", "--nodes", "1", "--out", str(job)).returncode == 0
    done = run_cli("train", "--config", str(job / "recipe.yaml"), env={"WORLD_SIZE": "3", "RANK": "0"})
    assert done.returncode == 2
    expected = "launched with 3 rank(s), but recipe neox-tiny at 1 node(s) needs 2 (PP 1 x DP 2 x TP 1); use its"
    assert expected in done.stderr


def test_neuron_compile_job_stops_when_graphs_failed_to_compile(tmp_path):
    """neuron_parallel_compile caches a failed graph as failed and later runs skip it: compile.sbatch must fail on
    its summary instead of handing that cache to run.sbatch. A stand-in for the tool prints AWS's summary line; the
    job's Python is a stand-in Neuron SDK 2.26 venv (tests/neuron_standin.py), so the pre-flight passes."""
    from neuron_standin import megatron_corpus, neuron_ls, standin_venv

    job, corpus = tmp_path / "job", megatron_corpus(tmp_path / "wiki")
    overrides = f"run_dir={tmp_path / 'run'} data.path={corpus}"
    rendered = run_cli("sbatch", "--recipe", "pythia-70m", "--nodes", "1", "--no-data-check", "--out", str(job),
                       "--overrides", overrides)  # fmt: skip
    assert rendered.returncode == 0, rendered.stderr
    bin_dir = tmp_path / "bin"
    neuron_ls(bin_dir, devices=16, cores_per_device=2)
    tool = bin_dir / "neuron_parallel_compile"
    tool.write_text("#!/bin/sh\necho 'INFO ||NEURON_PARALLEL_COMPILE||: Total failed compilations: 2'\n")
    tool.chmod(0o755)
    python = standin_venv(tmp_path / "venv", "2.26", compile_tool=False)
    done = _bash(job / "compile.sbatch", PATH=f"{bin_dir}:{os.environ['PATH']}", TRNRECIPES_PYTHON=str(python))
    assert done.returncode == 1, done.stdout[-2000:]
    assert "neuron_parallel_compile reports 'Total failed compilations: 2'" in done.stdout  # the log gets stderr
    assert "--retry_failed_compilation" in done.stdout
