"""Per-rank health check that run.sbatch runs before training: a matmul on this rank checked against a float64
reference, failing fast with the host name. Collective checks (all-gather, all-reduce, reduce-scatter with
bandwidth) are issue #6."""

from __future__ import annotations

import sys
import time

from trnrecipes.launch import verify_launch
from trnrecipes.recipe import Recipe


def check_node(recipe: Recipe, size: int = 512) -> int:
    import torch

    ctx = verify_launch(recipe)
    try:
        gen = torch.Generator().manual_seed(1000 + ctx.rank)
        a = torch.randn(size, size, generator=gen)
        b = torch.randn(size, size, generator=gen)
        start = time.perf_counter()
        got = a @ b
        seconds = time.perf_counter() - start
        want = a.double() @ b.double()
        err = ((got.double() - want).abs().max() / want.abs().max()).item()
        ok = err < 1e-5
        verdict = "ok" if ok else "FAILED"
        print(
            f"[health] {ctx.host} rank {ctx.rank}/{ctx.world_size}: cpu matmul {size}^3 {verdict}"
            f" (max rel err {err:.1e}, {2 * size**3 / seconds / 1e9:.1f} GFLOP/s)",
            file=sys.stdout if ok else sys.stderr,
            flush=True,
        )
        return 0 if ok else 1
    finally:
        ctx.close()
