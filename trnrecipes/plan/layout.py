"""Parallel layout, batch math and cost: the one place these numbers are computed (parameters and FLOPs: the
family's spec, recipes/<family>/spec.py).

world = nodes x workers/node; DP = world / (TP x CP x PP); grad-accum = GBS / (micro-batch x DP): the CP ranks of
a replica share its sequences. With PP > 1 the grad-accum micro-batches are the pipeline's micro-batches: which
layers each stage holds, its parameters and the bubble come from trnrecipes/config/stages.py.
No torch import: `plan` and `sbatch` use this.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import NamedTuple

from trnrecipes.config.cluster import Instance, get_instance
from trnrecipes.config.families import ModelSection
from trnrecipes.config.recipe import FIELD_BOUNDS, MAX_NODES
from trnrecipes.config.sections import Recipe, RecipeError
from trnrecipes.config.stages import (
    BUBBLE_WARNING,
    bubble_fraction,
    pipeline_stages,
    schedule_problem,
    stage_params,
)
from trnrecipes.plan.memory import memory_plan
from trnrecipes.plan.run_model import run_model


@dataclass(frozen=True)
class Layout:
    nodes: int
    workers_per_node: int
    world_size: int
    tp: int
    pp: int
    dp: int
    cp: int
    micro_batch: int
    grad_accum: int
    global_batch: int
    seq_len: int
    tokens_per_step: int

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def compute_layout(r: Recipe) -> Layout:
    nodes, wpn = r.cluster.nodes, r.workers_per_node
    tp, pp, cp, mb, gbs = r.layout.tp, r.layout.pp, r.layout.cp, r.batch.micro_batch, r.batch.global_batch
    world = nodes * wpn
    if wpn % tp:
        raise RecipeError(
            f"layout.tp {tp} must divide the {wpn} workers of one {r.cluster.instance} node"
            f" (tensor parallel groups stay inside a node); valid tp: {_divisors(wpn)}"
        )
    model_ranks = tp * pp * cp  # the ranks of one data-parallel replica
    if world % model_ranks:
        raise RecipeError(
            f"{nodes} node(s) x {wpn} workers = {world} workers is not divisible by {_replica(r)} = {model_ranks};"
            f" valid node counts: {_fmt(valid_node_counts(r))}"
        )
    dp = world // model_ranks
    if dp % r.layout.ep:
        raise RecipeError(
            f"layout.ep {r.layout.ep} must divide the data-parallel degree {dp} ({nodes} node(s) x {wpn} workers /"
            f" ({_replica(r)})): expert-parallel groups are carved from the data-parallel ranks; valid ep:"
            f" {_divisors(math.gcd(dp, getattr(r.model, 'num_experts', 0)))}"
        )
    local = getattr(r.model, "num_experts", 0) // r.layout.ep
    if r.layout.fsdp and r.layout.ep > 1 and local % (dp // r.layout.ep):
        raise RecipeError(
            f"layout.fsdp with layout.ep {r.layout.ep}: a rank's {local} experts do not split evenly over the"
            f" {dp // r.layout.ep} data-parallel ranks holding the same ones (DP {dp} / EP {r.layout.ep}), which"
            f" needs model.num_experts {local * r.layout.ep} divisible by DP {dp} whatever layout.ep is; use"
            " layout.fsdp=false layout.zero1=true, or fewer data-parallel ranks"
        )
    if gbs % (mb * dp):
        raise RecipeError(
            f"batch.global_batch {gbs} is not divisible by micro_batch {mb} x data-parallel {dp} = {mb * dp}"
            f" ({nodes} node(s) x {wpn} workers / ({_replica(r)}));"
            f" valid node counts for this batch: {_fmt(valid_node_counts(r))};"
            f" valid global batches near {gbs} at {nodes} node(s): {_fmt(_nearby_multiples(gbs, mb * dp))}"
        )
    accum = gbs // (mb * dp)
    if problem := schedule_problem(r.layout.pp_schedule, pp, r.layout.pp_virtual_stages, accum):
        raise RecipeError(f"{problem} (at {nodes} node(s): DP {dp}; valid node counts: {_fmt(valid_node_counts(r))})")
    return Layout(nodes, wpn, world, tp, pp, dp, cp, mb, accum, gbs, r.batch.seq_len, gbs * r.batch.seq_len)


def _replica(r: Recipe) -> str:
    """'tp 2 x pp 1' (and ' x cp 4' where the layout has context parallelism) for messages."""
    lay = r.layout
    return f"tp {lay.tp} x pp {lay.pp}" + (f" x cp {lay.cp}" if lay.cp > 1 else "")


class RankCoords(NamedTuple):
    pp_rank: int
    dp_rank: int
    cp_rank: int
    tp_rank: int


def rank_coords(rank: int, *, pp: int, dp: int, tp: int, cp: int = 1) -> RankCoords:
    """Where a global rank sits in the [pp, dp, cp, tp] layout. TP fastest, as NxD and torchtitan lay ranks out: a
    TP group is consecutive ranks inside a node, for its per-layer all-reduces. CP next, as torchtitan's mesh has it
    (dp, cp, tp): a CP group all-gathers keys and values once a layer, less often than TP reduces, so it takes the
    next-nearest ranks (inside a node where tp x cp fits one); DP, whose gradients are reduced once a step, outside
    it, and PP outermost."""
    world = pp * dp * cp * tp
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a world of {world} (pp {pp} x dp {dp} x cp {cp} x tp {tp})")
    return RankCoords(rank // (dp * cp * tp), rank // (cp * tp) % dp, rank // tp % cp, rank % tp)


def global_rank(*, pp_rank: int, dp_rank: int, tp_rank: int, dp: int, tp: int, cp_rank: int = 0, cp: int = 1) -> int:
    return ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank


def valid_node_counts(r: Recipe) -> list[int]:
    """Node counts compute_layout accepts: the world divides into TP x CP x PP, the batch into DP, and the pipeline
    schedule gets the micro-batches it needs. All of them: DP can be at most global_batch / micro_batch, which bounds
    the nodes (a list cut at 128 never told a user asking for 1,000 that 256 works)."""
    wpn, mb, gbs = r.workers_per_node, r.batch.micro_batch, r.batch.global_batch
    model_ranks = r.layout.tp * r.layout.pp * r.layout.cp
    found = []
    for n in range(1, min(max(gbs // mb, 1) * model_ranks // wpn, MAX_NODES) + 1):
        world = n * wpn
        if world % model_ranks or gbs % (mb * (world // model_ranks)) or (world // model_ranks) % r.layout.ep:
            continue
        accum = gbs // (mb * (world // model_ranks))
        if schedule_problem(r.layout.pp_schedule, r.layout.pp, r.layout.pp_virtual_stages, accum) is None:
            found.append(n)
    return found


def _nearby_multiples(value: int, step: int) -> list[int]:
    below = (value // step) * step
    return [m for m in (below, below + step) if m > 0]


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _fmt(values: list[int], most: int = 24) -> str:
    if not values:
        return "none"
    return ", ".join(map(str, values[:most])) + (f", ... ({len(values)} in all)" if len(values) > most else "")


def param_count(m: ModelSection) -> int:
    """Exact trainable parameters of the family's model (recipes/<family>/spec.py)."""
    return m.param_count()


