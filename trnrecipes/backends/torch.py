"""Plain torch on `cpu` (gloo) and `cuda` (nccl): tensor parallelism with DTensor (trnrecipes.parallel applies the
family's plan), DP gradient averaging and ZeRO-1 through trnrecipes.train.parallel_dims, norms through DTensor."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from trnrecipes.backends.base import Backend
from trnrecipes.pipeline import TorchPipeline, parameter_order
from trnrecipes.recipe import RecipeError
from trnrecipes.train.parallel_dims import full_tensor, local_tensor

if TYPE_CHECKING:
    from trnrecipes.recipe import Recipe
    from trnrecipes.train.parallel_dims import ParallelDims


class TorchBackend(Backend):
    """`cpu`: gloo collectives on host tensors."""

    supports_zero1 = True
    supports_pp = True

    @classmethod
    def create(cls, name: str, local_rank: int) -> TorchBackend:
        return cls(name, torch.device("cpu"))

    def init_process_groups(self, dims: ParallelDims) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        if dims.world == 1:
            return  # a single process needs no group
        if not dist.is_initialized():
            dist.init_process_group(self.dist_backend, rank=dims.rank, world_size=dims.world)
        dims.mesh = init_device_mesh(self.device.type, (dims.pp, dims.dp, dims.tp), mesh_dim_names=("pp", "dp", "tp"))
        dims.dp_group = dims.mesh["dp"].get_group()
        dims.pp_group = dims.mesh["pp"].get_group()

    def tensor_parallel(self, model: nn.Module, recipe: Recipe, dims: ParallelDims) -> None:
        from trnrecipes.parallel import apply_tensor_parallel

        apply_tensor_parallel(model, dims.mesh["tp"], recipe.model.family, recipe.layout.sequence_parallel)

    @staticmethod
    def shard_dim(p: torch.Tensor) -> int | None:
        placements = getattr(p, "placements", None)  # a DTensor's Shard(d)
        return next((pl.dim for pl in placements if pl.is_shard()), None) if placements is not None else None

    def pipeline(self, model: nn.Module, recipe: Recipe, dims: ParallelDims, micro_batches: int):
        return TorchPipeline(model, recipe.layout.pp_schedule, micro_batches, dims, self.device)

    def reduce_and_clip(self, model: nn.Module, dims: ParallelDims, max_norm: float) -> torch.Tensor:
        local_grads = _local_grads(model)
        dims.average_over_dp(local_grads)
        grad_norm = self._global_norm(model, dims, grads=True)
        if max_norm > 0:
            scale = torch.clamp(max_norm / (grad_norm + 1e-6), max=1.0)
            for g in local_grads:
                g.mul_(scale.to(g.dtype))
        return grad_norm

    def param_norm(self, model: nn.Module, dims: ParallelDims) -> torch.Tensor:
        return self._global_norm(model, dims, grads=False)

    @torch.no_grad()
    def _global_norm(self, model: nn.Module, dims: ParallelDims, *, grads: bool) -> torch.Tensor:
        """L2 norm of the whole model's gradients (grads) or parameters, the same for every layout: each parameter's
        squared norm (its TP shards gathered) counted once, by the pipeline stage that holds it, and the squares
        summed in the full model's parameter order."""
        names = parameter_order(model)
        squares = torch.zeros(len(names), dtype=torch.float32, device=self.device)
        index = {name: i for i, name in enumerate(names)}
        for name, p in model.named_parameters():
            t = p.grad if grads else p
            if t is not None:
                squares[index[name]] = full_tensor(t).float().pow(2).sum()
        dims.sum_over_pp(squares)  # each entry is non-zero on one stage only: the sum is exact
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for square in squares:
            total = total + square
        return total.sqrt()


class CudaBackend(TorchBackend):
    """`cuda`: one GPU per rank (LOCAL_RANK), nccl collectives on device tensors."""

    dist_backend = "nccl"
    collectives_on_device = True

    @classmethod
    def create(cls, name: str, local_rank: int) -> CudaBackend:
        if not torch.cuda.is_available():
            raise RecipeError("cluster.backend is cuda but this torch has no CUDA device; use cpu, xla or neuron")
        torch.cuda.set_device(local_rank)
        return cls(name, torch.device("cuda", local_rank))


def _local_grads(model: nn.Module) -> list[torch.Tensor]:
    """Local gradient tensors laid out like their parameters: under TP a gradient can come back Partial (SP norms,
    the vocab-parallel embedding); reducing it to the parameter's own placement makes the optimizer elementwise."""
    params = [p for p in model.parameters() if p.grad is not None]
    for p in params:
        if hasattr(p.grad, "placements") and tuple(p.grad.placements) != tuple(p.placements):
            p.grad = p.grad.redistribute(placements=p.placements)
    return [local_tensor(p.grad) for p in params]
