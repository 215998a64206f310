"""layout.cp: context parallelism for the causal families on the torch backends. Each sequence is cut into 2 x cp
chunks and CP rank r holds chunks r and 2cp-1-r (the front and the back: every rank's causal attention work is the
same); its loader keeps only those (SequenceChunks, cut on the host before the device copy). Its queries attend over
the whole sequence, whose keys and values are all-gathered over the CP group in each attention; RoPE rotates each
token by its true position; the loss is weighed by the rank's share of the labelled tokens, and gradients are
averaged over the dp x cp ranks (ParallelDims.average_over_dp)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from recipes.common.attention import CoreAttention
from recipes.common.eager import eager_under_compile
from recipes.common.loss import IGNORE_INDEX
from trnrecipes.parallel import with_mixin
from trnrecipes.parallel.collectives import all_gather_into, reduce_scatter_into
from trnrecipes.plan.layout import global_rank

if TYPE_CHECKING:
    from torch.nn.attention.bias import CausalBias


def split_sequence(t: torch.Tensor, cp: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """CP rank `cp_rank`'s part of `t` (whole sequences along `dim`): chunks cp_rank and 2cp-1-cp_rank of 2 x cp."""
    c = t.shape[dim] // (2 * cp)
    return torch.cat([t.narrow(dim, cp_rank * c, c), t.narrow(dim, (2 * cp - 1 - cp_rank) * c, c)], dim)


def merge_sequence(parts: torch.Tensor, dim: int) -> torch.Tensor:
    """The whole sequences from every CP rank's part (split_sequence's inverse): `parts` stacks them on a new dim 0
    in CP rank order; `dim` is the sequence dim of one part. The fronts are chunks 0..cp-1, the backs the rest in
    reverse rank order."""
    front, back = parts.chunk(2, dim=dim + 1)
    return torch.cat([*front.unbind(0), *reversed(back.unbind(0))], dim)


@dataclass(frozen=True)
class SequenceChunks:
    """What a CP rank reads of a micro-batch: its two chunks of the token ids and of the labels ([b, s / cp] each),
    and `labelled`, the number of labelled tokens of the whole sequences (0-d), which weighs its loss. The count
    comes with the batch from the host, which sees the whole samples before it cuts them, rather than from an
    all-reduce over the CP group: no collective (nor a wait on one) in each micro-batch's forward."""

    tokens: torch.Tensor
    labels: torch.Tensor
    labelled: torch.Tensor

    @classmethod
    def of(cls, samples: torch.Tensor, cp: int, cp_rank: int) -> SequenceChunks:
        """CP rank `cp_rank`'s part of packed samples [b, s + 1] (inputs s[:-1], labels s[1:], as at CP 1)."""
        labels = samples[:, 1:]
        return cls(
            split_sequence(samples[:, :-1], cp, cp_rank),
            split_sequence(labels, cp, cp_rank),
            (labels != IGNORE_INDEX).sum(),
        )

    def to(self, device: torch.device, non_blocking: bool = False) -> SequenceChunks:
        """On `device` (what a backend's loader calls on each batch)."""
        return SequenceChunks(
            *(t.to(device, non_blocking=non_blocking) for t in (self.tokens, self.labels, self.labelled))
        )


def local_positions(seq_len: int, cp: int, cp_rank: int, device: torch.device | None = None) -> torch.Tensor:
    """The positions in the sequence of the tokens CP rank `cp_rank` holds, in the order it holds them."""
    return split_sequence(torch.arange(seq_len, device=device), cp, cp_rank, dim=0)


def init_context_groups(dims) -> None:
    """Set dims.cp_group (this replica's CP ranks, group rank = cp_rank: the all-gather stacks parts in group rank
    order) and dims.dp_cp_group (the dp x cp ranks of this TP rank and stage, over which gradients are averaged).
    Every rank creates every group, in the same order, as torch.distributed.new_group requires."""
    dims.cp_group = dims.mesh["cp"].get_group()
    if (group_rank := dist.get_rank(dims.cp_group)) != dims.cp_rank:
        raise RuntimeError(
            f"CP rank {dims.cp_rank} is rank {group_rank} of its CP group: the mesh and the layout disagree"
        )
    for pp_rank in range(dims.pp):
        for tp_rank in range(dims.tp):
            at = {"pp_rank": pp_rank, "tp_rank": tp_rank, "dp": dims.dp, "tp": dims.tp, "cp": dims.cp}
            ranks = [global_rank(dp_rank=d, cp_rank=c, **at) for d in range(dims.dp) for c in range(dims.cp)]
            group = dist.new_group(ranks)
            if dims.rank in ranks:
                dims.dp_cp_group = group


