"""The process layout of a training run: ranks [dp, tp] with TP fastest, process groups, and the few collectives the
step loop needs beyond the model's own (DP gradient averaging, agreeing on decisions)."""

from __future__ import annotations

import os
from dataclasses import replace

import torch
import torch.distributed as dist

from trnrecipes.layout import compute_layout
from trnrecipes.recipe import Recipe, RecipeError, check_recipe
from trnrecipes.train.backends import Backend


class Distributed:
    """Ranks laid out [dp, tp] with TP fastest (TP groups within a node). Single process: no process group."""

    def __init__(self, recipe: Recipe, backend: Backend):
        layout = compute_layout(recipe)
        if layout.pp > 1:
            # The layout math and the scripts size jobs for PP; the step loop does not split the model into stages.
            raise RecipeError(
                f"layout.pp {layout.pp}: pipeline parallelism is planned (layout, scripts) but not built in the step"
                f" loop; train with layout.pp=1{_wider_tp_hint(recipe, layout.tp * layout.pp)}"
            )
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        if self.world != layout.world_size:
            raise RecipeError(
                f"launched with {self.world} rank(s), but recipe {recipe.name} at {layout.nodes} node(s) needs"
                f" {layout.world_size} (DP {layout.dp} x TP {layout.tp}); use its run.sbatch"
            )
        self.dp, self.tp = layout.dp, layout.tp
        self.dp_rank, self.tp_rank = self.rank // self.tp, self.rank % self.tp
        self.mesh = self.dp_group = None
        self.neuron = backend.name == "neuron"
        # NCCL and XLA's process group reduce device tensors only; gloo (cpu, and xla on PJRT CPU) takes CPU ones.
        self.collectives_on_device = self.neuron or backend.dist_backend == "nccl"
        if self.neuron:
            from trnrecipes import neuron_parallel

            if not dist.is_initialized():
                dist.init_process_group("xla", init_method="xla://")
            # NxD owns the groups, and its TP groups are not always consecutive ranks (trn1 at TP 4 strides them by
            # 8): the data shard, checkpoint files and re-slicing must use NxD's ranks, or a TP group mixes batches.
            self.tp_rank, self.dp_rank = neuron_parallel.initialize(self.tp, self.dp)
        elif self.world > 1:
            if not dist.is_initialized():
                dist.init_process_group(backend.dist_backend, rank=self.rank, world_size=self.world)
            from torch.distributed.device_mesh import init_device_mesh

            self.mesh = init_device_mesh(backend.device.type, (self.dp, self.tp), mesh_dim_names=("dp", "tp"))
            self.dp_group = self.mesh["dp"].get_group()

    def average_over_dp(self, tensors: list[torch.Tensor]) -> None:
        """In place: the mean over the data-parallel replicas (never over TP ranks, which hold different shards)."""
        if self.dp == 1 or not tensors:
            return
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(flat, group=self.dp_group)
        flat /= self.dp
        offset = 0
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()

    def max_over_ranks(self, values: list[int], device: torch.device) -> list[int]:
        """Element-wise max over all ranks: how ranks agree on a decision only some of them can see."""
        t = self._all_reduce(torch.tensor(values, dtype=torch.int64), device, dist.ReduceOp.MAX)
        return [int(v) for v in t.tolist()]

    def sum_over_ranks(self, values: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Element-wise sum over all ranks of a small tensor (metrics; on the host or `device`), returned on the CPU."""
        return self._all_reduce(values, device, dist.ReduceOp.SUM)

    def _all_reduce(self, values: torch.Tensor, device: torch.device, op) -> torch.Tensor:
        if self.world == 1:
            return values.cpu()
        # A copy either way: all_reduce works in place and must not change the caller's tensor.
        t = values.to(device, copy=True) if self.collectives_on_device else values.to("cpu", copy=True)
        dist.all_reduce(t, op=op)
        return t.cpu()

    def close(self) -> None:
        if self.world > 1 and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _wider_tp_hint(recipe: Recipe, tp: int) -> str:
    """', e.g. layout.tp=N ...' when TP = old tp x pp is a valid layout (the same model memory per core), else why
    there is no such suggestion: suggesting an invalid layout would only move the error."""
    trial = replace(recipe, layout=replace(recipe.layout, tp=tp, pp=1))
    try:
        compute_layout(trial)
        valid = not check_recipe(trial)
    except RecipeError:
        valid = False
    if valid:
        return f", e.g. layout.tp={tp}, which keeps the model's memory per core"
    return (
        f"; layout.tp={tp} would keep the model's memory per core but is not a valid layout here, and a smaller"
        " tp holds more of the model on each core (`trnrecipes plan` checks a layout's divisibility, not memory)"
    )
