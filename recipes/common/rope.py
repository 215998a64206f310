"""RoPE's cos/sin tables, made once per (length, shape, device, dtype) instead of in every block's forward.

Computed inside a compiled block, the table's ops (arange, pow, reciprocal, cos, sin) were fused by inductor into the
kernel that rotates q and k, so every element of every head recomputed its angle's transcendentals: on an H200 at
Llama-2-7B width, seq 4096, micro-batch 2, those kernels took 7.8% of the training step's GPU time against 1.4% for
transformers' (bench_gpu --profile, 2026-11-28). Cached, the tables are plain inputs of the block's graph and the
rotation is a multiply-add.

The model's forward fills the cache before its blocks run (outside any compiled region); a block that finds no table
while being compiled (a pipeline stage called on its own) computes it in its graph as before, without storing it, so
the result is the same either way. The tables are made outside inference mode and without autograd, so a table made
during evaluation can be saved for a later training step's backward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
# A process uses a few (lengths x devices x dtypes: training's and validation's); bounded so that a caller varying
# the length cannot grow it without end. The oldest goes first.
MAX_TABLES = 16


def cached_tables(
    key: tuple, make: Callable[[], tuple[torch.Tensor, torch.Tensor]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) for `key` (plain constants: ints, floats, strings, dtypes, tuples of those): from the cache, or
    made by `make()` and kept, except while torch.compile traces (then made in the graph, not kept)."""
    tables = _TABLES.get(key)
    if tables is not None:
        return tables
    if torch.compiler.is_compiling():
        return make()
    with torch.inference_mode(False), torch.no_grad():
        tables = make()
    while len(_TABLES) >= MAX_TABLES:
        del _TABLES[next(iter(_TABLES))]
    _TABLES[key] = tables
    return tables