def flops_per_token(m: ModelSection, seq_len: int) -> int:
    """Training FLOPs per token (recipes/<family>/spec.py; PaLM appendix B: 6N + 12 L H Q T)."""
    return m.flops_per_token(seq_len)


def pipeline_plan(r: Recipe, layout: Layout) -> dict[str, object]:
    """The pipeline part of `plan` (PP > 1): schedule, stages, bubble. The micro-batches per pipeline per step are
    the grad-accum steps. Per-core parameters divide a stage's by TP: approximate, since norms (and NeoX's
    row-parallel biases) are replicated over TP, not sharded."""
    lay = r.layout
    stages = pipeline_stages(r)
    bubble = bubble_fraction(lay.pp, lay.pp_virtual_stages, layout.grad_accum)
    warning = None
    if bubble > BUBBLE_WARNING:
        warning = (
            f"pipeline bubble {bubble:.2%} is over {BUBBLE_WARNING:.0%}: {layout.grad_accum} micro-batches per"
            f" pipeline for PP {lay.pp}; a larger batch.global_batch or fewer nodes (more micro-batches), a smaller"
            " layout.pp or more layout.pp_virtual_stages (interleaved_1f1b) shrink it"
        )
    rows = []
    for s in stages:
        params = stage_params(r.model, s)
        rows.append(
            {
                "index": s.index,
                "pp_rank": s.rank,
                "first_layer": s.layers[0] if s.layers else None,
                "last_layer": s.layers[-1] if s.layers else None,
                "num_layers": len(s.layers),
                "embedding": s.first,
                "norm_head": s.last,
                "params": params,
                "params_per_core_approx": params // layout.tp,  # / TP; replicated norms make it a little more
            }
        )
    return {
        "pp_schedule": lay.pp_schedule,
        "pp_virtual_stages": lay.pp_virtual_stages,
        "pp_micro_batches": layout.grad_accum,
        "pp_stages": rows,
        "pp_bubble_fraction": bubble,
        "pp_bubble_warning": warning,
    }


