"""Loading a training rank's state: `load` is the one way in, for a fresh start, a resume and fine-tuning.

It builds this rank's shard of the model (trnrecipes.train.build: weights drawn from the seed, or read slice by
slice from the checkpoint), makes the backend's optimizer, and on a resume restores the optimizer moments (this
rank's slice, whatever TP / PP / ZeRO-1 layout saved them) and this DP rank's data position. No RNG state: the
trainer seeds each step's draws from (train.seed, step, rank) (trnrecipes/train/step_rng.py). Fine-tuning from
train.init_from reads the weights the same way and starts the rest afresh.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from trnrecipes.checkpoint.format import CheckpointError, ShardReader, data_file, read_json
from trnrecipes.config.changes import allows
from trnrecipes.config.sections import Recipe
from trnrecipes.data.blend import DataPosition, position_from_dict, restart_position
from trnrecipes.data.order import DATA_ORDER
from trnrecipes.parallel.expert import expert_layouts
from trnrecipes.parallel.kv_replication import block_of, tp_block
from trnrecipes.parallel.kv_replication import layouts as kv_layouts
from trnrecipes.parallel.sharding import chunk_range, shard_region
from trnrecipes.schema import clipped
from trnrecipes.train.build import build_model_shard

if TYPE_CHECKING:
    from trnrecipes.backends import Backend
    from trnrecipes.parallel.dims import ParallelDims


@dataclass
class TrainState:
    model: nn.Module  # this rank's shard, on the backend's device
    optimizer: object  # the backend's optimizer over the model's trained parameters
    step: int  # optimizer steps already taken (0: a fresh start or fine-tuning)
    position: DataPosition | None  # where this DP rank's data stream resumes; None: from its start


def load(
    path: Path | None,
    recipe: Recipe,
    *,
    dims: ParallelDims,
    backend: Backend,
    num_docs: int | list[int],
    weights_only: bool = False,
    keep_optimizer: bool = False,
    source: str = "",
    allowed=(),
    data_order_changed: bool = False,
    log=print,
) -> TrainState:
    """This rank's training state from checkpoint `path` (a verified step_N dir): weights, optimizer and data
    position; with weights_only (train.init_from), the weights only, plus the optimizer moments and step count with
    keep_optimizer (train.init_optimizer keep). path None: a fresh start from train.seed.
    `source` names the checkpoint in errors; `allowed` (checkpoint.allow_changes) and `data_order_changed` decide
    whether a saved data position still applies."""
    model = build_model_shard(recipe, dims=dims, backend=backend, weights=path, source=source)
    optimizer = backend.make_optimizer(model, recipe, dims)
    if path is not None and weights_only and keep_optimizer:
        restore_moments(path, model, optimizer, dims, backend.shard_dim)
    if path is None or weights_only:
        return TrainState(model, optimizer, 0, None)
    position = restore_training_state(
        path,
        model,
        optimizer,
        dims,
        log,
        num_docs=num_docs,
        allowed=allowed,
        data_order_changed=data_order_changed,
        shard_dim=backend.shard_dim,
    )
    return TrainState(model, optimizer, int(path.name.split("_")[1]), position)


def full_shape(p: torch.Tensor, tp: int, dim: int | None) -> tuple[int, ...]:
    """A parameter's full (unsharded) shape: a DTensor knows it; an NxD shard is tp times longer on partition_dim."""
    shape = list(p.shape)
    if dim is not None and not hasattr(p, "placements"):
        shape[dim] *= tp
    return tuple(shape)


