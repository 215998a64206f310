"""Run under tests/ranks.py with 2 processes (tests/test_vocab_parallel_loss.py): the vocab-parallel cross-entropy
against F.cross_entropy on the whole head, and TP 2 with it against TP 1 (loss and every gradient) for both families,
with and without sequence parallelism. Rank 0 writes the relative errors as JSON to argv[1]."""

from __future__ import annotations

import copy
import functools
import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from recipes.common.loss import IGNORE_INDEX, VocabShard, linear_cross_entropy, vocab_parallel_cross_entropy
from trnrecipes.config.sections import ModelConfig
from trnrecipes.models import build_model
from trnrecipes.parallel.tensor import apply_tensor_parallel, vocab_parallel_head_loss

CONFIGS = {
    "neox": ModelConfig(family="neox", vocab_size=96, hidden_size=64, num_layers=2, num_heads=4,
                        ffn_hidden_size=128, max_seq_len=32, rotary_pct=0.25),
    "llama2": ModelConfig(family="llama2", vocab_size=96, hidden_size=64, num_layers=2, num_heads=4,
                          num_kv_heads=2, ffn_hidden_size=96, max_seq_len=32),  # GQA: 2 query heads a KV head
}  # fmt: skip
CHUNK = 7  # does not divide the 2 x 16 tokens of a batch, nor the 37 rows of the direct check


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest absolute difference over the reference's largest magnitude."""
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def direct(rank: int, tp: int) -> dict[str, float]:
    """vocab_parallel_cross_entropy on this rank's rows of one head vs F.cross_entropy on the whole head. Labels:
    ignored rows, and some on each rank's shard; also every label ignored (loss 0, no 0/0)."""
    g = torch.Generator().manual_seed(0)
    n, h, v = 37, 16, 54
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::5] = IGNORE_INDEX
    ref_h, ref_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    want = F.cross_entropy(ref_h @ ref_w.t(), labels, ignore_index=IGNORE_INDEX)
    want.backward()
    rows = v // tp
    shard = VocabShard(dist.group.WORLD, rank * rows)
    out = {}
    for chunk in (1, CHUNK, 64):
        h_, w_ = hidden.clone().requires_grad_(), weight[rank * rows : (rank + 1) * rows].clone().requires_grad_()
        got = vocab_parallel_cross_entropy(h_, w_, labels, shard, chunk)
        got.backward()
        grad_h = h_.grad.clone()
        dist.all_reduce(grad_h)  # each rank's share of d(hidden), summed as the caller's layout does
        out[f"chunk{chunk}"] = max(
            rel(got, want), rel(w_.grad, ref_w.grad[rank * rows : (rank + 1) * rows]), rel(grad_h, ref_h.grad)
        )
    # bf16 GEMMs (the accelerator rule, forced here): as the single-device fused path's, to bf16 rounding
    h_, w_ = hidden.clone().requires_grad_(), weight[rank * rows : (rank + 1) * rows].clone().requires_grad_()
    bf16 = vocab_parallel_cross_entropy(h_, w_, labels, shard, CHUNK, gemm_dtype=torch.bfloat16)
    bf16.backward()
    dist.all_reduce(h_.grad)
    whole_h, whole_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    single = linear_cross_entropy(whole_h, whole_w, labels, CHUNK, gemm_dtype=torch.bfloat16)
    single.backward()
    out["bf16_gemms"] = max(
        rel(bf16, single), rel(w_.grad, whole_w.grad[rank * rows : (rank + 1) * rows]), rel(h_.grad, whole_h.grad)
    )
    h_, w_ = hidden.clone().requires_grad_(), weight[:rows].clone().requires_grad_()
    none = vocab_parallel_cross_entropy(h_, w_, torch.full_like(labels, IGNORE_INDEX), shard, CHUNK)
    none.backward()
    out["all_ignored"] = none.item() + h_.grad.abs().max().item() + w_.grad.abs().max().item()
    return out


def perturbed(cfg: ModelConfig) -> torch.nn.Module:
    model = build_model(cfg)
    model.init_weights(seed=0)  # the same weights on every rank
    with torch.no_grad():  # non-trivial norms and biases so every gradient is checked
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    return model


def models(mesh) -> dict[str, dict]:
    """TP 2 (vocab-parallel loss, chunks of CHUNK tokens) vs the plain model (fused_head_loss, one chunk)."""
    out = {}
    tokens = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(1))
    tokens, labels = tokens[:, :-1], tokens[:, 1:].clone()
    labels[0, :3] = labels[1, 9] = IGNORE_INDEX  # e.g. a prompt not trained on, a padded position
    for family, cfg in CONFIGS.items():
        reference = perturbed(cfg)
        want = reference(tokens, labels=labels)
        want.backward()
        for sp in (False, True):
            model = apply_tensor_parallel(copy.deepcopy(reference), mesh, family, sp)
            model.zero_grad(set_to_none=True)  # the copy carried the reference's gradients
            takes = model.head_loss is vocab_parallel_head_loss
            model.head_loss = functools.partial(vocab_parallel_head_loss, chunk_size=CHUNK)
            got = model(tokens, labels=labels)
            got.backward()
            grads = {n: rel(full(p.grad), reference.get_parameter(n).grad) for n, p in model.named_parameters()}
            out[f"{family}-sp{int(sp)}"] = {"takes_vocab_parallel": takes, "loss": rel(got, want), "grads": grads}
    return out


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, tp = dist.get_rank(), dist.get_world_size()
    results = {"direct": direct(rank, tp), "models": models(init_device_mesh("cpu", (tp,)))}
    gathered = [None] * tp
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