def layout_memory(r: Recipe):
    """The memory estimate of `r` as laid out, and what a changed recipe would need (for the refusal's hints)."""

    def dp_of(changed: Recipe) -> tuple[int, int] | None:
        try:
            lay = compute_layout(changed)
        except RecipeError:
            return None
        return lay.dp, lay.grad_accum

    layout = compute_layout(r)
    return memory_plan(r, layout.dp, layout.grad_accum), dp_of


def used_peak_tflops(inst: Instance, workers_per_node: int) -> float:
    """Dense bf16 peak of the devices one node's workers drive: a run with fewer workers than the instance has
    devices (cluster.workers_per_node: 1 of 8 GPUs) is measured against those, not the whole node; more workers
    than devices (oversubscribed CPU workers) add no peak."""
    return inst.peak_bf16_tflops * min(workers_per_node, inst.workers_per_node) / inst.workers_per_node


def estimated_throughput(r: Recipe, fpt: float, node_peak_tflops: float) -> tuple[float, str]:
    """(tokens/s per node, how it was estimated) for a recipe with nothing published for its instance: the MFU of
    the published run of cluster.estimate_from (the closest model's, on trn1) applied to this node's peak."""
    from trnrecipes.config.recipe import load_recipe

    source = load_recipe(r.cluster.estimate_from)
    published = source.cluster.tokens_per_s_per_node
    if published is None:
        raise RecipeError(
            f"cluster.estimate_from {r.cluster.estimate_from}: that recipe states no cluster.tokens_per_s_per_node to"
            " estimate from; name one that does"
        )
    src_peak = used_peak_tflops(get_instance(source.cluster.instance), source.workers_per_node)
    mfu = flops_per_token(source.model, source.batch.seq_len) * published / (src_peak * 1e12)
    how = (
        f"ESTIMATE, nothing published for {r.cluster.instance}: the MFU of {source.name}'s published run"
        f" ({mfu:.1%} of {source.cluster.instance}'s peak; {source.cluster.throughput_source}) applied to this"
        " instance's peak; measure it and set cluster.tokens_per_s_per_node"
    )
    return mfu * node_peak_tflops * 1e12 / fpt, how


