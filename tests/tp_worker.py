"""Run under tests/ranks.py with 2 processes (tests/test_tensor_parallel.py): compare TP=2 with TP=1 for each decoder
family, with and without sequence parallelism. Rank 0 writes the max errors as JSON to argv[1]."""

from __future__ import annotations

import copy
import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from trnrecipes.config.sections import ModelConfig
from trnrecipes.models import build_model
from trnrecipes.parallel.tensor import apply_tensor_parallel

CONFIGS = {
    "neox": ModelConfig(family="neox", vocab_size=96, hidden_size=64, num_layers=2, num_heads=4,
                        ffn_hidden_size=128, max_seq_len=32, rotary_pct=0.25),
    "llama2": ModelConfig(family="llama2", vocab_size=96, hidden_size=64, num_layers=2, num_heads=4,
                          num_kv_heads=2, ffn_hidden_size=96, max_seq_len=32),
    "qwen3": ModelConfig(family="qwen3", vocab_size=96, hidden_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=24, ffn_hidden_size=96, max_seq_len=32),
}  # fmt: skip


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    results = {}
    for family, cfg in CONFIGS.items():
        reference = build_model(cfg)
        reference.init_weights(seed=0)  # the same weights on every rank
        with torch.no_grad():  # non-trivial norms and biases so every gradient is checked
            for name, p in reference.named_parameters():
                if "norm" in name or name.endswith("bias"):
                    p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
        tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
        ref_logits = reference(tokens)
        ref_logits.float().pow(2).mean().backward()
        ref_grads = {n: p.grad for n, p in reference.named_parameters()}
        for sp in (False, True):
            model = apply_tensor_parallel(copy.deepcopy(reference), mesh, family, sp)
            model.zero_grad(set_to_none=True)  # the copy carried the reference's gradients
            logits = full(model(tokens))
            logits.float().pow(2).mean().backward()
            grad_err = max(
                (full(p.grad) - ref_grads[n]).abs().max().item() / ref_grads[n].abs().max().clamp_min(1e-12).item()
                for n, p in model.named_parameters()
            )
            logit_err = ((logits - ref_logits).abs().max() / ref_logits.abs().max()).item()
            sharded = sum(isinstance(p, DTensor) and p.to_local().numel() < p.numel() for p in model.parameters())
            results[f"{family}-sp{int(sp)}"] = {"logits": logit_err, "grads": grad_err, "sharded_params": sharded}
        try:
            apply_tensor_parallel(copy.deepcopy(reference), mesh, family, True)(tokens[:, :15])
        except ValueError as err:
            results[f"{family}-odd-seq"] = str(err)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
