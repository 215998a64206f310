"""Pipeline parallelism on real torch.distributed (gloo), a process a rank, OMP_NUM_THREADS=1, fp32, 5 AdamW steps with
clipping active: a pipelined run is bitwise the unpipelined one (losses, every gradient, grad and parameter norms,
validation loss, final weights), for both families, every schedule, an uneven split, activation checkpointing, and
with TP (SP off and on) and DP beside it. Checkpoints cross PP sizes both ways and survive SIGKILL."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO, rank_launcher
from test_resume import finish, last_losses, wait_for_step

from trnrecipes.config.recipe import load_recipe

pytestmark = pytest.mark.slow

# 4 micro-batches of 1 per step (1F1B needs at least as many as stages); clip 0.5 (every step's norm is above it)
FIXED = ["batch.seq_len=32", "batch.global_batch=4", "batch.micro_batch=1", "optim.clip_grad_norm=0.5"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # the same intra-op threads for every layout: bitwise comparable


def launcher(nproc: int, *args: str) -> list[str]:
    if nproc == 1:
        return [sys.executable, *args]
    return [*rank_launcher(nproc), *args]


def worker(tmp_path: Path, name: str, nproc: int, *overrides: str) -> dict:
    """tests/pp_worker.py's records, joined over ranks: each parameter from whichever stage holds it (replicas and
    TP ranks must agree on everything they both report)."""
    out = tmp_path / f"{name}-{nproc}-{abs(hash(overrides))}"
    cmd = launcher(nproc, str(REPO / "tests/pp_worker.py"), str(out), name, *FIXED,
                   f"cluster.workers_per_node={nproc}", *overrides)  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=ENV)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = [torch.load(f"{out}.rank{r}", weights_only=True) for r in range(nproc)]
    joined = {k: ranks[0][k] for k in ("losses", "norms", "val_loss", "param_norm")}
    for r in ranks[1:]:
        assert {k: r[k] for k in joined} == joined  # every rank learns the same loss and norms
    joined["grads"] = [_union([r["grads"][i] for r in ranks]) for i in range(len(ranks[0]["grads"]))]
    joined["params"] = _union([r["params"] for r in ranks])
    return joined


def _union(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for part in parts:
        for k, v in part.items():
            assert k not in out or torch.equal(out[k], v), k
            out[k] = v
    return out


def assert_same_run(a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"] and a["norms"] == b["norms"]
    assert a["val_loss"] == b["val_loss"] and a["param_norm"] == b["param_norm"]
    assert all(n > 0.5 for n in a["norms"])  # clipping was active
    for step, (ga, gb) in enumerate(zip(a["grads"], b["grads"], strict=True)):
        assert ga.keys() == gb.keys()
        for k in ga:
            assert torch.equal(ga[k], gb[k]), (step, k)
    assert a["params"].keys() == b["params"].keys()
    for k in a["params"]:
        assert torch.equal(a["params"][k], b["params"][k]), k


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Unpipelined runs, each made once and shared by the cases that compare against it."""
    cache: dict[tuple, dict] = {}

    def get(name: str, nproc: int, *overrides: str) -> dict:
        key = (name, nproc, overrides)
        if key not in cache:
            cache[key] = worker(tmp_path_factory.mktemp("ref"), name, nproc, *overrides)
        return cache[key]

    return get


@pytest.mark.parametrize(
    ("name", "pipelined", "unpipelined"),
    [
        ("pythia-tiny", ["layout.pp_schedule=1f1b"], []),
        ("pythia-tiny", ["layout.pp_schedule=gpipe"], []),
        ("llama2-tiny", ["layout.pp_schedule=1f1b"], []),
        ("llama2-tiny", ["layout.pp_schedule=gpipe"], []),
        # 3 layers over 2 stages: the later stage holds 2
        ("pythia-tiny", ["model.num_layers=3"], ["model.num_layers=3"]),
        # against the run without recomputation: checkpointing changes memory, not values
        ("llama2-tiny", ["model.activation_checkpointing=full"], []),
        # 4 stages (1 layer each) on 2 ranks, stages 0 and 2 on rank 0; 3 validation batches, which
        # interleaving's whole rounds of 2 could not run (validation takes the looped forward-only schedule)
        ("pythia-tiny", ["layout.pp_schedule=interleaved_1f1b", "layout.pp_virtual_stages=2", "train.val_batches=3"],
         ["train.val_batches=3"]),
    ],
    ids=["neox-1f1b", "neox-gpipe", "llama2-1f1b", "llama2-gpipe", "uneven-3-over-2", "full-recompute",
         "interleaved"],
)  # fmt: skip
def test_pp2_is_bitwise_pp1(tmp_path: Path, reference, name: str, pipelined: list[str], unpipelined: list[str]):
    assert_same_run(worker(tmp_path, name, 2, "layout.pp=2", *pipelined), reference(name, 1, *unpipelined))


@pytest.mark.parametrize("sp", ["false", "true"])
def test_pp2_by_tp2_is_bitwise_tp2(tmp_path: Path, reference, sp: str):
    tp = ["layout.tp=2", f"layout.sequence_parallel={sp}"]
    assert_same_run(worker(tmp_path, "llama2-tiny", 4, "layout.pp=2", *tp), reference("llama2-tiny", 2, *tp))


def test_pp2_by_dp2_is_bitwise_dp2(tmp_path: Path, reference):
    dp = ["batch.global_batch=8"]  # 4 micro-batches per pipeline at DP 2
    assert_same_run(worker(tmp_path, "pythia-tiny", 4, "layout.pp=2", *dp), reference("pythia-tiny", 2, *dp))


