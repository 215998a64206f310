"""The whole run's time and cost, and what checkpoints and failures take from it (`plan`, torch-free).

At the step time a throughput gives (--seq-per-s, else the recipe's cluster.tokens_per_s_per_node), train.max_steps
takes max_steps x step time without failures. Failures: a node fails on average every cluster.node_mtbf_hours
(default ~270 days: "The Llama 3 Herd of Models", section 3.3.4: 419 unexpected interruptions in 54 days on 2,048
nodes), so the job every node_mtbf / nodes. Each failure costs the restart (slurm.restart_minutes: requeue, start-up,
loading the checkpoint, cached compile) and on average half a checkpoint interval of lost steps; each checkpoint
stalls the step for its copy to host memory (async saves: the write overlaps training) or for the whole write.
First order (Young 1974; Daly 2006):

    U = interval / (interval + stall) x (1 - (restart + interval / 2) / job MTBF),   best interval ~ sqrt(2 stall MTBF)

The interval is the training between two saves: at least a step, at most the run (a shorter run saves at its end
only). The run never ends only where the second factor is <= 0. The 128-node Llama 2 post reports 98.81% effective
utilisation with automatic recovery and 77.83% with manual recovery; the manual line below assumes someone notices
and restarts the job MANUAL_RESPONSE_H after a failure.
"""

from __future__ import annotations

import math

from trnrecipes.config.preemption import checkpoint_bytes
from trnrecipes.config.sections import Recipe

HOST_COPY_GBPS = 10.0  # GB/s per node for the device -> host copy an async save waits for (PCIe/DMA, conservative)
MANUAL_RESPONSE_H = 10.0  # hours from a failure to a manual restart (nights, weekends, node replacement by hand)


def saves_share(stall_s: float, interval_s: float) -> float:
    """The share of a save cycle that trains: `interval_s` of steps, then the step stalls `stall_s` for the save."""
    return interval_s / (interval_s + stall_s)


def failures_share(restart_s: float, interval_s: float, mtbf_s: float) -> float:
    """1 less what failures take: per failure (one a job MTBF) the restart and half an interval of lost steps.
    <= 0: failures outpace progress."""
    return 1 - (restart_s + interval_s / 2) / mtbf_s


def utilisation(stall_s: float, restart_s: float, interval_s: float, mtbf_s: float) -> float:
    """The share of wall time that is training (0: the run never ends)."""
    return saves_share(stall_s, interval_s) * max(0.0, failures_share(restart_s, interval_s, mtbf_s))


