"""Backends: where and how the step loop runs, as objects with one interface (trnrecipes.backends.base.Backend).

- `cpu`, `cuda`: plain torch (torch.py); tensor parallelism with DTensor, ZeRO-1 by trnrecipes.optim.adamw.
- `xla`: torch-xla on PJRT (xla.py): CPU here, GPU elsewhere; the same model code, lazily traced.
- `neuron`: torch-xla + neuronx-distributed on Trainium (neuron_xla.py; Neuron SDK 2.21-2.28, trn1/trn1n/trn2);
  import-guarded, it cannot be installed off Trainium, and its NxD calls live in trnrecipes.parallel.nxd.
- `neuron-native`: TorchNeuron, native PyTorch on device `neuron` (neuron_native.py; Neuron SDK 2.33, trn2/trn3):
  the torch backend with the device, process-group and mesh types changed. Import-guarded likewise.
A recipe says cluster.backend neuron; its Neuron SDK picks one of the two (trnrecipes.config.stacks,
Recipe.runtime_backend).

The step loop asks a backend for everything that differs between them and holds no backend-name branch.
Imports parallel/, optim/ and config/; never train/ or checkpoint/.
"""

from __future__ import annotations

from trnrecipes.backends.base import Backend
from trnrecipes.config.sections import RecipeError

BACKENDS = ("cpu", "cuda", "xla", "neuron", "neuron-native")


def make_backend(name: str, local_rank: int) -> Backend:
    """The backend `name` (a recipe's runtime_backend), bound to this process's device (LOCAL_RANK)."""
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
    if name == "neuron-native":
        from trnrecipes.backends.neuron_native import NeuronNativeBackend

        return NeuronNativeBackend.create("neuron", local_rank)
    raise RecipeError(f"unknown backend {name!r}; valid: {', '.join(BACKENDS)}")


__all__ = ["BACKENDS", "Backend", "make_backend"]
