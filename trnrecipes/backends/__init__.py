"""Backends: where and how the step loop runs, as objects with one interface (trnrecipes.backends.base.Backend).

- `cpu`, `cuda`: plain torch (torch.py); tensor parallelism with DTensor, ZeRO-1 by trnrecipes.train.optim.
- `xla`: torch-xla on PJRT (xla.py): CPU here, GPU elsewhere; the same model code, lazily traced.
- `neuron`: torch-xla + neuronx-distributed on Trainium (neuron_xla.py); import-guarded, it cannot be installed
  off Trainium, and its NxD calls live in trnrecipes.neuron_parallel.

The step loop asks a backend for everything that differs between them and holds no backend-name branch.
"""

from __future__ import annotations

from trnrecipes.backends.base import Backend
from trnrecipes.recipe import RecipeError

BACKENDS = ("cpu", "cuda", "xla", "neuron")


def make_backend(name: str, local_rank: int) -> Backend:
    """The backend a recipe's cluster.backend names, bound to this process's device (LOCAL_RANK)."""
    if name == "cpu":
        from trnrecipes.backends.torch import TorchBackend

        return TorchBackend.create(name, local_rank)
    if name == "cuda":
        from trnrecipes.backends.torch import CudaBackend

        return CudaBackend.create(name, local_rank)
    if name == "xla":
        from trnrecipes.backends.xla import XlaBackend

        return XlaBackend.create(name, local_rank)
    if name == "neuron":
        from trnrecipes.backends.neuron_xla import NeuronXlaBackend

        return NeuronXlaBackend.create(name, local_rank)
    raise RecipeError(f"unknown backend {name!r}; valid: {', '.join(BACKENDS)}")


__all__ = ["BACKENDS", "Backend", "make_backend"]
