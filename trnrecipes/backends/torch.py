"""Plain torch on `cpu` (gloo) and `cuda` (nccl): tensor parallelism with DTensor (trnrecipes.parallel.tensor applies
the family's plan), DP gradient averaging and ZeRO-1 through trnrecipes.parallel.dims, norms through DTensor."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from trnrecipes.backends.base import Backend
from trnrecipes.config.sections import NodeError
from trnrecipes.parallel import kv_replication
from trnrecipes.parallel.context import apply_context_parallel, init_context_groups
from trnrecipes.parallel.dims import local_tensor
from trnrecipes.parallel.expert import (
    apply_expert_fsdp,
    apply_expert_parallel,
    expert_layouts,
    init_expert_groups,
    tp_summed_params,
)
from trnrecipes.parallel.fsdp import SHARD_DIM, apply_fsdp, mesh_dim_placement, reshard
from trnrecipes.parallel.pipeline import TorchPipeline, parameter_order

if TYPE_CHECKING:
    from trnrecipes.config.sections import Recipe
    from trnrecipes.parallel.dims import ParallelDims


class TorchBackend(Backend):
    """`cpu`: gloo collectives on host tensors."""

    supports_zero1 = True
    supports_pp = True
    supports_cp = True
    compile_backend = "inductor"
    mesh_device_type: ClassVar[str | None] = None  # DeviceMesh's device type; None: the device's

    @classmethod
    def create(cls, name: str, local_rank: int) -> TorchBackend:
        return cls(name, torch.device("cpu"))

    def init_process_groups(self, dims: ParallelDims) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        if dims.world == 1:
            return  # a single process needs no group
        if not dist.is_initialized():
            dist.init_process_group(self.dist_backend, rank=dims.rank, world_size=dims.world)
        self.select_device()
        mesh_type = self.mesh_device_type or self.device.type
        # The layout's [pp, dp, cp, tp] order (trnrecipes.plan.layout.rank_coords); without CP the mesh it always was.
        names = ("pp", "dp", "cp", "tp") if dims.cp > 1 else ("pp", "dp", "tp")
        sizes = {"pp": dims.pp, "dp": dims.dp, "cp": dims.cp, "tp": dims.tp}
        dims.mesh = init_device_mesh(mesh_type, tuple(sizes[n] for n in names), mesh_dim_names=names)
        dims.dp_group = dims.dp_cp_group = dims.shard_group = dims.mesh["dp"].get_group()
        dims.pp_group = dims.mesh["pp"].get_group()
        if (group_rank := dist.get_rank(dims.dp_group)) != dims.dp_rank:
            # Collectives that place data by group rank (ZeRO-1's all-gather) rely on it being dp_rank.
            raise RuntimeError(
                f"DP rank {dims.dp_rank} is rank {group_rank} of its DP group: the mesh and the layout disagree"
            )
        if dims.cp > 1:
            init_context_groups(dims)
            dims.shard_group = dims.dp_cp_group
            if (group_rank := dist.get_rank(dims.shard_group)) != dims.shard_rank:
                # ZeRO-1's all-gather and FSDP's flattened mesh place rows by group rank: it must be the shard index.
                raise RuntimeError(
                    f"shard index {dims.shard_rank} (DP rank {dims.dp_rank} x CP {dims.cp} + CP rank {dims.cp_rank})"
                    f" is rank {group_rank} of its dp x cp group: the mesh and the layout disagree"
                )
        init_expert_groups(dims, mesh_type)

    def select_device(self) -> None:
        """Make self.device the current device once the process group exists, before DeviceMesh picks one (on cpu
        nothing to do; CudaBackend.create set it already)."""

    def tensor_parallel(self, model: nn.Module, recipe: Recipe, dims: ParallelDims) -> None:
        from trnrecipes.parallel.tensor import apply_tensor_parallel

        layout = kv_replication.replicate_kv(model, dims.tp) if hasattr(model.args, "num_kv_heads") else None
        apply_tensor_parallel(model, dims.mesh["tp"], recipe.model.family, recipe.layout.sequence_parallel)
        if layout is not None:  # TP wider than the KV heads: each KV head on tp / kv ranks
            dims.kv_group = kv_replication.kv_groups(dims.mesh, dims.tp, layout)

    def parallelize(self, model: nn.Module, recipe: Recipe, dims: ParallelDims) -> None:
        experts = None
        if dims.ep > 1:  # first: the blocks' experts are cut before anything wraps the blocks
            from trnrecipes.parallel.tensor import family_plan

            experts = family_plan(recipe.model.family).EXPERTS
            apply_expert_parallel(model, experts, dims)
        if dims.cp > 1:  # the attention kernels and the forward swapped before checkpointing and FSDP wrap them
            apply_context_parallel(model, dims)
        super().parallelize(model, recipe, dims)
        if dims.fsdp:
            if experts is not None:
                apply_expert_fsdp(model, experts, dims)
            apply_fsdp(model, shard_mesh(dims))

    @staticmethod
    def shard_dim(p: torch.Tensor) -> int | None:
        placement = mesh_dim_placement(p, "tp")  # a DTensor's Shard(d) over TP (FSDP's dp dim is not TP's split)
        return placement.dim if placement is not None and placement.is_shard() else None

    def pipeline(self, model: nn.Module, recipe: Recipe, dims: ParallelDims, micro_batches: int):
        return TorchPipeline(model, recipe.layout.pp_schedule, micro_batches, dims, self.device)

    def reduce_and_clip(self, model: nn.Module, dims: ParallelDims, max_norm: float) -> torch.Tensor:
        local_grads = _local_grads(model)
        # Under TP a mixture of experts' router and experts (whole on every TP rank) saw this rank's tokens only: their
        # gradients summed over TP once a step, after FSDP's reduce-scatter over DP and before the DP mean (linear, so
        # in either order; each TP rank then holds the same sum and updates its copy, or its ZeRO-1/FSDP rows, alike).
        dims.sum_over_tp([local_tensor(p.grad) for p in tp_summed_params(model) if p.grad is not None])
        sharded = expert_layouts(model)  # expert parallelism's experts: their own reduction (_local_grads' order)
        expert = [name in sharded for name, p in model.named_parameters() if p.grad is not None]
        if not dims.fsdp:  # FSDP's reduce-scatter over the dp x cp ranks has averaged them already
            dims.average_over_dp([g for g, e in zip(local_grads, expert, strict=True) if not e])
            dims.average_experts_over_dp([g for g, e in zip(local_grads, expert, strict=True) if e])
        else:
            # FSDP averaged the experts' over the dp / ep ranks holding them; EP 1's mean divides by dp
            for g in (g for g, e in zip(local_grads, expert, strict=True) if e):
                g.div_(dims.ep)
        if dims.kv_group is not None:  # replicated KV heads: each copy's gradient is its own query heads' share
            kv_replication.sync_grads(model, dims.kv_group)
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
        summed in the full model's parameter order. Under FSDP each rank squares its own rows and the squares are
        summed over the ranks: equal to the other layouts up to fp32 rounding, not bitwise."""
        if dims.fsdp:
            reshard(model)  # after a validation forward the root and last block are still whole tensors
        names = parameter_order(model)
        squares = torch.zeros(len(names), dtype=torch.float32, device=self.device)
        index = {name: i for i, name in enumerate(names)}
        replicated = kv_replication.layouts(model)
        for name, p in model.named_parameters():
            t = p.grad if grads else p
            if t is not None:
                # FSDP: this rank's rows only, summed over DP below (gathering each tensor would move the model).
                # a replicated KV head counts once
                whole = local_tensor(t) if dims.fsdp else kv_replication.stored_full(t, replicated.get(name))
                squares[index[name]] = whole.float().pow(2).sum()
        if dims.fsdp:
            _sum_fsdp_squares(squares, model, index, dims)
        if dims.ep > 1 and not dims.fsdp:  # each EP rank squared its own experts (FSDP's DP sum counts them once)
            _sum_expert_squares(squares, model, index, dims)
        dims.sum_over_pp(squares)  # each entry is non-zero on one stage only: the sum is exact
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for square in squares:
            total = total + square
        return total.sqrt()


