"""layout.fsdp: FSDP2 (torch.distributed.fsdp.fully_shard) as the data-parallel mode on the torch backends.

Applied last in the parallelize step, as torchtitan does (TP, then activation checkpointing and torch.compile, then
FSDP): each transformer block is its own FSDP unit (its parameters gathered just before its forward and backward,
freed after; the last block's kept from its forward to its backward, which comes next), and the root unit holds
what is left (embedding, final norm, head; FSDP keeps a root's parameters gathered after forward). With TP the
parameters are already DTensors on the mesh's tp dim; fully_shard over the shard dim makes them 2-D DTensors.

The shard group (ParallelDims.shard_group) is the DP group at CP 1; under context parallelism it is the dp x cp ranks,
the mesh's dp and cp dims flattened into one called SHARD_DIM (torchtitan's dp_shard_cp): a replica's CP ranks hold
the same weights, so they share out parameters, gradients and moments too, shard index dp_rank x cp + cp_rank of
shard_n = dp x cp. (70B at TP 8 x CP 64 x DP 2: 1/128 of the states a rank, not 1/2.)

How a parameter is split matches ZeRO-1's rows (trnrecipes.parallel.sharding): FSDP2 chunks dim 0 of the TP-local tensor
torch.chunk style over the shard group, so a rank's local tensor is exactly `shard_region(..., shard_n, shard_rank)`.
The sharded build fills those rows directly, the optimizer keeps moments for them only (as under ZeRO-1), and the
checkpoint writes the same files as a run without FSDP: weights gathered over the shard group per tensor (tp_local)
and written by shard rank 0, moments per shard rank like ZeRO-1's (their count recorded as optim_dp). A checkpoint
therefore resumes with FSDP on or off, at any DP or CP size.

Gradients: FSDP reduce-scatters them in each backward, averaged over the shard group (its default divide factor: a
CP rank's gradient is its tokens' share, so the dp x cp mean is the one wanted), so the step does not average them
again (TorchBackend.reduce_and_clip). Under gradient accumulation every micro-batch's backward
reduce-scatters (more traffic than one reduction per step, but no unsharded gradient kept between micro-batches: the
memory is what FSDP is for).

Dynamo does not trace FSDP's hooks (torch._dynamo.config.skip_fsdp_hooks), so compiled blocks keep their
all-gathers and reduce-scatters eager.
"""

from __future__ import annotations

import torch
from torch import nn

SHARD_DIM = "dp_cp"  # the name of the flattened dp x cp mesh dim FSDP shards over under context parallelism


def apply_fsdp(model: nn.Module, dp_mesh) -> None:
    """fully_shard every block of model.layers, then the model itself, over the 1-D shard mesh, in place."""
    from torch.distributed.fsdp import fully_shard

    blocks = list(model.layers.children())
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again at once by backward: keep them gathered after forward.
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=i < len(blocks) - 1)
    fully_shard(model, mesh=dp_mesh)


def reshard(model: nn.Module) -> None:
    """Put every FSDP unit back to its shards. A forward without backward (validation) leaves the root and the
    last block gathered (FSDP keeps the root's parameters after forward, and the last block is wrapped so), and
    anything that reads the parameters as this rank's rows (the parameter norm) must not see whole tensors."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def tp_local(t: torch.Tensor) -> torch.Tensor:
    """`t` as its TP rank would hold it without FSDP: a DTensor's shards gathered (a collective over the shard group:
    every rank of it must call it), its TP shard kept; a plain tensor as it is."""
    if getattr(t, "placements", None) is None:
        return t
    from torch.distributed.tensor import Replicate  # here: a run without DTensors never imports it (~1 s of CPU)

    names = t.device_mesh.mesh_dim_names or ()
    for name in ("dp", SHARD_DIM):
        if name in names and not t.placements[dp := names.index(name)].is_replicate():
            t = t.redistribute(placements=[*t.placements[:dp], Replicate(), *t.placements[dp + 1 :]])
    return t.to_local()


def mesh_dim_placement(t: torch.Tensor, name: str):
    """The placement of a DTensor on the mesh dim called `name`; None for a plain tensor or a mesh without it."""
    placements = getattr(t, "placements", None)
    if placements is None:
        return None
    names = t.device_mesh.mesh_dim_names
    if names is None and len(placements) == 1:  # an unnamed 1-D mesh: the only placement there is
        return placements[0]
    return placements[names.index(name)] if names and name in names else None
