"""Dropout seeded per step from train.seed (trnrecipes/train/step_rng.py): a bert run is a function of its recipe.
Two fresh runs and a resumed one are bitwise equal, activation checkpointing replays the masks, another seed trains
otherwise, DP ranks draw their own masks and TP ranks, which replicate the activations dropped, the same ones."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import REPO, rank_launcher
from safetensors.torch import load_file, save_file

from trnrecipes.config.recipe import load_recipe
from trnrecipes.train.loop import Trainer

pytestmark = pytest.mark.slow

SMALL = ["cluster.workers_per_node=1", "batch.seq_len=32", "batch.global_batch=8", "batch.micro_batch=4",
         "train.val_every=1000", "train.val_batches=1", "data.eval_path=null", "checkpoint.every_steps=2"]  # fmt: skip


def train(run_dir: Path, steps: int, *overrides: str) -> list[float]:
    """The losses of a bert-tiny run to `steps` in `run_dir` (resuming from what it holds), in this process."""
    recipe = load_recipe("bert-tiny", overrides=[*SMALL, f"train.max_steps={steps}", f"run_dir={run_dir}", *overrides])
    trainer = Trainer(recipe, log=lambda *a, **k: None)
    try:
        return trainer.run().losses
    finally:
        trainer.close()


def weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(run_dir / f"checkpoints/step_{step}/model.safetensors")


def as_written_before_step_seeds(ckpt: Path) -> None:
    """Make a checkpoint look like one from before dropout was seeded per step: each rank's generator state in
    rng-rankNNNN.safetensors, listed in the manifest."""
    save_file({"torch_cpu": torch.get_rng_state()}, ckpt / "rng-rank0000.safetensors")
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"]["rng-rank0000.safetensors"] = hashlib.sha256(
        (ckpt / "rng-rank0000.safetensors").read_bytes()
    ).hexdigest()
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_fresh_resumed_and_checkpointed_runs_are_bitwise_equal_and_another_seed_is_not(tmp_path: Path):
    straight = train(tmp_path / "straight", 4)
    assert train(tmp_path / "resumed", 2) == straight[:2]  # a second fresh run (dropout at 0.1 everywhere)
    assert_bitwise_equal(weights(tmp_path / "resumed", 2), weights(tmp_path / "straight", 2))
    as_written_before_step_seeds(tmp_path / "resumed/checkpoints/step_2")  # its generator state is not read
    assert train(tmp_path / "resumed", 4) == straight[2:]  # from its step_2: nothing of the generator was saved
    assert_bitwise_equal(weights(tmp_path / "resumed", 4), weights(tmp_path / "straight", 4))
    # Recomputation in backward replays the forward's masks: the attention probabilities' (inside SDPA, under
    # "selective") and every block's (under "full").
    for mode in ("selective", "full"):
        assert train(tmp_path / mode, 2, f"model.activation_checkpointing={mode}") == straight[:2], mode
        assert_bitwise_equal(weights(tmp_path / mode, 2), weights(tmp_path / "straight", 2))
    assert train(tmp_path / "seed", 2, "train.seed=1235") != straight[:2]


def masks(tmp_path: Path, *layout: str) -> list[dict[str, torch.Tensor]]:
    """Each of 2 gloo ranks' dropout masks in one step on the same micro-batches (tests/dropout_worker.py)."""
    out = tmp_path / "masks"
    cmd = [*rank_launcher(2), str(REPO / "tests/dropout_worker.py"), str(out), "bert-tiny", *SMALL,
           "cluster.workers_per_node=2", f"run_dir={tmp_path / 'run'}", *layout]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [torch.load(f"{out}.rank{rank}") for rank in range(2)]


def test_dp_ranks_draw_their_own_masks_and_tp_ranks_the_same(tmp_path: Path):
    rank0, rank1 = masks(tmp_path / "dp")  # DP 2: two workers, TP 1
    for name, mask in rank0.items():
        assert mask.any() and not torch.equal(mask, rank1[name]), name
    rank0, rank1 = masks(tmp_path / "tp", "layout.tp=2")
    for name, mask in rank0.items():  # the embedding and a row-parallel output: whole on both ranks
        assert mask.any() and torch.equal(mask, rank1[name]), name
