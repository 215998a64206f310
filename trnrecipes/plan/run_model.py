"""The whole run's time and cost, and what checkpoints and failures take from it (`plan`, torch-free).

At the step time a throughput gives (--seq-per-s, else the recipe's cluster.tokens_per_s_per_node), train.max_steps
takes max_steps x step time without failures. Failures: a node fails on average every cluster.node_mtbf_hours
(default ~270 days: "The Llama 3 Herd of Models", section 3.3.4: 419 unexpected interruptions in 54 days on 2,048
nodes), so the job every node_mtbf / nodes. Each failure costs the restart (slurm.restart_minutes: requeue, start-up,
loading the checkpoint, cached compile) and on average half a checkpoint interval of lost steps; each checkpoint
stalls the step for its copy to host memory (async saves: the write overlaps training) or for the whole write.
First order (Young 1974; Daly 2006):

    utilisation U = 1 - stall / interval - (restart + interval / 2) / job MTBF,   best interval ~ sqrt(2 stall MTBF)

The 128-node Llama 2 post reports 98.81% effective utilisation with automatic recovery and 77.83% with manual
recovery; the manual line below assumes someone notices and restarts the job MANUAL_RESPONSE_H after a failure.
"""

from __future__ import annotations

import math

from trnrecipes.config.preemption import checkpoint_bytes
from trnrecipes.config.sections import Recipe

HOST_COPY_GBPS = 10.0  # GB/s per node for the device -> host copy an async save waits for (PCIe/DMA, conservative)
MANUAL_RESPONSE_H = 10.0  # hours from a failure to a manual restart (nights, weekends, node replacement by hand)


def utilisation(stall_s: float, restart_s: float, interval_s: float, mtbf_s: float) -> float:
    """The share of wall time that is training: less the save stalls and, per failure, the restart and half an
    interval of lost steps (first order in interval / MTBF)."""
    return max(0.0, 1 - stall_s / interval_s - (restart_s + interval_s / 2) / mtbf_s)


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
    stall_s = busiest / (HOST_COPY_GBPS * 1e9) if r.checkpoint.async_save else write_s
    interval_s = r.checkpoint.every_steps * step_s
    if r.checkpoint.every_minutes:
        interval_s = min(interval_s, r.checkpoint.every_minutes * 60)
    if r.checkpoint.async_save and write_s > interval_s:  # the next save waits for the last write to finish
        stall_s += write_s - interval_s
    mtbf_s = r.cluster.node_mtbf_hours * 3600 / nodes
    restart_s = r.slurm.restart_minutes * 60

    best_s = max(math.sqrt(2 * stall_s * mtbf_s), write_s if r.checkpoint.async_save else 0.0)
    auto = utilisation(stall_s, restart_s, interval_s, mtbf_s)
    expected_s = ideal_s / auto if auto > 0 else None  # None: failures outpace progress
    out: dict[str, object] = {
        "run_hours": ideal_s / 3600,
        "run_cost": cluster_price_per_hour * ideal_s / 3600 if cluster_price_per_hour is not None else None,
        "checkpoint_gb": size / 1e9,
        "checkpoint_write_s": write_s,
        "checkpoint_stall_s": stall_s,
        "checkpoint_interval_s": interval_s,
        "checkpoint_best_interval_s": best_s,
        "checkpoint_best_every_steps": max(1, round(best_s / step_s)),
        "job_mtbf_hours": mtbf_s / 3600,
        "expected_failures": (expected_s or ideal_s) / mtbf_s,
        "lost_per_failure_s": restart_s + interval_s / 2,
        "utilisation": auto,
        "utilisation_at_best_interval": utilisation(stall_s, restart_s, max(best_s, step_s), mtbf_s),
        "utilisation_manual": utilisation(stall_s, restart_s + MANUAL_RESPONSE_H * 3600, interval_s, mtbf_s),
        "expected_run_hours": expected_s / 3600 if expected_s is not None else None,
        "expected_run_cost": (
            cluster_price_per_hour * expected_s / 3600
            if cluster_price_per_hour is not None and expected_s is not None
            else None
        ),
    }
    return out


def hours(h: float | None) -> str:
    """2.5 h, 3.1 days: the unit a person plans in."""
    if h is None:
        return "never (failures outpace progress)"
    return f"{h:,.1f} h" if h < 48 else f"{h / 24:,.1f} days"


def run_model_rows(p: dict[str, object], r: Recipe) -> list[tuple[str, str]]:
    """The plan's (key, text) rows on the run's total, checkpoints and failures."""
    if "run_hours" not in p:
        return [("run", "time and cost need a throughput: --seq-per-s, or cluster.tokens_per_s_per_node in the recipe")]
    cost = f", ${p['run_cost']:,.0f}" if p["run_cost"] is not None else ""
    expected_cost = f", ${p['expected_run_cost']:,.0f}" if p["expected_run_cost"] is not None else ""
    every = r.checkpoint.every_steps
    interval = f"every {every:,} steps" + (
        f" or {r.checkpoint.every_minutes:g} min" if r.checkpoint.every_minutes else ""
    )
    restarts = ""
    if p["expected_failures"] > r.slurm.max_restarts and r.slurm.hyperpod is not True:
        restarts = (f"; ~{p['expected_failures']:,.1f} failures expected but run.sbatch requeues at most"
                    f" slurm.max_restarts {r.slurm.max_restarts} times a job: raise it")  # fmt: skip
    recovering = "HyperPod's auto-resume" if r.slurm.hyperpod else "run.sbatch requeues"
    rows = [
        ("run", f"{r.train.max_steps:,} steps = {hours(p['run_hours'])}{cost} without failures; expected"
         f" {hours(p['expected_run_hours'])}{expected_cost} with them ({p['utilisation']:.2%} utilisation)"),
        ("saves", f"{p['checkpoint_gb']:,.1f} GB {interval} ({p['checkpoint_interval_s'] / 60:,.1f} min),"
         f" {p['checkpoint_write_s']:,.0f} s to write at {r.slurm.checkpoint_write_gbps:g} GB/s"
         f" (slurm.checkpoint_write_gbps); the step stalls {p['checkpoint_stall_s']:,.2f} s a save"
         f" ({'async: the copy to host memory' if r.checkpoint.async_save else 'the whole write'})"),
        ("failures", f"a node every {r.cluster.node_mtbf_hours:,.0f} h (cluster.node_mtbf_hours), the job every"
         f" {hours(p['job_mtbf_hours'])}: ~{p['expected_failures']:,.1f} over the run, each costing"
         f" {r.slurm.restart_minutes:g} min to restart (slurm.restart_minutes) + half an interval of steps"),
        ("best save", f"every ~{p['checkpoint_best_every_steps']:,} steps (Young/Daly: sqrt(2 x stall x job MTBF),"
         f" at least one write) -> {p['utilisation_at_best_interval']:.2%}; checkpoint.every_steps is {every:,}"),
        ("recovery", f"automatic ({recovering}) {p['utilisation']:.2%}, manual ({MANUAL_RESPONSE_H:g} h to notice"
         f" and restart) {p['utilisation_manual']:.2%}; the 128-node Llama 2 post: 98.81% vs 77.83%{restarts}"),
    ]  # fmt: skip
    return rows