def plan(r: Recipe, seq_per_s: float | None = None, price_per_hour: float | None = None) -> dict[str, object]:
    """Everything `trnrecipes plan` reports. price_per_hour is per node; default: the recipe's, else the catalog's."""
    layout = compute_layout(r)
    inst = get_instance(r.cluster.instance)
    price = r.price_per_hour if price_per_hour is None else price_per_hour
    fpt = flops_per_token(r.model, r.batch.seq_len)
    peak_tflops = used_peak_tflops(inst, layout.workers_per_node) * layout.nodes
    out: dict[str, object] = {
        "recipe": r.name,
        "instance": inst.name,
        "backend": r.cluster.backend,
        "stack": r.stack,  # xla-nxd / torchneuron on neuron (trnrecipes.config.stacks), else the backend
        **layout.to_dict(),
        "params": param_count(r.model),
        "flops_per_token": fpt,
        "peak_tflops": peak_tflops,
        "price_per_hour": price * layout.nodes if price is not None else None,  # None: no price known
    }
    active = getattr(r.model, "active_params", None)  # a mixture of experts: what one token's forward reads
    if active is not None and active() != out["params"]:
        out["active_params"] = active()  # FLOPs/token, and so MFU, count these
    if r.layout.ep > 1:  # expert parallelism: only where used, so other plans keep their keys
        out["ep"] = r.layout.ep
    if layout.pp > 1:
        out |= pipeline_plan(r, layout)
    out["memory"] = memory_plan(r, layout.dp, layout.grad_accum).to_dict()
    if seq_per_s is None and r.cluster.tokens_per_s_per_node is not None:
        seq_per_s = r.cluster.tokens_per_s_per_node * layout.nodes / r.batch.seq_len
        out["throughput_from"] = "cluster.tokens_per_s_per_node"
        out["throughput_source"] = r.cluster.throughput_source
    elif seq_per_s is not None:
        out["throughput_from"] = "--seq-per-s"
    elif r.cluster.estimate_from:
        tokens_per_s_node, how = estimated_throughput(r, fpt, peak_tflops / layout.nodes)
        seq_per_s = tokens_per_s_node * layout.nodes / r.batch.seq_len
        out["throughput_from"] = "an estimate"
        out["throughput_source"] = how
    if seq_per_s is not None:
        if out["throughput_from"] == "--seq-per-s":
            _check_seq_per_s(seq_per_s, layout)
        tokens_per_s = seq_per_s * r.batch.seq_len
        step_s = r.batch.global_batch / seq_per_s
        cluster_price = price * layout.nodes if price is not None else None
        out |= {
            "seq_per_s": seq_per_s,
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_node": tokens_per_s / layout.nodes,
            "step_time_s": step_s,
            "mfu": fpt * tokens_per_s / (peak_tflops * 1e12),
            "dollars_per_step": cluster_price * step_s / 3600 if cluster_price is not None else None,
            "tokens_per_dollar": tokens_per_s * 3600 / cluster_price if cluster_price else None,
        }
        out |= run_model(r, step_s, layout.nodes, cluster_price)
    overflowed = [key for key, value in out.items() if isinstance(value, float) and not math.isfinite(value)]
    if overflowed:  # the bounds keep each value sane; this names a combination of them that is not
        raise RecipeError(
            f"the plan's {', '.join(overflowed)} overflow a float at these values: give the throughput, price and"
            " checkpoint settings of a real cluster"
        )
    return out


def _check_seq_per_s(seq_per_s: float, layout: Layout) -> None:
    """--seq-per-s within the throughput per node a recipe may state (cluster.tokens_per_s_per_node's bound)."""
    bound = FIELD_BOUNDS["cluster.tokens_per_s_per_node"]
    per_node = seq_per_s * layout.seq_len / layout.nodes
    if not bound.holds(per_node):
        low, high = (edge * layout.nodes / layout.seq_len for edge in (bound.low, bound.high))
        raise RecipeError(
            f"--seq-per-s {seq_per_s:g}: valid from {low:.3g} to {high:.3g} sequences/s on {layout.nodes} node(s) at"
            f" batch.seq_len {layout.seq_len} (a throughput per node {bound} tokens/s)"
        )