# ---------------------------------------------------------------- checkpoints across PP sizes, and SIGKILL

RUN = ["batch.seq_len=32", "batch.global_batch=4", "batch.micro_batch=2", "train.log_every=1",
       "train.val_every=1000", "checkpoint.every_steps=5"]  # fmt: skip


def config(tmp_path: Path, run: Path, pp: int, steps: int) -> Path:
    recipe = load_recipe(
        "llama2-tiny",
        overrides=[*RUN, f"layout.pp={pp}", f"cluster.workers_per_node={pp}", f"run_dir={run}",
                   f"train.max_steps={steps}"],
    )  # fmt: skip
    cfg = tmp_path / f"cfg-pp{pp}-{steps}.yaml"
    cfg.write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))
    return cfg


def train(tmp_path: Path, run: Path, pp: int, steps: int) -> subprocess.Popen:
    cmd = launcher(pp, "-m", "trnrecipes", "train", "--config", str(config(tmp_path, run, pp, steps)))
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants at once, as Slurm ends a job step (torchrun starts its workers in
    sessions of their own, so killing its process group would leave them training; tests/ranks.py does not, and is
    killed the same way)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    for p in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


STEPS = 30  # enough that a kill lands mid-run (a step takes a few ms)


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> dict[int, float]:
    """The uninterrupted reference at PP 1."""
    tmp = tmp_path_factory.mktemp("straight")
    finish(train(tmp, tmp / "run", 1, STEPS))
    return last_losses(tmp / "run")


@pytest.mark.parametrize(("first", "then"), [(2, 1), (1, 2)], ids=["pp2-to-pp1", "pp1-to-pp2"])
def test_a_checkpoint_resumes_at_another_pipeline_size_bitwise(tmp_path: Path, straight, first: int, then: int):
    run = tmp_path / "run"
    finish(train(tmp_path, run, first, 5))
    files = {p.name for p in (run / "checkpoints/step_5").iterdir()}
    if first == 2:  # each stage's weights and moments in its own files
        assert {"model-pp00-of-02-tp00-of-01.safetensors", "model-pp01-of-02-tp00-of-01.safetensors",
                "optim-pp01-of-02-tp00-of-01.safetensors", "shards-pp01-of-02.json"} <= files  # fmt: skip
    out = finish(train(tmp_path, run, then, STEPS))
    assert "resuming from" in out and "(step 5)" in out
    losses = last_losses(run)
    assert [losses[s] for s in range(6, STEPS + 1)] == [straight[s] for s in range(6, STEPS + 1)]


def test_a_sigkilled_pp2_run_resumes_bitwise(tmp_path: Path, straight):
    run = tmp_path / "run"
    proc = train(tmp_path, run, 2, STEPS)
    wait_for_step(run, 12, proc)
    kill_tree(proc.pid)  # the launcher and both workers, mid-run
    proc.wait()
    out = finish(train(tmp_path, run, 2, STEPS))
    resumed = re.search(r"resuming from \S+ \(step (\d+)\)", out)
    assert resumed and 5 <= int(resumed[1]) < STEPS, out  # the newest save the kill did not interrupt
    losses = last_losses(run)
    after = range(int(resumed[1]) + 1, STEPS + 1)
    assert [losses[s] for s in after] == [straight[s] for s in after]


@pytest.fixture(scope="module")
def pp2_checkpoint(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("pp2")
    finish(train(tmp, tmp / "run", 2, 5))
    return tmp / "run/checkpoints/step_5"


def test_consolidation_is_the_union_of_the_stages(pp2_checkpoint: Path):
    from trnrecipes.checkpoint import consolidate, verify_training
    from trnrecipes.models import build_model

    verify_training(pp2_checkpoint)
    full = consolidate(pp2_checkpoint)
    model = build_model(load_recipe("llama2-tiny").model, "meta")
    assert set(full) == set(model.state_dict())  # every tensor, once, under the full model's names


def test_a_missing_stage_file_fails_loudly_and_names_it(pp2_checkpoint: Path, tmp_path: Path):
    import shutil

    from trnrecipes.checkpoint import CheckpointError, consolidate, verify

    ckpt = Path(shutil.copytree(pp2_checkpoint, tmp_path / "step_5"))
    (ckpt / "model-pp01-of-02-tp00-of-01.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model-pp01-of-02-tp00-of-01\.safetensors"):
        verify(ckpt)
    with pytest.raises(CheckpointError, match=r"model-pp01-of-02-tp00-of-01\.safetensors"):
        consolidate(ckpt)


def test_a_tensor_in_two_stages_or_in_none_is_refused(pp2_checkpoint: Path, tmp_path: Path):
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from trnrecipes.checkpoint import CheckpointError, consolidate

    ckpt = Path(shutil.copytree(pp2_checkpoint, tmp_path / "twice"))
    stage1 = ckpt / "shards-pp01-of-02.json"
    dims = json.loads(stage1.read_text())
    stage1.write_text(json.dumps({"dims": {**dims["dims"], "embed.weight": None}}))
    with pytest.raises(CheckpointError, match=r"embed\.weight is in pipeline stage 0's files and in stage 1's"):
        consolidate(ckpt)
    ckpt = Path(shutil.copytree(pp2_checkpoint, tmp_path / "none"))
    weights = ckpt / "model-pp01-of-02-tp00-of-01.safetensors"
    save_file({k: v for k, v in load_file(weights).items() if k != "head.weight"}, weights)
    with pytest.raises(CheckpointError, match=r"no weights for head\.weight \(pipeline stage 1\)"):
        consolidate(ckpt)
