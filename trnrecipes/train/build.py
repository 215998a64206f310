"""The model a training rank holds: built on the meta device, parallelized there, then only this rank's shard
materialised and filled, so the full model never exists on a rank whose layout shards it.

Filling reads each parameter's place in its full tensor (trnrecipes.parallel.sharding) and either draws it (the family's
init rules, recipes/common/init.py: the same full model for every layout and seed) or reads exactly that slice from
a checkpoint (ShardReader: safetensors get_slice, whatever layout saved it).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from recipes.common.init import fill_region
from trnrecipes.checkpoint import CheckpointError, ShardReader
from trnrecipes.config.families import family_spec
from trnrecipes.config.sections import Recipe
from trnrecipes.config.stages import pipeline_stages, rank_stages
from trnrecipes.models import build_model
from trnrecipes.parallel.dims import local_tensor
from trnrecipes.parallel.expert import expert_layouts
from trnrecipes.parallel.kv_replication import block_of, tp_block
from trnrecipes.parallel.kv_replication import layouts as kv_layouts
from trnrecipes.parallel.pipeline import StagedModel
from trnrecipes.parallel.sharding import shard_region

if TYPE_CHECKING:
    from trnrecipes.backends import Backend
    from trnrecipes.parallel.dims import ParallelDims


def build_model_shard(
    recipe: Recipe, *, dims: ParallelDims, backend: Backend, weights: Path | None = None, source: str = ""
) -> nn.Module:
    """This rank's part of the recipe's model on the backend's device (its pipeline stages, each parameter's TP
    shard): initialised from train.seed, or, given `weights` (a verified checkpoint dir; `source` names it in
    errors), its weights for this rank's shard."""
    model = build_model(recipe.model, "meta")
    full_shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    rules = model.init_rules()
    if dims.pp > 1:  # this pipeline rank's stages only, under the full model's parameter names
        stages = rank_stages(pipeline_stages(recipe), dims.pp_rank)
        model = StagedModel(model, family_spec(recipe.model.family).parts, stages)
    if recipe.precision.dtype == "bf16":
        model.to(torch.bfloat16)  # weights themselves in bf16 (no fp32 master copy); free on meta
    backend.parallelize(model, recipe, dims)  # on meta: parallel layers describe their shard, allocate nothing
    backend.materialize(model)  # each parameter's local shard only
    reader = ShardReader(weights, "model") if weights is not None else None
    fill_shards(
        model,
        full_shapes=full_shapes,
        rules=rules,
        seed=recipe.train.seed,
        reader=reader,
        dims=dims,
        shard_dim=backend.shard_dim,
        source=source,
    )
    backend.to_device(model)
    return model


def fill_shards(
    model: nn.Module,
    *,
    full_shapes: dict,
    rules: dict,
    seed: int,
    reader: ShardReader | None,
    dims,
    shard_dim: Callable[[torch.Tensor], int | None],
    source: str = "",
) -> None:
    """Fill every parameter's local shard in place: drawn by its init rule, or read from `reader`'s checkpoint."""
    if reader is not None and (found := reader.names()) != set(full_shapes):
        extra, missing = sorted(found - set(full_shapes)), sorted(set(full_shapes) - found)
        raise CheckpointError(
            f"{source or reader.path}: its weights do not fit this recipe's model"
            f" (missing {missing[:3]}, unexpected {extra[:3]})"
        )
    replicated, blocks, experts = kv_layouts(model), tp_block(model), expert_layouts(model)
    for name, p in model.named_parameters():
        local = local_tensor(p).data
        if (kv := replicated.get(name)) is not None:  # TP wider than the KV heads: two row ranges of the stored tensor
            for local_row, stored_row, n in kv.row_pieces(dims.tp_rank):
                part, start = local[local_row : local_row + n], (stored_row, *[0] * (local.dim() - 1))
                if reader is not None:
                    reader.read_into(name, part, full_shapes[name], start)
                else:
                    fill_region(part, full_shapes[name], start, rules[name], seed, name)
            continue
        rows = (dims.shard_n, dims.shard_rank) if dims.fsdp else (1, 0)  # FSDP: this shard rank's rows of the TP shard
        block = block_of(blocks, name, dims.tp_rank)  # NxD's tiled KV copies move o_proj's blocks
        ep = (1, 0)
        if (shard := experts.get(name)) is not None:  # expert parallelism: this rank's experts (FSDP: rows of them)
            ep = (shard.ep, shard.ep_rank)
            rows = (dims.dp // dims.ep, dims.dp_rank // dims.ep) if dims.fsdp else (1, 0)
        region = shard_region(full_shapes[name], shard_dim(p), dims.tp, block, *rows, experts=ep)
        if tuple(local.shape) != region.size:  # the sharding rule and the parallel layers disagree: a bug, not input
            raise RuntimeError(f"{name}: local shard {tuple(local.shape)} is not the expected {region.size}")
        if reader is not None:
            reader.read_into(name, local, full_shapes[name], region.start)
        else:
            fill_region(local, full_shapes[name], region.start, rules[name], seed, name)