def restore_moments(path: Path, model, optimizer, dims, shard_dim: Callable[[torch.Tensor], int | None]) -> dict:
    """The Adam moments and step count (this rank's slice only: its TP shard, and under ZeRO-1 or FSDP its rows),
    read from whichever saved files hold it: any saved TP / ZeRO-1 / DP layout and backend resumes at any other.
    Returns the checkpoint's state.json."""
    state = read_json(path / "state.json")
    try:
        optimizer_steps = float(state["optimizer_steps"])
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{path / 'state.json'}: missing or bad entry ({err})") from None
    reader = ShardReader(path, "optim")
    names = {id(p): name for name, p in model.named_parameters()}
    params = [(names[id(p)], p) for p in optimizer.params]  # the trained parameters, in the optimizer's order
    expected = {f"{key}.{name}" for name, _ in params for key in ("exp_avg", "exp_avg_sq")}
    if missing := sorted(expected - reader.names()):
        raise CheckpointError(f"{path}: no optimizer state for {missing[0]} ({len(missing)} missing)")
    replicated, blocks, experts = kv_layouts(model), tp_block(model), expert_layouts(model)
    for i, (name, p) in enumerate(params):
        if (kv := replicated.get(name)) is not None:  # TP wider than the KV heads: two row ranges of the stored tensor
            shape = (kv.stored_rows, *p.shape[1:])
            # ZeRO-1 (ours or NxD's): this shard rank's rows of the local tensor, split as the files are
            rows = (0, kv.local_rows)
            if dims.shards_moments:
                rows = chunk_range(kv.local_rows, dims.shard_n, dims.shard_rank)
            for local_row, stored_row, n in kv.row_pieces(dims.tp_rank, *rows):
                start = (stored_row, *[0] * (len(shape) - 1))
                for key, moments in (("exp_avg", optimizer.exp_avg), ("exp_avg_sq", optimizer.exp_avg_sq)):
                    reader.read_into(f"{key}.{name}", moments[i][local_row : local_row + n], shape, start)
            continue
        dim = shard_dim(p)
        shape = full_shape(p, dims.tp, dim)
        ep, rows = (1, 0), (dims.shard_n, dims.shard_rank) if dims.shards_moments else (1, 0)
        if (shard := experts.get(name)) is not None:  # expert parallelism: this rank's experts (FSDP: rows of them)
            shape, ep = (shard.num_experts, *shape[1:]), (shard.ep, shard.ep_rank)
            rows = (dims.dp // dims.ep, dims.dp_rank // dims.ep) if dims.fsdp else (1, 0)
        block = block_of(blocks, name, dims.tp_rank)  # NxD's tiled KV copies move o_proj's blocks
        region = shard_region(shape, dim, dims.tp, block, *rows, experts=ep)
        reader.read_into(f"exp_avg.{name}", optimizer.exp_avg[i], shape, region.start)
        reader.read_into(f"exp_avg_sq.{name}", optimizer.exp_avg_sq[i], shape, region.start)
    optimizer.set_steps(int(optimizer_steps))
    return state


def restore_training_state(
    path: Path,
    model,
    optimizer,
    dims,
    log=print,
    *,
    num_docs: int | list[int],
    allowed=(),
    data_order_changed: bool = False,
    shard_dim: Callable[[torch.Tensor], int | None],
):
    """Optimizer moments (re-sliced for this TP / PP layout) and this DP rank's data position.
    Returns the data position to start from: the saved one only while it means the same documents (same corpus
    size, same DP size, same order); otherwise the stream restarts at the next epoch, and only when
    checkpoint.allow_changes accepted what moved it (data.path, layout.dp)."""
    state = restore_moments(path, model, optimizer, dims, shard_dim)
    try:
        saved_dp = int(state["dp"])
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{path / 'state.json'}: missing or bad entry ({err})") from None
    # Checkpoints written before each step's draws were seeded from (train.seed, step, rank) hold every rank's
    # generator state in rng-rankNNNN.safetensors: nothing reads it, the next step seeds its own.
    why = "checkpoint.allow_changes changed the data order" if data_order_changed else None
    order = state.get("data_order", 1)  # checkpoints before order.py did not record it: version 1
    if why is None and order != DATA_ORDER:
        why = f"the checkpoint's data position is in document order version {order}, this trnrecipes uses {DATA_ORDER}"
    saved_docs = state.get("num_docs")
    if saved_docs is not None and saved_docs != num_docs:
        key = "data.sources" if isinstance(num_docs, list) else "data.path"
        if not (allows(allowed, key) or allows(allowed, "data.path")):
            raise CheckpointError(
                f"{path}: trained on {'corpora' if isinstance(num_docs, list) else 'a corpus'} of {saved_docs}"
                f" documents, but {key} now has {num_docs}: its data"
                f" position would index other documents. Restore the corpus, or name {key} in"
                " checkpoint.allow_changes to go on with this one (its stream then starts afresh)"
            )
        why = f"the corpus changed ({saved_docs} -> {num_docs} documents)"
    if saved_dp != dims.dp:
        if not allows(allowed, "layout.dp"):
            raise CheckpointError(
                f"{path}: saved at data-parallel size {saved_dp}, resumed at {dims.dp}: each DP rank's data position"
                " cannot carry over (the stream would restart at the next epoch, skipping the rest of this one);"
                " name layout.dp in checkpoint.allow_changes to accept that"
            )
        why = f"data parallel size changed ({saved_dp} -> {dims.dp})"
    sources = len(num_docs) if isinstance(num_docs, list) else 1
    if why is None:
        file = path / data_file(dims.dp_rank)
        try:
            return position_from_dict(read_json(file), sources)
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"{file}: not a data position ({clipped(err, 80)})") from None
    restart = restart_position([read_json(f) for f in sorted(path.glob("data-dp*.json"))], sources)
    where = f"epoch {restart.epoch}" if sources == 1 else "epochs " + ", ".join(str(p.epoch) for p in restart.sources)
    log(f"[trnrecipes] {why}: positions do not carry over, the data stream restarts at {where}")
    return restart
