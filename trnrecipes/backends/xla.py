"""torch-xla on PJRT (`xla`: CPU here, GPU elsewhere): the torch backend's model and collectives, traced lazily.
Graphs end at `sync` (the Amazon Search M5 post's discipline: one graph per micro-batch, one per optimizer step),
batches are uploaded by MpDeviceLoader's background threads, and shards are filled on the host and then moved: filling
device tensors block by block would trace the fills into the first training graph (another compilation)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from trnrecipes.backends.torch import TorchBackend
from trnrecipes.config.sections import RecipeError


class XlaBackend(TorchBackend):
    dist_backend = "xla"
    collectives_on_device = True  # XLA's process group reduces device tensors only
    supports_zero1 = False  # our ZeRO-1 gathers rows with eager gloo/nccl all-gathers, not traced for XLA
    supports_pp = False
    supports_cp = False  # its all-gather of keys and values is an eager torch.distributed call, not traced for XLA
    no_pp_reason = "torch.distributed.pipelining has no XLA stage coordinator"
    pjrt_device = "CPU"

    @classmethod
    def create(cls, name: str, local_rank: int) -> XlaBackend:
        try:
            import torch_xla
        except ImportError as err:
            raise RecipeError(
                f"cluster.backend {name} needs torch-xla ({err}). Here: `make xla-venv` builds .venv-xla"
                " (torch 2.9.0 + torch-xla 2.9.0, PJRT CPU); on Trainium use the Neuron SDK's environment"
            ) from None
        cls.check_installed()
        os.environ.setdefault("PJRT_DEVICE", cls.pjrt_device)
        return cls(name, torch_xla.device())

    @classmethod
    def check_installed(cls) -> None:
        """Libraries beyond torch-xla this backend needs (none for plain XLA)."""

    def sync(self) -> None:
        import torch_xla

        torch_xla.sync()

    def seed_rng(self, seed: int) -> None:
        """torch-xla's random ops draw from its own generator, which torch.manual_seed does not reach. Its seed
        enters the graph as data, so a new seed every step compiles nothing new."""
        import torch_xla.core.xla_model as xm

        super().seed_rng(seed)
        xm.set_rng_state(seed, device=self.device)

    def loader(self, batches: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
        import torch_xla.distributed.parallel_loader as pl

        return iter(pl.MpDeviceLoader(batches, self.device))

    def compilations(self) -> int | None:
        import torch_xla.debug.metrics as met

        return int(met.counter_value("UncachedCompile") or 0)

    def materialize(self, model: nn.Module) -> None:
        model.to_empty(device="cpu")

    def to_device(self, model: nn.Module) -> None:
        model.to(self.device)
