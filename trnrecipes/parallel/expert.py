"""layout.ep: expert parallelism for a family's stacked experts (EXPERTS in recipes/<family>/parallelize.py) on the
torch backends. The DP ranks split into groups of `ep` consecutive DP ranks; EP rank j of a group holds the contiguous
experts [j E/ep, (j+1) E/ep) of every sparse block. Each rank routes its own tokens (the router is replicated), one
all-to-all sends each pick's row to its expert's rank and another brings the outputs back (dropless: no capacity).
An expert's gradient holds its EP group's tokens: summed over the ranks holding the same experts, divided by dp.
Under TP the experts are whole on every TP rank, each routing 1/tp of the tokens (route_over_tp); EP groups are
per tp_rank.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from recipes.common.eager import eager_under_compile
from trnrecipes.parallel import with_mixin
from trnrecipes.parallel.collectives import all_gather_into
from trnrecipes.plan.layout import global_rank


class ExpertShard(NamedTuple):
    """Which experts a rank holds: block `ep_rank` of `ep` contiguous blocks of the `num_experts` (dim 0)."""

    ep: int
    ep_rank: int
    num_experts: int

    @property
    def local(self) -> int:
        return self.num_experts // self.ep


def init_expert_groups(dims, mesh_type: str) -> None:
    """Set dims.ep_group (this rank's EP group: `ep` consecutive DP ranks, group rank = ep_rank) and
    dims.expert_replica_group (the dp / ep ranks of its DP group that hold the same experts; under FSDP also as
    dims.expert_fsdp_mesh). Every rank creates every group, in the same order, as torch.distributed.new_group
    requires."""
    if dims.ep == 1:
        return
    for pp_rank in range(dims.pp):
        for tp_rank in range(dims.tp):
            at = {"pp_rank": pp_rank, "tp_rank": tp_rank, "dp": dims.dp, "tp": dims.tp}
            dp_ranks = [global_rank(dp_rank=d, **at) for d in range(dims.dp)]
            for first in range(0, dims.dp, dims.ep):
                group = dist.new_group(dp_ranks[first : first + dims.ep])
                if dims.rank in dp_ranks[first : first + dims.ep]:
                    dims.ep_group = group
            for ep_rank in range(dims.ep):
                group = dist.new_group(dp_ranks[ep_rank :: dims.ep])
                if dims.rank in dp_ranks[ep_rank :: dims.ep]:
                    dims.expert_replica_group = group
    if dims.fsdp:  # FSDP shards a rank's experts over the ranks that hold the same ones
        dims.expert_fsdp_mesh = DeviceMesh.from_group(dims.expert_replica_group, mesh_type, mesh_dim_names=("dp",))


def apply_expert_parallel(model: nn.Module, suffix: str, dims) -> None:
    """On the meta device, in place: every module whose name ends with `suffix` keeps its EP rank's experts (dim 0 of
    each of its parameters) and dispatches tokens over dims.ep_group."""
    for name, module in model.named_modules():
        if name.endswith(suffix):
            experts = next(module.parameters()).shape[0]
            shard_experts(module, dims.ep_group, ExpertShard(dims.ep, dims.ep_rank, experts))


def apply_expert_fsdp(model: nn.Module, suffix: str, dims) -> None:
    """Under layout.fsdp, before the blocks are wrapped: each experts module its own FSDP unit over the ranks holding
    the same experts. FSDP averages their gradients over those dp / ep ranks; the step divides them by ep more
    (TorchBackend.reduce_and_clip; FSDP's own divide factor is a PREMUL_SUM reduction, which gloo has not)."""
    from torch.distributed.fsdp import fully_shard

    for name, module in model.named_modules():
        if name.endswith(suffix):
            fully_shard(module, mesh=dims.expert_fsdp_mesh)


def gather_replica_rows(t: torch.Tensor, dims) -> torch.Tensor:
    """Under FSDP: a rank's experts whole from each replica's rows (even: the layout checks it), a collective."""
    if dims.dp == dims.ep:
        return t
    out = t.new_empty((t.shape[0] * (dims.dp // dims.ep), *t.shape[1:]))
    all_gather_into(out, t.detach().contiguous(), dims.expert_replica_group)
    return out


def shard_experts(module: nn.Module, group, shard: ExpertShard) -> None:
    """`module` (a family's stacked experts: forward(x, chosen, weights) and grouped(rows, counts)) holding and
    running only the experts of `shard`, exchanging rows with the other ranks of `group`."""
    for pname, p in list(module.named_parameters(recurse=False)):
        local = p[shard.ep_rank * shard.local : (shard.ep_rank + 1) * shard.local]  # meta: a shape; else the values
        setattr(module, pname, nn.Parameter(local.detach().clone(), requires_grad=p.requires_grad))
    module.expert_shard, module.ep_group = shard, group
    module.__class__ = with_mixin(ExpertParallel, type(module))


def expert_layouts(model: nn.Module) -> dict[str, ExpertShard]:
    """The sharded expert parameters by name (under the model's parameter names) and which experts each holds."""
    return {
        f"{name}.{pname}" if name else pname: module.expert_shard
        for name, module in model.named_modules()
        if hasattr(module, "expert_shard")
        for pname, _ in module.named_parameters(recurse=False)
    }


def gather_experts(t: torch.Tensor, shard: ExpertShard, group) -> torch.Tensor:
    """The whole [num_experts, ...] tensor from each EP rank's block (a collective over the EP group)."""
    out = t.new_empty((shard.num_experts, *t.shape[1:]))
    all_gather_into(out, t.detach().contiguous(), group)
    return out


class _AllToAll(torch.autograd.Function):
    """Rows exchanged with all_to_all_single (counts per rank given); the gradient goes back the reverse way."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, received: list[int], sent: list[int], group) -> torch.Tensor:
        ctx.received, ctx.sent, ctx.group = received, sent, group
        return _all_to_all(rows, received, sent, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.sent, ctx.received, ctx.group), None, None, None


def _all_to_all(rows: torch.Tensor, received: list[int], sent: list[int], group) -> torch.Tensor:
    out = rows.new_empty((sum(received), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), received, sent, group=group)
    return out


class ExpertParallel:
    """The forward of stacked experts under EP (mixed in before the family's class by shard_experts)."""

    expert_shard: ExpertShard
    ep_group: object

    # Eager under train.compile: traced, the all-to-alls' data-dependent split sizes recompile the block at every new
    # count until dynamo's recompile limit (torch 2.13); the blocks' other parts still compile.
    @eager_under_compile
    def forward(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        ep, local = self.expert_shard.ep, self.expert_shard.local
        top_k = chosen.shape[1]
        order = chosen.reshape(-1).argsort(stable=True)  # picks by expert, so by the rank that holds it
        token = order // top_k
        to_send = torch.bincount(chosen.reshape(-1), minlength=ep * local)  # picks per expert, all of the group's
        from_each = torch.empty_like(to_send)  # [source rank, local expert]: what each rank sends to this one
        dist.all_to_all_single(from_each, to_send, group=self.ep_group)
        # Split sizes on the host: one sync per sparse block, as the single-device forward has.
        sent, received = to_send.view(ep, local).sum(1).tolist(), from_each.view(ep, local).sum(1).tolist()
        rows = _AllToAll.apply(x.index_select(0, token), received, sent, self.ep_group)
        # Arrived by source rank, each source's rows by local expert: regroup them by local expert, run, put back.
        expert = torch.arange(local, device=x.device).repeat(ep).repeat_interleave(from_each)
        by_expert = expert.argsort(stable=True)
        out = self.grouped(rows.index_select(0, by_expert), from_each.view(ep, local).sum(0).tolist())
        out = out.index_select(0, by_expert.argsort())
        y = _AllToAll.apply(out, sent, received, self.ep_group) * weights.reshape(-1, 1)[order]
        return torch.zeros_like(x).index_add_(0, token, y.to(x.dtype))


def route_over_tp(model: nn.Module, names: list[str], mesh: DeviceMesh) -> None:
    """Under tensor parallelism, for the sparse MLPs `names` whose tokens the TP plan split over the TP ranks
    (trnrecipes/parallel/tensor.py's token_split, torchtitan's "ETP 1"): their routing statistics are summed over the
    TP group after each forward, so the load-balancing loss and router health are the replica's, as at TP 1; their
    router and experts (plain tensors, whole on every TP rank) are marked for sum_over_tp."""
    for name in names:
        module = model.get_submodule(name)
        module.tp_group = mesh.get_group()
        module.register_forward_hook(_sum_routing_over_tp)


def tp_summed_params(model: nn.Module) -> list[nn.Parameter]:
    """The parameters route_over_tp marked: each TP rank's gradient holds its own tokens' share only."""
    return [p for m in model.modules() if getattr(m, "tp_group", None) is not None for p in m.parameters()]


@eager_under_compile
def _sum_routing_over_tp(module: nn.Module, _inputs: tuple, _output: torch.Tensor) -> None:
    if torch._C._current_graph_task_id() != -1:
        return  # activation checkpointing's recompute: the forward's routing stands (the forward did not set one)
    routing, group = module.routing, module.tp_group
    picks = routing.picks.clone()
    dist.all_reduce(picks, group=group)
    prob_sum = _SumOverGroup.apply(routing.prob_sum, group)
    tokens = routing.tokens * dist.get_world_size(group)  # each TP rank routed as many (the sequence splits evenly)
    module.routing = routing._replace(picks=picks, prob_sum=prob_sum, tokens=tokens)


class _SumOverGroup(torch.autograd.Function):
    """A sum over `group` whose gradient is the output's, unreduced: each TP rank's loss is the whole replica's, so
    the gradient of its own share of the sum is the sum's gradient (reducing it too would count it tp times)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group) -> torch.Tensor:
        out = t.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None
