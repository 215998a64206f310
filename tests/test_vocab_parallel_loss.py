"""The vocab-parallel cross-entropy: each TP rank keeps [chunk, V / tp] logits of its own head rows. Against
F.cross_entropy on the whole head, and TP 2 against TP 1 (loss and every gradient) for both families, GQA and
sequence parallelism included. Real gloo processes; see tests/vocab_loss_worker.py."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from conftest import REPO, rank_launcher
from torch import nn

from trnrecipes.parallel.tensor import vocab_parallel_head_loss


@pytest.fixture(scope="module")
def tp2(tmp_path_factory) -> list[dict]:
    """Every rank's results of one 2-process run (rank order)."""
    out = tmp_path_factory.mktemp("vocab") / "results.json"
    cmd = [*rank_launcher(2), str(REPO / "tests" / "vocab_loss_worker.py"), str(out)]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_sharded_loss_equals_cross_entropy_on_the_whole_head(tp2):
    """Loss, each rank's weight rows' gradient and the summed hidden gradient, chunks of 1, 7 (not dividing 37 rows)
    and 64 (one short chunk), with ignored labels; bf16 GEMMs as the single-device fused path's."""
    for rank in tp2:
        direct = rank["direct"]
        assert max(direct[f"chunk{c}"] for c in (1, 7, 64)) < 1e-6, direct
        assert direct["bf16_gemms"] < 1e-2, direct  # the bf16 rounding of both paths' logits and gradients
        assert direct["all_ignored"] == 0.0  # loss 0 and zero gradients, no 0/0


@pytest.mark.slow
@pytest.mark.parametrize("run", ["neox-sp0", "neox-sp1", "llama2-sp0", "llama2-sp1"])
def test_tp2_loss_and_every_gradient_equal_tp1(tp2, run):
    """The TP plan gives the model the vocab-parallel loss; with it (chunks of 7 of 32 tokens, ignored labels) the
    loss and every parameter's gradient equal the plain model's (fused_head_loss) to fp32 rounding."""
    for rank in tp2:
        r = rank["models"][run]
        assert r["takes_vocab_parallel"]
        assert r["loss"] < 1e-6, r["loss"]
        assert max(r["grads"].values()) < 1e-6, r["grads"]
        assert len(r["grads"]) == (28 if run.startswith("neox") else 15)  # every parameter compared


def test_refuses_a_head_that_is_not_split_by_vocabulary():
    head, x, labels = nn.Linear(8, 12, bias=False), torch.zeros(1, 3, 8), torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(TypeError, match=r"DTensor split by vocabulary rows.*got Parameter"):
        vocab_parallel_head_loss(head, x, labels)
