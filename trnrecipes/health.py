"""`trnrecipes health [--collectives]`, run by run.sbatch on every rank before training.

1. Device sanity: a matmul on this rank's device against a float64 reference.
2. With --collectives: all-gather, all-reduce and reduce-scatter over all ranks, each checked element by element
   against the value every rank can compute, and timed like nccl-tests (algbw = bytes / time; busbw scales it by
   the bytes each rank really moves: 2(n-1)/n for all-reduce, (n-1)/n for the other two). A rank whose data comes
   back wrong is named with its host, and every rank exits non-zero, so the job stops before training starts.

TRNRECIPES_HEALTH_FAULT_RANK=R makes rank R send wrong data (to test this checker itself).
"""

from __future__ import annotations

import os
import sys
import time

from trnrecipes.launch import verify_launch
from trnrecipes.recipe import Recipe

SIZES_MB = (1, 16)
ITERS = 5


def check_node(recipe: Recipe, collectives: bool = False, size: int = 512) -> int:
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
        print(
            f"[health] {ctx.host} rank {ctx.rank}/{ctx.world_size}: cpu matmul {size}^3 {'ok' if ok else 'FAILED'}"
            f" (max rel err {err:.1e}, {2 * size**3 / seconds / 1e9:.1f} GFLOP/s);"
            f" rendezvous host {os.environ.get('MASTER_ADDR', 'none')}",
            file=sys.stdout if ok else sys.stderr,
            flush=True,
        )
        if ok and collectives and ctx.world_size > 1:
            ok = check_collectives(ctx.rank, ctx.world_size, ctx.host)
        return 0 if ok else 1
    finally:
        ctx.close()


def check_collectives(rank: int, world: int, host: str) -> bool:
    import torch
    import torch.distributed as dist

    hosts: list[str] = [""] * world
    dist.all_gather_object(hosts, host)
    fault = 1000.0 if os.environ.get("TRNRECIPES_HEALTH_FAULT_RANK") == str(rank) else 0.0
    problems: list[str] = []
    rows = []
    for mb in SIZES_MB:
        n = mb * (1 << 20) // 4 // world * world  # float32 elements, divisible by the world size
        mine = torch.full((n,), float(rank + 1)) + fault

        # all-gather: slot r must hold rank r's value
        out = torch.empty(n * world)
        secs = _timed(dist.all_gather_into_tensor, out, mine)
        for r, chunk in enumerate(out.view(world, n)):
            if not torch.all(chunk == r + 1):
                problems.append(f"all_gather: data from rank {r} ({hosts[r]}) is wrong")
        rows.append(("all_gather", mb, n * world * 4, secs, (world - 1) / world))

        # all-reduce: the sum of 1..world everywhere
        buf = mine.clone()
        secs = _timed(_all_reduce_from, buf, mine)
        if not torch.all(buf == world * (world + 1) / 2):
            problems.append(f"all_reduce: result on rank {rank} ({host}) is wrong")
        rows.append(("all_reduce", mb, n * 4, secs, 2 * (world - 1) / world))

        # reduce-scatter: rank r sends chunk j = (r + 1) * (j + 1); rank r receives (r + 1) * sum(1..world)
        chunks = torch.cat([(torch.full((n // world,), float((rank + 1) * (j + 1))) + fault) for j in range(world)])
        part = torch.empty(n // world)
        secs = _timed(dist.reduce_scatter_tensor, part, chunks)
        if not torch.all(part == (rank + 1) * world * (world + 1) / 2):
            problems.append(f"reduce_scatter: result on rank {rank} ({host}) is wrong")
        rows.append(("reduce_scatter", mb, n * 4, secs, (world - 1) / world))

    failed = [torch.tensor([len(problems)])]
    dist.all_reduce(failed[0])
    for p in problems:
        print(f"[health] {host} rank {rank}/{world}: FAILED {p}", file=sys.stderr, flush=True)
    if rank == 0:
        for op, mb, nbytes, secs, factor in rows:
            algbw = nbytes / secs / 1e9
            print(
                f"[health] {op:<14} {mb:>3} MiB x {world} ranks: {secs * 1e3:8.2f} ms  algbw {algbw:6.2f} GB/s"
                f"  busbw {algbw * factor:6.2f} GB/s",
                flush=True,
            )
        verdict = "ok" if failed[0].item() == 0 else f"FAILED ({failed[0].item()} problem(s), see above)"
        print(f"[health] collectives over {world} ranks: {verdict}", flush=True)
    return failed[0].item() == 0


def _all_reduce_from(buf, src) -> None:
    import torch.distributed as dist

    buf.copy_(src)  # all_reduce works in place: start every run from this rank's own data
    dist.all_reduce(buf)


def _timed(op, *args) -> float:
    """Median seconds of ITERS runs after one warm-up (the last run's result stays in the buffers)."""
    import torch.distributed as dist

    op(*args)
    times = []
    for _ in range(ITERS):
        dist.barrier()
        start = time.perf_counter()
        op(*args)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]