def run_model(r: Recipe, step_s: float, nodes: int, cluster_price_per_hour: float | None) -> dict[str, object]:
    """Total time, cost, checkpoint and failure figures for `r` at `step_s` seconds a step on `nodes` nodes."""
    steps = r.train.max_steps
    ideal_s = steps * step_s
    size = checkpoint_bytes(r)
    write_s = size / (r.slurm.checkpoint_write_gbps * 1e9)
    # Async: the step waits for the busiest node's copy to host memory; sync: for the whole write. The weights come
    # from DP rank 0 of each TP group and stage (the nodes of one model replica), the moments from every rank under
    # ZeRO-1 / FSDP (else from that replica too).
    weight_part = r.model.param_count() * (2 if r.precision.dtype == "bf16" else 4)
    replica_nodes = max(1, math.ceil(r.layout.tp * r.layout.pp / r.workers_per_node))
    moments_nodes = nodes if (r.layout.zero1 or r.layout.fsdp) else replica_nodes
    busiest = weight_part / replica_nodes + (size - weight_part) / moments_nodes
    asynchronous = r.checkpoint.async_save
    own_stall_s = busiest / (HOST_COPY_GBPS * 1e9) if asynchronous else write_s

    def stall_at(interval_s: float) -> float:
        """Async: the next save also waits for the rest of the last write where the write outlasts the interval."""
        return own_stall_s + (max(0.0, write_s - interval_s) if asynchronous else 0.0)

    interval_s = r.checkpoint.every_steps * step_s
    if r.checkpoint.every_minutes:
        interval_s = min(interval_s, r.checkpoint.every_minutes * 60)
    interval_s = min(max(interval_s, step_s), ideal_s)  # saves come between steps; a shorter run saves at its end
    stall_s = stall_at(interval_s)
    mtbf_s = r.cluster.node_mtbf_hours * 3600 / nodes
    restart_s = r.slurm.restart_minutes * 60

    best_s = max(math.sqrt(2 * own_stall_s * mtbf_s), write_s if asynchronous else 0.0)
    best_s = min(max(best_s, step_s), ideal_s)
    best_every = max(1, round(best_s / step_s))
    after_saves = saves_share(stall_s, interval_s)
    after_failures = failures_share(restart_s, interval_s, mtbf_s)
    # None: failures outpace progress. ideal / (saves x failures) without the product, which can be tiny.
    expected_s = ideal_s * (interval_s + stall_s) / interval_s / after_failures if after_failures > 0 else None
    waits_for_write = asynchronous and write_s > interval_s
    cause = "the whole write" if not asynchronous else "async: the copy to host memory"
    cause += ", then the rest of the last write" if waits_for_write else ""
    warning = None
    if stall_s > interval_s:  # name what to change
        minutes = f" / checkpoint.every_minutes {r.checkpoint.every_minutes:g}" if r.checkpoint.every_minutes else ""
        warning = (
            f"saves take {1 - after_saves:.2%} of the time: the step stalls {duration(stall_s)} a save ({cause})"
            f" after {duration(interval_s)} of training; save less often (checkpoint.every_steps"
            f" {r.checkpoint.every_steps:,}{minutes}; best ~{best_every:,})"
            + ("" if asynchronous else ", asynchronously (checkpoint.async_save true)")
            + (f" or write faster (slurm.checkpoint_write_gbps {r.slurm.checkpoint_write_gbps:g})"
               if not asynchronous or waits_for_write else "")
        )  # fmt: skip
    out: dict[str, object] = {
        "run_hours": ideal_s / 3600,
        "run_cost": cluster_price_per_hour * ideal_s / 3600 if cluster_price_per_hour is not None else None,
        "checkpoint_gb": size / 1e9,
        "checkpoint_write_s": write_s,
        "checkpoint_stall_s": stall_s,
        "checkpoint_stall_cause": cause,
        "checkpoint_interval_s": interval_s,
        "checkpoint_best_interval_s": best_s,
        "checkpoint_best_every_steps": best_every,
        "checkpoint_warning": warning,  # None unless saves stall the steps longer than the steps between them run
        "job_mtbf_hours": mtbf_s / 3600,
        "expected_failures": expected_s / mtbf_s if expected_s is not None else None,
        "lost_per_failure_s": restart_s + interval_s / 2,
        "utilisation": utilisation(stall_s, restart_s, interval_s, mtbf_s),
        "utilisation_after_saves": after_saves,  # the two factors of utilisation
        "utilisation_after_failures": max(0.0, after_failures),
        "utilisation_at_best_interval": utilisation(stall_at(best_s), restart_s, best_s, mtbf_s),
        "utilisation_manual": utilisation(stall_s, restart_s + MANUAL_RESPONSE_H * 3600, interval_s, mtbf_s),
        "expected_run_hours": expected_s / 3600 if expected_s is not None else None,
        "expected_run_cost": (
            cluster_price_per_hour * expected_s / 3600
            if cluster_price_per_hour is not None and expected_s is not None
            else None
        ),
    }
    return out


def figure(x: float, decimals: int = 0) -> str:
    """1,234.5 where a person reads digits; 1.23e+18 or 4.56e-07 outside that, never a line of digits or a bare 0."""
    if x != 0 and not 10**-decimals <= abs(x) < 1e15:
        return f"{x:.3g}"
    return f"{x:,.{decimals}f}"


