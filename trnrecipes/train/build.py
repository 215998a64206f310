"""The model a training rank holds: built on the meta device, parallelized there, then only this rank's shard
materialised and filled, so the full model never exists on a rank whose layout shards it.

Filling reads each parameter's place in its full tensor (trnrecipes.sharding) and either draws it (the family's
init rules, recipes/common/init.py: the same full model for every layout and seed) or reads exactly that slice from
a checkpoint (ShardReader: safetensors get_slice, whatever layout saved it).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from recipes.common.init import fill_region
from trnrecipes.checkpoint import CheckpointError, ShardReader
from trnrecipes.models import build_model
from trnrecipes.recipe import Recipe
from trnrecipes.sharding import shard_region
from trnrecipes.train.parallel_dims import ParallelDims, local_tensor


def shard_dim(p: torch.Tensor) -> int | None:
    """The dim a parameter's TP shards split: DTensor Shard(d), or neuronx-distributed's partition_dim."""
    placements = getattr(p, "placements", None)
    if placements is not None:
        return next((pl.dim for pl in placements if pl.is_shard()), None)
    if getattr(p, "tensor_model_parallel", False):
        return int(p.partition_dim)
    return None


def build_model_shard(
    recipe: Recipe, *, dims: ParallelDims, device: torch.device, weights: Path | None = None, source: str = ""
) -> nn.Module:
    """This rank's part of the recipe's model on `device`: initialised from train.seed, or, given `weights` (a
    verified checkpoint dir; `source` names it in errors), its weights for this rank's shard."""
    model = build_model(recipe.model, "meta")
    full_shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    rules = model.init_rules()
    if recipe.precision.dtype == "bf16":
        model.to(torch.bfloat16)  # weights themselves in bf16 (no fp32 master copy); free on meta
    neuron_tp = dims.tp > 1 and dims.neuron
    if neuron_tp:
        from trnrecipes.neuron_parallel import apply_neuron_tensor_parallel

        # NxD layers allocate their shard on the host; the rest (norms) is materialised there too, filled, then
        # moved with NxD's helper, which keeps the parallel attributes on the parameters.
        apply_neuron_tensor_parallel(model, recipe.model.family, recipe.layout.sequence_parallel)
        materialize_meta(model, torch.device("cpu"))
    else:
        if dims.tp > 1:
            from trnrecipes.parallel import apply_tensor_parallel

            apply_tensor_parallel(model, dims.mesh["tp"], recipe.model.family, recipe.layout.sequence_parallel)
        # Each parameter's local shard only. On XLA devices on the host, then moved: filling device tensors block
        # by block would trace the fills into the first training graph (another compilation).
        model.to_empty(device="cpu" if device.type == "xla" else device)
    reader = ShardReader(weights, "model") if weights is not None else None
    fill_shards(
        model, full_shapes=full_shapes, rules=rules, seed=recipe.train.seed, reader=reader, dims=dims, source=source
    )
    if neuron_tp:
        from trnrecipes.neuron_parallel import move_to_device

        move_to_device(model, device)
    elif device.type == "xla":
        model.to(device)
    return model


def fill_shards(
    model: nn.Module, *, full_shapes: dict, rules: dict, seed: int, reader: ShardReader | None, dims, source: str = ""
) -> None:
    """Fill every parameter's local shard in place: drawn by its init rule, or read from `reader`'s checkpoint."""
    if reader is not None and (found := reader.names()) != set(full_shapes):
        extra, missing = sorted(found - set(full_shapes)), sorted(set(full_shapes) - found)
        raise CheckpointError(
            f"{source or reader.path}: its weights do not fit this recipe's model"
            f" (missing {missing[:3]}, unexpected {extra[:3]})"
        )
    for name, p in model.named_parameters():
        local = local_tensor(p).data
        region = shard_region(full_shapes[name], shard_dim(p), dims.tp, dims.tp_rank)
        if tuple(local.shape) != region.size:  # the sharding rule and the parallel layers disagree: a bug, not input
            raise RuntimeError(f"{name}: local shard {tuple(local.shape)} is not the expected {region.size}")
        if reader is not None:
            reader.read_into(name, local, full_shapes[name], region.start)
        else:
            fill_region(local, full_shapes[name], region.start, rules[name], seed, name)


def materialize_meta(model: nn.Module, device: torch.device) -> None:
    """Give every parameter still on the meta device real (uninitialised) memory, keeping the attributes set on the
    Parameter (NxD's tensor_model_parallel, our sequence_parallel_enabled): Module.to_empty would drop them."""
    for module in model.modules():
        for key, p in list(module._parameters.items()):
            if p is not None and p.is_meta:
                new = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                new.__dict__.update(p.__dict__)
                module._parameters[key] = new
