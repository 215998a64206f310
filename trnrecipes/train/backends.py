"""Where the step loop runs: `cpu` and `cuda` (plain torch), `xla` (torch-xla PJRT: CPU here, GPU elsewhere) and
`neuron` (torch-xla + neuronx-distributed on Trainium; import-guarded, it cannot be installed off Trainium).

The loop asks a backend for four things only: a device, a data loader that feeds it, a graph cut (XLA traces
lazily; `sync` is where a graph ends and runs) and the collective backend for torch.distributed.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from trnrecipes.recipe import RecipeError


@dataclass
class Backend:
    name: str
    device: torch.device
    dist_backend: str  # torch.distributed backend: gloo, nccl or xla

    @property
    def is_xla(self) -> bool:
        return self.name in ("xla", "neuron")

    def sync(self) -> None:
        """Cut the lazy graph here and run it (XLA); nothing to do for eager backends."""
        if self.is_xla:
            import torch_xla

            torch_xla.sync()

    def loader(self, batches: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
        """Batches on the device. On XLA, MpDeviceLoader uploads the next batches in background threads (seed 000)."""
        if self.is_xla:
            import torch_xla.distributed.parallel_loader as pl

            return iter(pl.MpDeviceLoader(batches, self.device))
        return (b.to(self.device, non_blocking=True) for b in batches)

    def compilations(self) -> int | None:
        """XLA graphs compiled so far in this process (cache misses), else None."""
        if not self.is_xla:
            return None
        import torch_xla.debug.metrics as met

        return int(met.counter_value("UncachedCompile") or 0)


def make_backend(name: str, local_rank: int) -> Backend:
    if name == "cpu":
        return Backend("cpu", torch.device("cpu"), "gloo")
    if name == "cuda":
        if not torch.cuda.is_available():
            raise RecipeError("cluster.backend is cuda but this torch has no CUDA device; use cpu, xla or neuron")
        torch.cuda.set_device(local_rank)
        return Backend("cuda", torch.device("cuda", local_rank), "nccl")
    if name in ("xla", "neuron"):
        try:
            import torch_xla
        except ImportError as err:
            raise RecipeError(
                f"cluster.backend {name} needs torch-xla ({err}). Here: `make xla-venv` builds .venv-xla"
                " (torch 2.9.0 + torch-xla 2.9.0, PJRT CPU); on Trainium use the Neuron SDK's environment"
            ) from None
        if name == "neuron":
            try:
                import neuronx_distributed  # noqa: F401  (the real package exists only on Trainium hosts)
            except Exception as err:  # the PyPI placeholder raises at import
                raise RecipeError(
                    f"cluster.backend neuron needs neuronx-distributed from the Neuron repository ({err});"
                    " off Trainium, run the same recipe with cluster.backend=xla"
                ) from None
        os.environ.setdefault("PJRT_DEVICE", "NEURON" if name == "neuron" else "CPU")
        return Backend(name, torch_xla.device(), "xla")
    raise RecipeError(f"unknown backend {name!r}; valid: cpu, cuda, xla, neuron")