def duration(s: float) -> str:
    """67.4 s, 21.1 min, 2.5 h, 3.1 days, 1.2e+06 years: the unit a person plans in."""
    if s < 120:
        return f"{s:.3g} s"
    if s < 3600:
        return f"{s / 60:.1f} min"
    if s < 48 * 3600:
        return f"{s / 3600:.1f} h"
    if s < 1e4 * 86400:
        return f"{s / 86400:,.1f} days"
    return f"{figure(s / (365.25 * 86400))} years"


def hours(h: float | None) -> str:
    """A duration given in hours; None: the run never ends."""
    return "never (failures outpace progress)" if h is None else duration(h * 3600)


def run_model_rows(p: dict[str, object], r: Recipe) -> list[tuple[str, str]]:
    """The plan's (key, text) rows on the run's total, checkpoints and failures."""
    if "run_hours" not in p:
        return [("run", "time and cost need a throughput: --seq-per-s, or cluster.tokens_per_s_per_node in the recipe")]
    cost = f", ${figure(p['run_cost'])}" if p["run_cost"] is not None else ""
    expected_cost = f", ${figure(p['expected_run_cost'])}" if p["expected_run_cost"] is not None else ""
    every = r.checkpoint.every_steps
    interval = f"every {every:,} steps" + (
        f" or {r.checkpoint.every_minutes:g} min" if r.checkpoint.every_minutes else ""
    )
    failures = p["expected_failures"]
    restarts = ""
    if failures is not None and failures > r.slurm.max_restarts and r.slurm.hyperpod is not True:
        restarts = (f"; ~{figure(failures, 1)} failures expected but run.sbatch requeues at most"
                    f" slurm.max_restarts {r.slurm.max_restarts} times a job: raise it")  # fmt: skip
    recovering = "HyperPod's auto-resume" if r.slurm.hyperpod else "run.sbatch requeues"
    over_run = "failures outpace progress" if failures is None else f"~{figure(failures, 1)} over the run"
    rows = [
        ("run", f"{r.train.max_steps:,} steps = {hours(p['run_hours'])}{cost} without failures; expected"
         f" {hours(p['expected_run_hours'])}{expected_cost} with them ({p['utilisation']:.2%} utilisation ="
         f" {p['utilisation_after_saves']:.2%} between saves x {p['utilisation_after_failures']:.2%} after failures)"),
        ("saves", f"{p['checkpoint_gb']:,.1f} GB {interval} ({duration(p['checkpoint_interval_s'])}),"
         f" {duration(p['checkpoint_write_s'])} to write at {r.slurm.checkpoint_write_gbps:g} GB/s"
         f" (slurm.checkpoint_write_gbps); the step stalls {duration(p['checkpoint_stall_s'])} a save"
         f" ({p['checkpoint_stall_cause']})"),
        *([("warning", str(p["checkpoint_warning"]))] if p["checkpoint_warning"] else []),
        ("failures", f"a node every {figure(r.cluster.node_mtbf_hours)} h (cluster.node_mtbf_hours), the job every"
         f" {hours(p['job_mtbf_hours'])}: {over_run}, each costing"
         f" {r.slurm.restart_minutes:g} min to restart (slurm.restart_minutes) + half an interval of steps"),
        ("best save", f"every ~{p['checkpoint_best_every_steps']:,} steps (Young/Daly: sqrt(2 x stall x job MTBF),"
         f" at least one write, at most the run) -> {p['utilisation_at_best_interval']:.2%};"
         f" checkpoint.every_steps is {every:,}"),
        ("recovery", f"automatic ({recovering}) {p['utilisation']:.2%}, manual ({MANUAL_RESPONSE_H:g} h to notice"
         f" and restart) {p['utilisation_manual']:.2%}; the 128-node Llama 2 post: 98.81% vs 77.83%{restarts}"),
    ]  # fmt: skip
    return rows
