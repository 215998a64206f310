"""Tensor (and sequence) parallelism off Neuron: a family's plan (recipes/<family>/parallelize.py) applied with
torch.distributed.tensor (DTensor), on gloo (CPU) or nccl (CUDA).

Without sequence parallelism: column-parallel qkv/fc_in, row-parallel out/fc_out (one all-reduce per branch),
vocab-parallel embedding and head; the loss is computed on the head's vocabulary shards (vocab_parallel_head_loss),
no rank gathers the logits. With it (torchtitan's layout): the residual stream and the norms live on sequence
shards; attention and MLP all-gather their input and reduce-scatter their output, so activation memory outside the
branches drops by the TP degree. A mixture of experts keeps its experts whole per TP rank and splits the tokens
(token_split).
"""

from __future__ import annotations

import importlib

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from recipes.common.loss import IGNORE_INDEX, VocabShard, vocab_parallel_cross_entropy
from trnrecipes.parallel.expert import route_over_tp


def _outside(name: str, block: str | None) -> bool:
    """Whether module `name` is neither the sparse block `block` nor inside it ("mlp_norm" is outside "mlp")."""
    return block is None or not (name == block or name.startswith(block + "."))


def family_plan(family: str):
    return importlib.import_module(f"recipes.{family}.parallelize")


def layer_ids(model: nn.Module) -> list[str]:
    """The keys of the model's layers: 0..L-1, or the original indices a pipeline rank holds (a StagedModel)."""
    return [name for name, _ in model.layers.named_children()]


def tensor_parallel_styles(
    family: str,
    layer_ids: list[str],
    sequence_parallel: bool,
    top: tuple[str, ...] = ("embed", "norm", "head"),
    sparse_layers: frozenset[str] = frozenset(),
) -> dict[str, ParallelStyle]:
    """The plan for the layers named `layer_ids` (their keys under `layers`) and the top-level modules in `top`
    (a pipeline stage holds some of them only); in `sparse_layers` the MLP is a mixture of experts (token_split)."""
    plan = family_plan(family)
    seq = Shard(1)
    styles: dict[str, ParallelStyle] = {}
    if "embed" in top:
        styles["embed"] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=seq if sequence_parallel else Replicate()
        )
    if "head" in top:
        styles["head"] = ColwiseParallel(
            input_layouts=seq if sequence_parallel else Replicate(), output_layouts=Replicate()
        )
    if sequence_parallel and "norm" in top:
        styles["norm"] = SequenceParallel()
    for i in layer_ids:
        prefix = f"layers.{i}."
        moe = sparse_moe_name(plan) if i in sparse_layers else None
        if moe is not None:  # the dense MLP's styles do not apply to it
            styles[prefix + moe] = token_split(sequence_parallel)
        for name in plan.COLUMN_PARALLEL:
            if _outside(name, moe):
                styles[prefix + name] = ColwiseParallel()
        for name in plan.ROW_PARALLEL:
            if _outside(name, moe):
                styles[prefix + name] = RowwiseParallel(output_layouts=seq) if sequence_parallel else RowwiseParallel()
        for name in getattr(plan, "HEAD_NORMS", ()):  # input split by heads (dim 2) with or without SP
            styles[prefix + name] = SequenceParallel(sequence_dim=2, use_local_output=True)
        if sequence_parallel:
            for name in plan.NORMS:
                styles[prefix + name] = SequenceParallel()
            for name in plan.BRANCHES:
                if _outside(name, moe):
                    styles[prefix + name] = PrepareModuleInput(
                        input_layouts=(seq,), desired_input_layouts=(Replicate(),)
                    )
    return styles


def sparse_moe_name(plan) -> str | None:
    """A block's mixture of experts (the parent of the plan's EXPERTS), or None for a family without experts."""
    experts = getattr(plan, "EXPERTS", None)
    return experts.rsplit(".", 1)[0] if experts else None


def token_split(sequence_parallel: bool) -> ParallelStyle:
    """A sparse MLP under TP (torchtitan's "ETP 1": experts not split over TP): its router and experts whole on every
    TP rank, each rank routing and computing its 1/tp of the sequence. Without SP its input is taken apart (the
    gradient all-gathered back) and its output all-gathered (the gradient sliced); under SP the tokens are on their
    sequence shards already and stay there. DTensor's redistributes are those conjugate pairs."""
    seq = Shard(1)
    if sequence_parallel:
        return PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(seq,), use_local_output=True)
    return PrepareModuleInputOutput(
        input_layouts=(Replicate(),),
        desired_input_layouts=(seq,),
        use_local_input=True,
        output_layouts=(seq,),
        desired_output_layouts=(Replicate(),),
        use_local_output=True,
    )


def sparse_layer_ids(model: nn.Module, family: str) -> frozenset[str]:
    """The keys of the blocks whose MLP holds the family plan's stacked experts."""
    experts = getattr(family_plan(family), "EXPERTS", None)
    if experts is None:
        return frozenset()
    return frozenset(i for i, block in model.layers.named_children() if _holds(block, experts))