class CudaBackend(TorchBackend):
    """`cuda`: one GPU per rank (LOCAL_RANK), nccl collectives on device tensors."""

    dist_backend = "nccl"
    collectives_on_device = True
    compiles_by_default = True  # train.compile unset: on (on cpu it stays off: compiling outlasts short runs)

    @classmethod
    def create(cls, name: str, local_rank: int) -> CudaBackend:
        if not torch.cuda.is_available():
            raise NodeError("cluster.backend is cuda but this torch has no CUDA device; use cpu, xla or neuron")
        torch.cuda.set_device(local_rank)
        return cls(name, torch.device("cuda", local_rank))


def _sum_fsdp_squares(squares: torch.Tensor, model: nn.Module, index: dict[str, int], dims: ParallelDims) -> None:
    """In place: per-parameter squared norms from each rank's FSDP rows to whole parameters. Summed over the shard
    group (dp x cp: each rank holds distinct rows), then over TP for the parameters TP splits (a TP-replicated one is
    the same on every TP rank and must count once)."""
    dist.all_reduce(squares, group=dims.shard_group)
    if dims.tp == 1:
        return
    split = torch.zeros_like(squares, dtype=torch.bool)
    for name, p in model.named_parameters():
        split[index[name]] = TorchBackend.shard_dim(p) is not None
    across_tp = torch.where(split, squares, torch.zeros_like(squares))
    dist.all_reduce(across_tp, group=dims.mesh["tp"].get_group())
    squares.copy_(torch.where(split, across_tp, squares))


def shard_mesh(dims: ParallelDims):
    """FSDP's 1-D mesh over the shard group: the DP dim at CP 1 (the mesh FSDP always had), else the dp and cp dims
    flattened into one (torchtitan's dp_shard_cp), whose ranks come in shard-index order (dp_rank x cp + cp_rank).
    A dim of the layout's mesh, not a mesh of its own: FSDP composes with TP's DTensors over a shared root mesh."""
    if dims.cp == 1:
        return dims.mesh["dp"]
    return dims.mesh["dp", "cp"]._flatten(SHARD_DIM)


def _sum_expert_squares(squares: torch.Tensor, model: nn.Module, index: dict[str, int], dims: ParallelDims) -> None:
    """In place: the squared norms of sharded experts summed over the EP group (the others kept: the same there)."""
    sharded = torch.zeros_like(squares, dtype=torch.bool)
    for name in expert_layouts(model):
        sharded[index[name]] = True
    summed = torch.where(sharded, squares, torch.zeros_like(squares))
    dist.all_reduce(summed, group=dims.ep_group)
    squares.copy_(torch.where(sharded, summed, squares))


def _local_grads(model: nn.Module) -> list[torch.Tensor]:
    """Local gradient tensors laid out like their parameters: under TP a gradient can come back Partial (SP norms,
    the vocab-parallel embedding); reducing it to the parameter's own placement makes the optimizer elementwise."""
    params = [p for p in model.parameters() if p.grad is not None]
    for p in params:
        if hasattr(p.grad, "placements") and tuple(p.grad.placements) != tuple(p.placements):
            p.grad = p.grad.redistribute(placements=p.placements)
    return [local_tensor(p.grad) for p in params]
