"""FSDP2 (layout.fsdp, trnrecipes/parallel/fsdp.py) on real torch.distributed (gloo): the same training as plain data
parallelism (fp32, within 1e-6) with each rank holding half the moments, alone, compiled and with TP; checkpoints
that are the same files as plain DP's and resume across FSDP on/off and DP 2 -> 1; bad combinations refused."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO, rank_launcher
from safetensors import safe_open
from test_resume import last_losses, logged_steps
from test_zero1 import launch

from trnrecipes.checkpoint import verify_training
from trnrecipes.config.recipe import load_recipe
from trnrecipes.config.sections import RecipeError

pytestmark = pytest.mark.slow

FIXED = ["batch.seq_len=32", "batch.global_batch=8", "batch.micro_batch=2", "optim.clip_grad_norm=1.0"]


def worker(tmp_path: Path, nproc: int, overrides: list[str], steps: int) -> tuple[dict, list[dict]]:
    """tests/train_worker.py over gloo ranks on llama2-tiny: rank 0's result (grads of step 1, norms, full weights)
    and every rank's moment / parameter element counts."""
    out = tmp_path / f"w{abs(hash(tuple(overrides)))}.pt"
    cmd = [*rank_launcher(nproc), str(REPO / "tests/train_worker.py"), str(out), "llama2-tiny",
           f"cluster.workers_per_node={nproc}", *FIXED, *overrides]  # fmt: skip
    env = {**os.environ, "TRAIN_WORKER_STEPS": str(steps), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    sizes = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(nproc)]
    return torch.load(out, weights_only=True), sizes


def assert_same_training(got: dict, want: dict) -> None:
    torch.testing.assert_close(got["norms"], want["norms"], rtol=1e-6, atol=0)
    assert got["params"].keys() == want["params"].keys()
    for name, p in want["params"].items():
        torch.testing.assert_close(got["params"][name], p, rtol=0, atol=1e-6, msg=name)
        torch.testing.assert_close(got["grads"][name], want["grads"][name], rtol=0, atol=1e-6, msg=name)


def test_fsdp_at_dp2_trains_as_plain_dp2_with_half_the_state_per_rank(tmp_path: Path):
    # 4 steps: FSDP reduces each micro-batch's gradients (plain DP sums them first), so they differ by float
    # rounding (~1e-9 here), which Adam's normalised updates grow step by step (6e-7 after 4 steps on this model).
    plain, plain_sizes = worker(tmp_path, 2, [], 4)
    fsdp, fsdp_sizes = worker(tmp_path, 2, ["layout.fsdp=true"], 4)
    assert_same_training(fsdp, plain)
    # Each rank keeps the moments of its rows only: together one copy, each about half.
    assert sum(s["moments"] for s in fsdp_sizes) == plain_sizes[0]["moments"]
    assert all(s["moments"] < 0.6 * plain_sizes[0]["moments"] for s in fsdp_sizes)


def test_fsdp_with_compiled_blocks_trains_as_plain_dp2(tmp_path: Path):
    # inductor on the CPU; FSDP's all-gathers and reduce-scatters stay outside the compiled graphs.
    plain, _ = worker(tmp_path, 2, [], 2)
    compiled, _ = worker(tmp_path, 2, ["layout.fsdp=true", "train.compile=true"], 2)
    torch.testing.assert_close(compiled["norms"], plain["norms"], rtol=1e-5, atol=0)
    for name, p in plain["params"].items():
        torch.testing.assert_close(compiled["params"][name], p, rtol=0, atol=1e-5, msg=name)


def test_fsdp_with_tensor_and_sequence_parallelism_trains_as_tp2_dp2(tmp_path: Path):
    tp = ["layout.tp=2", "layout.sequence_parallel=true"]
    plain, _ = worker(tmp_path, 4, tp, 3)
    fsdp, _ = worker(tmp_path, 4, [*tp, "layout.fsdp=true"], 3)
    assert_same_training(fsdp, plain)