def _holds(module: nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


def vocab_parallel_head_loss(
    head: nn.Module,
    x: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
    *,
    chunk_size: int | None = None,
    gemm_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """fused_head_loss for the column-parallel head of this plan (weight a DTensor split by vocabulary rows): no rank
    gathers the logits (vocab_parallel_cross_entropy). The final hidden states reach it as they reach the head's
    ColwiseParallel: whole on every rank, or under SP sequence shards all-gathered here; their gradient, a partial
    sum on each rank, is all-reduced (reduce-scattered onto the shards under SP) as the head's own input hook does."""
    weight = head.weight
    if not isinstance(weight, DTensor) or weight.placements != (Shard(0),) or head.bias is not None:
        raise TypeError(
            "vocab_parallel_head_loss needs a bias-free head whose weight is a DTensor split by vocabulary rows"
            f" (placements (Shard(dim=0),)), got {type(weight).__name__}"
            f" {getattr(weight, 'placements', '')}{' with a bias' if head.bias is not None else ''}"
        )
    mesh = weight.device_mesh
    local = weight.to_local()
    if local.shape[0] * mesh.size() != weight.shape[0]:  # the rows are split evenly (the TP rule: tp divides vocab)
        raise ValueError(f"the head's {weight.shape[0]} vocabulary rows do not split evenly over {mesh.size()} ranks")
    whole = (
        x.redistribute(mesh, [Replicate()]) if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [Replicate()])
    )
    hidden = whole.to_local(grad_placements=[Partial()])  # each rank's gradient is its vocabulary shard's share
    shard = VocabShard(mesh.get_group(), mesh.get_local_rank() * local.shape[0])
    return vocab_parallel_cross_entropy(
        hidden.flatten(0, 1), local, labels.flatten(), shard, chunk_size, ignore_index, gemm_dtype=gemm_dtype
    )


def require_divisible_sequence(model: nn.Module, tp: int, what: str = "sequence parallel") -> None:
    """Refuse, before any collective, a batch whose sequence does not split evenly over the TP ranks: gloo aborts
    the process (no Python error) on uneven reduce-scatter shards. Checked at the embedding where the model holds
    one: a pipeline stage runs its own forward, not the model's (a later stage gets what the first one checked)."""

    def check_sequence(_module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        if inputs[0].shape[1] % tp:
            raise ValueError(f"{what} over {tp} ranks needs a sequence length divisible by {tp}")

    (model.embed if hasattr(model, "embed") else model).register_forward_pre_hook(check_sequence)


def apply_tensor_parallel(model: nn.Module, mesh: DeviceMesh, family: str, sequence_parallel: bool) -> nn.Module:
    """Shard `model` in place over the 1-D `mesh`. Every rank must hold the same full weights beforehand."""
    tp = mesh.size()
    family_plan(family).check_tensor_parallel(model.args, tp)
    sparse = sparse_layer_ids(model, family)
    if sequence_parallel or sparse:  # both split the sequence over the TP ranks
        require_divisible_sequence(model, tp, "sequence parallel" if sequence_parallel else "a mixture of experts")
    # The vocab-parallel embedding and head: a decoder's (a pipeline stage holds some of them); a family whose plan
    # names no TOP_LEVEL modules (bert: small tables and a pooled head) keeps them replicated.
    sharded_top = getattr(family_plan(family), "TOP_LEVEL", ("embed", "norm", "head"))
    top = tuple(name for name in sharded_top if hasattr(model, name))
    styles = tensor_parallel_styles(family, layer_ids(model), sequence_parallel, top, sparse)
    if "head" in top:
        model.head_loss = vocab_parallel_head_loss  # the head's vocabulary is split: the loss stays on the shards
    parallelize_module(model, mesh, styles)
    if sparse:  # the load-balancing loss over the replica's tokens, as at TP 1
        route_over_tp(model, [f"layers.{i}.{sparse_moe_name(family_plan(family))}" for i in sorted(sparse)], mesh)
    if "embed" in top:
        model.embed.register_forward_hook(wait_for_output)  # after the plan's own hook, which makes the output
    return model


def wait_for_output(_module: nn.Module, _inputs: tuple, output: torch.Tensor) -> torch.Tensor:
    """The vocab-parallel embedding's output as a plain tensor. The plan hands it on as an AsyncCollectiveTensor (its
    all-reduce, or reduce-scatter under SP, still in flight): as the input of a compiled block (train.compile),
    AOTAutograd then hands DTensor's Redistribute backward a plain gradient, which fails ("'Tensor' object has no
    attribute '_local_tensor'", torch 2.13, inductor and aot_eager alike). Inside a block those tensors are traced
    and compile fine. The first block needs the result at once anyway: nothing is lost by waiting here."""
    return output.clone() if isinstance(output, AsyncCollectiveTensor) else output
