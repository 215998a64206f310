"""Run under tests/ranks.py by tests/test_sharded_build.py: build this rank's shard of a recipe's model (initialised, or
read from a checkpoint) while recording the largest tensor any op allocates, then gather the full weights.

    python tests/build_worker.py OUT CHECKPOINT|- RECIPE [k=v ...]
Each rank writes OUT.rankN.json (largest allocation, its largest local parameter, which parameters are sharded);
rank 0 writes OUT (the gathered full state dict).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import recipes.common.init as init_module
from trnrecipes.backends import make_backend
from trnrecipes.config.recipe import load_recipe
from trnrecipes.parallel.dims import ParallelDims, full_tensor, local_tensor
from trnrecipes.train.build import build_model_shard


def _storage(t) -> int | None:
    if isinstance(t, DTensor):
        t = t._local_tensor
    if isinstance(t, torch.Tensor):
        return None if t.is_meta else t.untyped_storage().data_ptr()
    if isinstance(t, torch.UntypedStorage | torch.TypedStorage):
        return t.data_ptr()
    return None


class Allocations(TorchDispatchMode):
    """Every shape an op's output holds in memory it allocated (a DTensor counts its local tensor; meta is free; a view
    or an in-place result shares an input's storage, e.g. safetensors' tensors over the file's mmap, and is not
    counted), and the most elements of any."""

    def __init__(self):
        super().__init__()
        self.largest, self.op, self.shapes = 0, "", set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_storage(a) for a in tree_flatten((args, kwargs))[0]}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                real = t._local_tensor if isinstance(t, DTensor) else t
                if real.is_meta or _storage(real) in inputs:
                    continue
                self.shapes.add(tuple(real.shape))
                if real.numel() > self.largest:
                    self.largest, self.op = real.numel(), str(func)
        return out


def main() -> None:
    out, weights, name, *overrides = sys.argv[1:]
    init_module.BLOCK_ELEMENTS = 256  # small blocks: the test model's shards are a few thousand values
    torch.set_num_threads(1)
    recipe = load_recipe(name, overrides=overrides)
    backend = make_backend("cpu", 0)
    dims = ParallelDims(recipe, backend)
    seen = Allocations()
    with seen:
        model = build_model_shard(recipe, dims=dims, backend=backend, weights=None if weights == "-" else Path(weights))
    params = dict(model.named_parameters())
    local = {n: local_tensor(p).numel() for n, p in params.items()}
    report = {
        "largest": seen.largest,
        "op": seen.op,
        "largest_local": max(local.values()),
        "sharded": sorted(n for n, p in params.items() if local[n] < p.numel()),  # DTensor numel() is the full one
        # Full shapes of sharded parameters that some op made in real memory (and that are not also the local shape
        # of a parameter here): a whole parameter existed on this rank.
        "full_shapes_made": sorted(
            {tuple(p.shape) for n, p in params.items() if local[n] < p.numel()}
            & seen.shapes - {tuple(local_tensor(p).shape) for p in params.values()}
        ),
    }
    Path(f"{out}.rank{dims.rank}.json").write_text(json.dumps(report))
    state = {k: full_tensor(v).detach().clone() for k, v in model.state_dict().items()}
    if dims.rank == 0:
        torch.save(state, out)
    dims.close()


if __name__ == "__main__":
    main()