def test_an_fsdp_checkpoint_is_plain_dps_files_and_resumes_either_way(tmp_path: Path):
    """Saved with FSDP: the weights file holds whole tensors and the moments are per-DP-rank rows as under ZeRO-1.
    FSDP -> plain DP at the same DP size (data position carried over: losses continue as the uninterrupted FSDP run,
    to fp32 rounding), plain -> FSDP likewise, and FSDP at DP 2 -> one process."""
    straight = tmp_path / "straight"
    launch(tmp_path, straight, 2, 10, "layout.fsdp=true")
    reference = last_losses(straight)
    saved = straight / "checkpoints/step_5"
    files = verify_training(saved)["files"]
    assert {"model.safetensors", "optim-tp00-of-01-dp0001-of-0002.safetensors"} <= set(files)
    with safe_open(saved / "model.safetensors", "pt") as f:
        assert f.get_slice("embed.weight").get_shape() == [4096, 64]  # the whole tensor, not a DP rank's rows
    for first, then in (("true", "false"), ("false", "true")):
        run = tmp_path / f"{first}-{then}"
        launch(tmp_path, run, 2, 5, f"layout.fsdp={first}")
        out = launch(tmp_path, run, 2, 10, f"layout.fsdp={then}")
        assert "resuming from" in out and "(step 5)" in out
        got = [last_losses(run)[s] for s in range(6, 11)]
        torch.testing.assert_close(got, [reference[s] for s in range(6, 11)], rtol=1e-5, atol=0, msg=(first, then))
    out = launch(tmp_path, straight, 1, 12)
    assert "resuming from" in out and "(step 10)" in out and "data parallel size changed (2 -> 1)" in out


def launch_failing(tmp_path: Path, *overrides: str) -> str:
    """A 2-rank `trnrecipes train` of llama2-tiny that must fail: its output."""
    over = ["cluster.workers_per_node=2", f"run_dir={tmp_path / 'run'}", *overrides]
    recipe = load_recipe("llama2-tiny", overrides=over)
    cfg = tmp_path / "failing.yaml"
    cfg.write_text(yaml.safe_dump(recipe.to_dict()))
    cmd = [*rank_launcher(2), "-m", "trnrecipes", "train", "--config", str(cfg)]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode != 0, done.stdout[-3000:]
    return done.stdout + done.stderr


def test_the_parameter_norm_after_validation_counts_each_row_once(tmp_path: Path):
    # A validation forward leaves FSDP's root and last block gathered; the norm must not count them dp times.
    norms = {}
    for fsdp in ("false", "true"):
        launch(tmp_path, tmp_path / fsdp, 2, 4, f"layout.fsdp={fsdp}", "train.val_every=2", "checkpoint.every_steps=4")
        norms[fsdp] = [r["param_norm"] for r in logged_steps(tmp_path / fsdp) if "val_loss" in r]
    assert len(norms["true"]) == 2
    torch.testing.assert_close(norms["true"], norms["false"], rtol=1e-5, atol=0)


def test_fsdp_refuses_fewer_validation_documents_than_dp_ranks(tmp_path: Path):
    # Every DP rank's forward gathers over DP: a rank without validation batches would leave the others waiting.
    out = launch_failing(tmp_path, "layout.fsdp=true", "data.val_fraction=0.000001")  # 1 document
    assert "under layout.fsdp each rank needs one: raise data.val_fraction" in out


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["layout.fsdp=true", "layout.zero1=true"], "layout.fsdp and layout.zero1 are both true"),
        (["layout.fsdp=true", "layout.pp=2"], "layout.fsdp with layout.pp 2"),
    ],
)
def test_fsdp_combinations_that_cannot_run_are_refused(overrides, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe("llama2-tiny", overrides=overrides)


def test_fsdp_is_refused_on_neuron_naming_zero1():
    with pytest.raises(RecipeError, match=r"layout\.fsdp true: backend neuron .* layout\.zero1"):
        load_recipe("llama2-7b", overrides=["layout.fsdp=true"])