class _GatherParts(torch.autograd.Function):
    """Every CP rank's tensor stacked on a new dim 0 in rank order (one all-gather); backward: the gradients summed
    over the ranks, each rank getting its own part's (a reduce-scatter), for the tokens it holds."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, cp: int) -> torch.Tensor:
        ctx.group = group
        out = x.new_empty((cp, *x.shape))
        all_gather_into(out.view(-1), x.reshape(-1), group)  # flat: gloo wants the parts stacked along dim 0
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty(grad.shape[1:])
        reduce_scatter_into(out.view(-1), grad.reshape(-1), ctx.group)
        return out, None, None


def chunked_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: int, cp_rank: int) -> torch.Tensor:
    """Causal attention of CP rank `cp_rank`'s queries (q [b, heads, 2c, d]: its two chunks) over the whole
    sequence's keys and values (k, v [b, kv_heads, 2 x cp x c, d], in order), exact: chunk j's queries see the keys
    before it and, of its own chunk, those up to their own position (SDPA's causal mask aligned to the lower right).
    Two SDPA calls, each over only the keys its chunk can see."""
    c = q.shape[2] // 2
    outputs = []
    for half, mask in enumerate(causal_masks(c, cp, cp_rank)):
        seen = mask.seq_len_kv
        outputs.append(
            F.scaled_dot_product_attention(
                q[:, :, half * c : (half + 1) * c],
                k[:, :, :seen],
                v[:, :, :seen],
                attn_mask=mask,
                enable_gqa=q.shape[1] != k.shape[1],
            )
        )
    return torch.cat(outputs, dim=2)


@functools.cache
def causal_masks(c: int, cp: int, cp_rank: int) -> tuple[CausalBias, CausalBias]:
    """The causal masks of CP rank `cp_rank`'s two chunks of `c` queries: chunk j's over the (j + 1) c keys it can
    see, aligned to the lower right. As CausalBias, which SDPA passes to a kernel that takes the mask as such (flash,
    memory-efficient) and materialises only where none does (CPU). Cached, and first made by ContextParallel.forward
    outside any checkpointed region: a CausalBias is a tensor subclass, which elementwise checkpointing's dispatch
    mode does not let one make. Imported here: torch.nn.attention.bias imports torch._dynamo (see
    recipes/common/eager.py)."""
    from torch.nn.attention.bias import causal_lower_right

    return tuple(causal_lower_right(c, (chunk + 1) * c) for chunk in (cp_rank, 2 * cp - 1 - cp_rank))


# Eager under train.compile, as expert parallelism's exchange is: the collectives run in torch.distributed's own
# calls, not traced; the blocks' other parts still compile.
@eager_under_compile
def context_parallel_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group, cp: int, cp_rank: int
) -> torch.Tensor:
    """CoreAttention's contract on this rank's chunks: the keys and values of every CP rank all-gathered and put in
    sequence order, then chunked_causal_attention.

    All-gather, not a ring (each rank passing its keys and values on while it computes, as ring attention does): one
    collective a layer, simple to get exact, and torch's own context_parallel offers the same (its allgather rotate
    method); overlapping the exchange with compute is a later speed-up. Under grouped-query attention the gathered
    keys and values are small beside the queries: kv_heads / heads of them (Llama 3.1 8B: 8 of 32 heads)."""
    k = merge_sequence(_GatherParts.apply(k, group, cp), dim=2)
    v = merge_sequence(_GatherParts.apply(v, group, cp), dim=2)
    return chunked_causal_attention(q, k, v, cp, cp_rank)


def context_parallel_rope(rope, cp: int, cp_rank: int):
    """`rope` (an attention's (cos, sin) tables for positions 0..seq_len-1: rope(seq_len, device, dtype)) for this
    rank's tokens: the whole sequence's tables (made once, cached by the family), this rank's rows of them. Eager
    under train.compile, so the whole tables stay cached rather than recomputed in every compiled block."""

    @eager_under_compile
    def local_rope(seq_len: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rope(seq_len * cp, device, dtype)
        return split_sequence(cos, cp, cp_rank, dim=0), split_sequence(sin, cp, cp_rank, dim=0)

    return local_rope


class ContextParallel:
    """A causal language model's forward on this CP rank's part of each sequence (mixed in before the family's
    class by apply_context_parallel): `tokens` and `labels` are its two chunks already ([b, s / cp], a
    SequenceChunks' fields), `labelled` the whole micro-batch's count of labelled tokens. The family's loss is the
    mean over this rank's labelled tokens; multiplied by cp x its share of that count, the CP ranks' mean (the
    gradient average) is the mean over all of them, as at CP 1. Without labels: the logits of its chunks."""

    context_parallel: tuple[int, int]  # (cp, cp_rank)

    def forward(
        self, tokens: torch.Tensor, labels: torch.Tensor | None = None, labelled: torch.Tensor | None = None
    ) -> torch.Tensor:
        cp, cp_rank = self.context_parallel
        causal_masks(tokens.shape[1] // 2, cp, cp_rank)
        if labels is None:
            return super().forward(tokens)
        if labelled is None:
            raise TypeError(
                "under context parallelism the loss needs `labelled`, the labelled tokens of the whole sequences"
                " (SequenceChunks.labelled): this rank holds only its chunks of the labels"
            )
        loss = super().forward(tokens, labels=labels)
        return loss * (cp * (labels != IGNORE_INDEX).sum() / labelled.clamp_min(1))


def apply_context_parallel(model: nn.Module, dims) -> None:
    """On the meta device, in place: the model's forward takes this rank's chunks, every CoreAttention attends over
    the gathered keys and values, and every attention's RoPE (its `rope` attribute) holds its tokens' positions."""
    cp, cp_rank = dims.cp, dims.cp_rank
    kernel = functools.partial(context_parallel_attention, group=dims.cp_group, cp=cp, cp_rank=cp_rank)
    for module in model.modules():
        if isinstance(module, CoreAttention):
            if type(module).forward is not CoreAttention.forward:  # the recipe check refuses such families
                raise ValueError(f"layout.cp: {type(module).__name__} computes its own attention")
            module.kernel = kernel
        if hasattr(module, "rope"):
            module.rope = context_parallel_rope(module.rope, cp, cp_rank)
    model.context_parallel = (cp, cp_rank)
    model.__class__ = with_mixin(ContextParallel, type(model))
