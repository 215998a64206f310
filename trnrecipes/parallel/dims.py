"""Where a rank sits in a training run: world = pp x dp x cp x tp, TP fastest, then CP, DP, PP (as NxD and torchtitan
lay ranks out: a TP group is consecutive ranks inside a node; trnrecipes.plan.layout.rank_coords says why), the
process groups each dim needs, and the few collectives the step loop uses beyond the model's own (gradient averaging
over DP and CP, ZeRO-1's parameter gather, metric reductions that count each value once, agreeing on decisions)."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Protocol

import torch
import torch.distributed as dist

from trnrecipes.config.recipe import check_recipe
from trnrecipes.config.sections import Recipe, RecipeError
from trnrecipes.parallel.collectives import all_gather_into
from trnrecipes.parallel.sharding import chunk_range
from trnrecipes.plan.layout import compute_layout, rank_coords


class Backend(Protocol):
    """What ParallelDims asks of a backend (trnrecipes.backends' classes are such; this package sits below them)."""

    name: str
    supports_pp: bool
    no_pp_reason: str
    supports_zero1: bool
    supports_cp: bool
    collectives_on_device: bool

    def init_process_groups(self, dims: ParallelDims) -> None: ...


class ParallelDims:
    """This rank's place in the [pp, dp, cp, tp] layout and the groups over each dim. Single process: no process group.

    Metric reductions are written for pipeline stages: a value (the loss) may be held by some ranks only, and is
    averaged over the ranks that hold it, never divided by the world size."""

    def __init__(self, recipe: Recipe, backend: Backend):
        layout = compute_layout(recipe)
        if layout.pp > 1 and not backend.supports_pp:
            raise RecipeError(
                f"layout.pp {layout.pp}: backend {backend.name} has no pipeline parallelism ({backend.no_pp_reason});"
                f" pipeline parallelism runs on cpu, cuda and neuron. Train with layout.pp=1"
                f"{_wider_tp_hint(recipe, layout.tp * layout.pp)}"
            )
        if layout.cp > 1 and not backend.supports_cp:
            raise RecipeError(
                f"layout.cp {layout.cp}: backend {backend.name} has no context parallelism (its all-gather of keys and"
                " values runs on torch.distributed: cpu, cuda and TorchNeuron); use layout.cp 1"
            )
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        if self.world != layout.world_size:
            cp = f" x CP {layout.cp}" if layout.cp > 1 else ""
            raise RecipeError(
                f"launched with {self.world} rank(s), but recipe {recipe.name} at {layout.nodes} node(s) needs"
                f" {layout.world_size} (PP {layout.pp} x DP {layout.dp}{cp} x TP {layout.tp}); use its run.sbatch"
            )
        self.pp, self.dp, self.cp, self.tp = layout.pp, layout.dp, layout.cp, layout.tp
        self.pp_rank, self.dp_rank, self.cp_rank, self.tp_rank = rank_coords(
            self.rank, pp=self.pp, dp=self.dp, cp=self.cp, tp=self.tp
        )
        # ZeRO-1 (optimizer states sharded over the shard group) where the backend can (cpu, cuda; neuron through
        # NxD's zero-1 optimizer); elsewhere (xla) the states stay replicated and the trainer says so.
        wanted = recipe.layout.zero1 and self.shard_n > 1
        self.zero1 = wanted and backend.supports_zero1
        self.zero1_unavailable = wanted and not self.zero1
        # FSDP2: parameters, gradients and moments sharded over the shard group (trnrecipes/parallel/fsdp.py), along
        # the same dim-0 rows of each TP-local tensor as ZeRO-1's moments (trnrecipes.parallel.sharding).
        self.fsdp = recipe.layout.fsdp and self.shard_n > 1
        # Expert parallelism: groups of ep consecutive DP ranks share out the experts (trnrecipes/parallel/expert.py).
        self.ep, self.ep_rank = recipe.layout.ep, self.dp_rank % recipe.layout.ep
        self.ep_group = self.expert_replica_group = self.expert_fsdp_mesh = None
        self.mesh = self.dp_group = self.pp_group = None
        # Context parallelism: the cp ranks sharing a replica's sequences (trnrecipes/parallel/context.py), and the
        # dp x cp ranks whose gradients are averaged (each holds its part of the sequences' loss; the dp group at CP 1).
        self.cp_group = self.dp_cp_group = None
        self.shard_group = None  # the ranks ZeRO-1 and FSDP shard over (shard_n): dp_cp_group, the DP group at CP 1
        self.kv_group = None  # TP wider than the KV heads: the ranks sharing this rank's KV head (kv_replication.py)
        self.collectives_on_device = backend.collectives_on_device
        backend.init_process_groups(self)

    @property
    def shard_n(self) -> int:
        """How many ranks ZeRO-1 and FSDP split the states over: the dp x cp ranks of this TP rank and stage
        (torchtitan's dp_shard_cp: a replica's CP ranks hold the same weights, so they share out their states too).
        DP at CP 1."""
        return self.dp * self.cp

    @property
    def shard_rank(self) -> int:
        """This rank's index among them: dp_rank x cp + cp_rank, its rank in shard_group (dp_rank at CP 1). A property:
        a backend may take dp_rank from its own library after __init__ (NxD)."""
        return self.dp_rank * self.cp + self.cp_rank

    @property
    def holds_loss(self) -> bool:
        """Whether this rank computes the loss: every rank without PP, the last stage's ranks with it."""
        return self.pp_rank == self.pp - 1

    def sum_over_pp(self, t: torch.Tensor) -> None:
        """In place: the sum over the pipeline stages of this replica (a value each stage holds part of)."""
        if self.pp > 1:
            dist.all_reduce(t, group=self.pp_group)

    def average_over_dp(self, tensors: list[torch.Tensor]) -> None:
        """In place: the mean over the data-parallel replicas and, under context parallelism, over the CP ranks of
        each (never over TP ranks, which hold different shards). A CP rank's gradient is that of its tokens' share of
        the loss (trnrecipes/parallel/context.py weighs it so): the mean over the dp x cp ranks is DP's mean of the
        whole sequences' loss. Bucketed: the flat copy that one all-reduce needs is at most BUCKET_ELEMENTS, not the
        whole model's grads."""
        if self.dp * self.cp > 1:
            self._mean_over(tensors, self.dp_cp_group, self.dp * self.cp)

    def sum_over_tp(self, tensors: list[torch.Tensor]) -> None:
        """In place: each tensor summed over this rank's TP group (a TP-replicated parameter whose gradient each TP
        rank computed on its own tokens: a mixture of experts' router and experts, trnrecipes/parallel/expert.py)."""
        if self.tp > 1:
            self._mean_over(tensors, self.mesh["tp"].get_group(), 1)

    def average_experts_over_dp(self, tensors: list[torch.Tensor]) -> None:
        """In place, under expert parallelism: the DP mean of sharded experts' gradients, as EP 1 has it. A rank's
        expert gradient holds the picks of its whole EP group already; summed over the dp / ep ranks that hold the
        same experts (expert_replica_group) it holds every DP rank's, and is divided by dp as the rest."""
        self._mean_over(tensors, self.expert_replica_group if self.dp > self.ep else None, self.dp)

    def _mean_over(self, tensors: list[torch.Tensor], group, ranks: int) -> None:
        """In place: each tensor summed over `group` (None: this rank alone) and divided by `ranks` (1: the sum)."""
        for bucket in _buckets(tensors, BUCKET_ELEMENTS):
            flat = torch.cat([t.reshape(-1) for t in bucket]) if len(bucket) > 1 else bucket[0].reshape(-1).clone()
            if group is not None:
                dist.all_reduce(flat, group=group)
            if ranks > 1:
                flat /= ranks
            offset = 0
            for t in bucket:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    @property
    def shards_moments(self) -> bool:
        """Whether each rank of the shard group holds the moments of its rows only (ZeRO-1 or FSDP)."""
        return self.zero1 or self.fsdp

    def zero1_rows(self, local_rows: int) -> tuple[int, int]:
        """ZeRO-1: the dim-0 rows of a TP-local tensor whose optimizer state this rank of the shard group holds and
        updates."""
        if not self.zero1:
            return 0, local_rows
        return chunk_range(local_rows, self.shard_n, self.shard_rank)

    def gather_zero1(self, locals_: list[torch.Tensor], rows: list[tuple[int, int]]) -> None:
        """After a ZeRO-1 step each shard rank has updated only its rows: give every rank all of them, in place, by
        all-gathers: half the traffic of the all-reduce of -0.0-filled copies this used to be, and the values are
        the owners' bitwise. A tensor whose rows split evenly and of which each rank sends at least
        GATHER_ALONE_ELEMENTS is gathered straight into itself, with no copy but of this rank's rows; the rest
        (norms, biases, uneven splits, small shards at a large DP) go in buckets of up to BUCKET_ELEMENTS per device
        and dtype, each rank's rows padded to torch.chunk's row count (chunk_range), so that small tensors do not
        cost a collective each. The gathered slots come in shard-group rank order, which
        TorchBackend.init_process_groups checked is shard_rank's."""
        if not self.zero1:
            return
        small: dict[tuple[torch.device, torch.dtype], list[tuple[torch.Tensor, tuple[int, int]]]] = {}
        with torch.no_grad():
            for t, span in zip(locals_, rows, strict=True):
                into_itself = t.shape[0] % self.shard_n == 0 and t.is_contiguous()
                if into_itself and t.numel() // self.shard_n >= GATHER_ALONE_ELEMENTS:
                    all_gather_into(t.view(-1), t[span[0] : span[1]].reshape(-1).clone(), self.shard_group)
                else:
                    small.setdefault((t.device, t.dtype), []).append((t, span))
            for items in small.values():
                for bucket in _buckets(items, BUCKET_ELEMENTS, size=lambda item: item[0].numel()):
                    self._all_gather_rows(bucket)

    def _all_gather_rows(self, bucket: list[tuple[torch.Tensor, tuple[int, int]]]) -> None:
        """One all-gather of every shard rank's rows of these same-dtype tensors (see gather_zero1), then one or two
        copies per tensor (not one per tensor and rank: at DP 64 that would be 64 small copies a parameter)."""
        # Per tensor: the rows each rank sends, padded to ceil(n / shard_n) (torch.chunk's split), `width` elements.
        parts = self.shard_n
        shapes = [(t.shape[0], -(-t.shape[0] // parts), t.numel() // max(t.shape[0], 1)) for t, _ in bucket]
        slots = [chunk * width for _, chunk, width in shapes]
        first = bucket[0][0]
        mine = torch.empty(sum(slots), dtype=first.dtype, device=first.device)  # the padding is never read
        offset = 0
        for (t, (start, stop)), slot in zip(bucket, slots, strict=True):
            own = t[start:stop].reshape(-1)
            mine[offset : offset + own.numel()].copy_(own)
            offset += slot
        gathered = torch.empty(parts * mine.numel(), dtype=mine.dtype, device=mine.device)
        all_gather_into(gathered, mine, self.shard_group)
        per_rank = gathered.view(parts, -1)
        offset = 0
        for (t, _), (n, chunk, width), slot in zip(bucket, shapes, slots, strict=True):
            if t.numel():
                # chunk_range gives the first `full` ranks `chunk` rows each and the next one the `rest`.
                full, rest = divmod(n, chunk)
                as_rows = (
                    t.view(n, width) if t.is_contiguous() else torch.empty(n, width, dtype=t.dtype, device=t.device)
                )
                as_rows[: full * chunk].view(full, slot).copy_(per_rank[:full, offset : offset + slot])
                if rest:
                    as_rows[full * chunk :].view(-1).copy_(per_rank[full, offset : offset + rest * width])
                if not t.is_contiguous():
                    t.copy_(as_rows.view(t.shape))
            offset += slot

    def mean_over_holders(self, value: torch.Tensor, device: torch.device) -> float:
        """The mean of a scalar over the ranks that hold it (holds_loss): with PP only the last stage computes the
        loss. Every TP rank of a replica holds the same value, which cancels in the ratio (never divide by world)."""
        v = value.detach().float().reshape(())
        held = torch.ones_like(v) if self.holds_loss else torch.zeros_like(v)
        mine = v if self.holds_loss else torch.zeros_like(v)  # not v * 0: a NaN elsewhere must not count here
        total = self.sum_over_ranks(torch.stack([mine, held]), device)
        return float(total[0] / total[1])

    def max_over_ranks(self, values: list[int], device: torch.device) -> list[int]:
        """Element-wise max over all ranks: how ranks agree on a decision only some of them can see."""
        t = self._all_reduce(torch.tensor(values, dtype=torch.int64), device, dist.ReduceOp.MAX)
        return [int(v) for v in t.tolist()]

    def sum_over_ranks(self, values: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Element-wise sum over all ranks of a small tensor (metrics; on the host or `device`), returned on the CPU."""
        return self._all_reduce(values, device, dist.ReduceOp.SUM)

    def _all_reduce(self, values: torch.Tensor, device: torch.device, op) -> torch.Tensor:
        if self.world == 1:
            return values.cpu()
        # A copy either way: all_reduce works in place and must not change the caller's tensor.
        t = values.to(device, copy=True) if self.collectives_on_device else values.to("cpu", copy=True)
        dist.all_reduce(t, op=op)
        return t.cpu()

    def close(self) -> None:
        if self.world > 1 and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


BUCKET_ELEMENTS = 1 << 24  # 64 MB of fp32 per gradient all-reduce
GATHER_ALONE_ELEMENTS = 1 << 18  # ZeRO-1: a tensor of which each rank sends this many is all-gathered on its own


def _buckets(items: list, limit: int, size=lambda t: t.numel()) -> list[list]:
    """Consecutive groups of at most `limit` elements by `size` (a larger item is a group of its own)."""
    groups: list[list] = []
    total = limit
    for item in items:
        n = size(item)
        if total + n > limit:
            groups.append([])
            total = 0
        groups[-1].append(item)
        total += n
    return groups


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _wider_tp_hint(recipe: Recipe, tp: int) -> str:
    """', e.g. layout.tp=N ...' when TP = old tp x pp is a valid layout (the same model memory per core), else why
    there is no such suggestion: suggesting an invalid layout would only move the error."""
    trial = replace(recipe, layout=replace(recipe.layout, tp=tp, pp=1))
    try:
        compute_layout(trial)
        valid = not check_recipe(trial)
    except RecipeError:
        valid = False
    if valid:
        return f", e.g. layout.tp={tp}, which keeps the model's memory per core"
    return (
        f"; layout.tp={tp} would keep the model's memory per core but is not a valid layout here, and a smaller"
        " tp holds more of the model on each core (`trnrecipes plan` checks a layout's divisibility, not memory)"
    )
