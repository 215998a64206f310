"""What every rank does first under torchrun: read the launcher's environment, check it against the recipe's
layout, and join the process group. A world size that does not match the layout fails before any work starts."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from trnrecipes.layout import Layout, compute_layout
from trnrecipes.recipe import Recipe, RecipeError


@dataclass
class LaunchContext:
    rank: int
    local_rank: int
    world_size: int
    host: str
    layout: Layout

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def verify_launch(recipe: Recipe) -> LaunchContext:
    import torch
    import torch.distributed as dist

    layout = compute_layout(recipe)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    ctx = LaunchContext(rank, int(os.environ.get("LOCAL_RANK", "0")), world, socket.gethostname(), layout)
    if world != layout.world_size:
        raise RecipeError(
            f"launched with {world} rank(s), but recipe {recipe.name} at {layout.nodes} node(s) x"
            f" {layout.workers_per_node} workers needs {layout.world_size}; launch it with its run.sbatch"
        )
    if "MASTER_ADDR" in os.environ:
        # The collective backend of the neuron/xla/cuda step loops comes with trnrecipes/backends/;
        # gloo proves the rendezvous and the rank numbering here.
        dist.init_process_group("gloo", rank=rank, world_size=world)
        ranks = torch.tensor([rank], dtype=torch.int64)
        dist.all_reduce(ranks)
        if ranks.item() != world * (world - 1) // 2:
            raise RuntimeError(f"rank ids do not add up: got {ranks.item()}, want {world * (world - 1) // 2}")
    return ctx
