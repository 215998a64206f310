"""The flat all-gather and reduce-scatter every sharded exchange here uses, under the names of the torch release at
hand: torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to all_gather_single / reduce_scatter_single."""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather_into(output: torch.Tensor, input_: torch.Tensor, group) -> None:
    """Every rank's `input_` concatenated along dim 0 into `output`, in group rank order."""
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    all_gather(output, input_, group=group)


def reduce_scatter_into(output: torch.Tensor, input_: torch.Tensor, group) -> None:
    """`input_` summed over the group's ranks, each rank keeping its own slice (group rank order) in `output`."""
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    reduce_scatter(output, input_, group=group)
