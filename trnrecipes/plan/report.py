"""Human-readable summaries of a plan (the `plan` and `sbatch` verbs): the layout, batch and cost, then the
pipeline's stages and bubble (PP > 1)."""

from __future__ import annotations

from trnrecipes.config.cluster import LOCAL_INSTANCES
from trnrecipes.config.sections import Recipe
from trnrecipes.plan.memory import MemoryPlan, format_memory
from trnrecipes.plan.published import published_rows
from trnrecipes.plan.run_model import figure, run_model_rows


def si(value: float, digits: int = 3) -> str:
    """1.23G, 45.6k: `digits` significant digits and a unit (plan, the step line, the data plan)."""
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.{digits}g}{unit}"
    return f"{value:.{digits}g}"


def format_plan(p: dict[str, object], recipe: Recipe | None = None) -> str:
    """The plan summary; with `recipe`, also the run's total time and cost, checkpoints and failures."""
    backend = p["backend"] if p["stack"] == p["backend"] else f"{p['backend']}: {p['stack']}"
    price = p["price_per_hour"]
    priced = f"${price:,.2f}/h for the job" if price is not None else "no price known (set cluster.price_per_hour)"
    rows = [
        ("recipe", f"{p['recipe']} on {p['nodes']} x {p['instance']} ({backend})"),
        ("workers", f"{p['nodes']} node(s) x {p['workers_per_node']} = {p['world_size']}"),
        (
            "parallelism",
            f"TP {p['tp']}{f' x CP {cp}' if (cp := p['cp']) > 1 else ''} x PP {p['pp']} x DP {p['dp']}"
            f"{f' (EP {ep})' if (ep := p.get('ep', 1)) > 1 else ''}",
        ),
        (
            "batch",
            f"micro-batch {p['micro_batch']} x grad-accum {p['grad_accum']} x DP {p['dp']}"
            f" = {p['global_batch']} sequences x {p['seq_len']} = {p['tokens_per_step']:,} tokens/step",
        ),
        ("parameters", f"{p['params']:,} ({si(p['params'])})" + _active(p)),
        (
            "FLOPs/token",
            f"{p['flops_per_token']:,} ({si(p['flops_per_token'])}; 6N + 12*L*H*Q*T"
            + ("; N active" if "active_params" in p else "")
            + ")",
        ),
        ("peak", f"{_peak(p)}; {priced}"),
    ]
    if "tokens_per_s" in p:
        tpd = p["tokens_per_dollar"]
        rows += [
            ("throughput", f"{p['seq_per_s']:,.4g} seq/s = {figure(p['tokens_per_s'])} tokens/s"
             f" ({figure(p['tokens_per_s_per_node'])}/node, from {p['throughput_from']});"
             f" {figure(p['step_time_s'], 2)} s/step"),
            *([("source", p["throughput_source"])] if p.get("throughput_source") else []),
            ("MFU", f"{p['mfu']:.1%}" + (" (over 100%: more than the instance's peak; check the throughput)"
                                         if p["mfu"] > 1 else "")),
            ("cost", "n/a (no price known)" if p["dollars_per_step"] is None else
             f"${figure(p['dollars_per_step'], 4 if p['dollars_per_step'] < 100 else 0)}/step; "
             + (f"{figure(tpd)} tokens/$" if tpd is not None else "tokens/$ n/a (price 0)")),
        ]  # fmt: skip
    if recipe is not None and p.get("throughput_from") == "cluster.tokens_per_s_per_node":
        rows += published_rows(recipe)
    if recipe is not None:
        rows += run_model_rows(p, recipe)
    width = max(len(k) for k, _ in rows)
    memory = format_memory(MemoryPlan(**{k: v for k, v in p["memory"].items() if k not in ("total", "verdict")}), width)
    return "\n".join([*(f"{k:<{width}}  {v}" for k, v in rows), *memory, *format_pipeline(p, width)])


def _active(p: dict[str, object]) -> str:
    """A mixture of experts: the parameters one token's forward reads (its top-k experts), after the total."""
    if "active_params" not in p:
        return ""
    return f"; {p['active_params']:,} ({si(p['active_params'])}) active per token"


def format_pipeline(p: dict[str, object], width: int) -> list[str]:
    """The pipeline lines of a plan (trnrecipes.plan.layout.pipeline_plan): none without PP. Keys in the plan summary's
    column, `width` wide."""
    if p["pp"] == 1:
        return []
    pp, v, m, tp = p["pp"], p["pp_virtual_stages"], p["pp_micro_batches"], p["tp"]
    stages = p["pp_stages"]
    rows = [
        ("pipeline", f"{p['pp_schedule']}, {len(stages)} stages on PP {pp} ({v} per rank), {m} micro-batches"
         " per pipeline per step (grad-accum)"),
        ("bubble", f"{p['pp_bubble_fraction']:.2%} of the ideal step time: (PP - 1) / (v x m) = {pp - 1}/({v} x {m})"),
    ]  # fmt: skip
    if p["pp_bubble_warning"]:
        rows.append(("warning", str(p["pp_bubble_warning"])))
    lines = [f"{key:<{width}}  {text}" for key, text in rows]
    row = f"{{:<{width}}}" + "  {:>5}  {:>4}  {:<13}  {:<12}  {:>14}  {:>14}"
    lines.append(row.format("stages", "stage", "rank", "layers", "holds", "params", f"per core ~/TP{tp}"))
    for s in stages:
        held = "none" if s["first_layer"] is None else f"{s['first_layer']}-{s['last_layer']} ({s['num_layers']})"
        holds = " + ".join(name for name, on in (("embedding", s["embedding"]), ("norm, head", s["norm_head"])) if on)
        lines.append(
            row.format(
                "", s["index"], s["pp_rank"], held, holds or "-", f"{s['params']:,}", f"{s['params_per_core_approx']:,}"
            )
        )
    return lines


def _peak(p: dict) -> str:
    """The peak MFU is counted against, in words: an accelerator's dense BF16 rate, or this host's nominal CPU
    figure (0.19 TFLOPS for 2 cores, shown as it is: rounded it read 0; MFU on a CPU is a rough guide, above 100%
    where the host is faster than the figure)."""
    if p["instance"] in LOCAL_INSTANCES:
        return f"{p['peak_tflops']:.2g} TFLOPS (a nominal figure for these CPU cores: MFU here is a rough guide)"
    return f"{p['peak_tflops']:,.0f} BF16 TFLOPS"
