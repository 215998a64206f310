"""Pipeline stages as layout math: which layers each stage holds, which rank runs which stage, what a schedule
needs and what it costs. Torch-free: `plan` and `sbatch` use this; trnrecipes.parallel.pipeline builds the stages from
it.

A model of L layers runs as S = pp x v stages (v: virtual stages per rank, interleaved 1F1B). Stage s holds
layers [first_s, first_s + n_s), the embedding too if s = 0, the final norm and the head if s = S - 1. Layers are
split evenly with the remainder on the later stages (as neuronx-distributed's partitioner does: the first stage
also holds the embedding, the last the head, so the extra layers go away from the ends), unless the recipe lists
the layers of each stage (layout.pp_stage_layers). Stage s runs on pipeline rank s % pp (looping placement: rank p
holds stages p, p + pp, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from trnrecipes.config.stacks import sdk_version

if TYPE_CHECKING:
    from trnrecipes.config.families import ModelSection

SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b")
BUBBLE_WARNING = 0.10  # plan warns when the pipeline idles more than this fraction of ideal step time


@dataclass(frozen=True)
class Stage:
    index: int  # 0 .. S-1, in model order
    rank: int  # the pipeline rank that runs it
    layers: range  # original layer indices (parameter names keep them: layers.<i>.)
    first: bool  # holds the embedding
    last: bool  # holds the final norm and the head (and computes the loss)


def layer_counts(num_layers: int, num_stages: int, explicit: tuple[int, ...] | None = None) -> list[int]:
    """Layers per stage: `explicit` when given, else even with the remainder on the later stages (split_problem
    has checked either)."""
    if explicit is not None:
        return list(explicit)
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if s >= num_stages - extra else 0) for s in range(num_stages)]


def split_problem(
    num_layers: int, pp: int, virtual_stages: int, explicit: tuple[int, ...] | None, schedule: str
) -> str | None:
    """Why these layers cannot be split into pp x virtual_stages stages run by `schedule`, or None. An explicit
    per-stage layer list may leave the first and last stages without a layer (only the embedding, or only the norm
    and head); every other stage needs one."""
    count = pp * virtual_stages
    if virtual_stages > 1 and schedule != "interleaved_1f1b":
        return (
            f"layout.pp_virtual_stages {virtual_stages} needs layout.pp_schedule interleaved_1f1b (the schedule that"
            f" runs several stages per rank), not {schedule}"
        )
    if explicit is None:
        if num_layers < count:
            return (
                f"model.num_layers {num_layers} cannot fill layout.pp {pp} x layout.pp_virtual_stages"
                f" {virtual_stages} = {count} stages"
            )
        return None
    if len(explicit) != count:
        return (
            f"layout.pp_stage_layers lists {len(explicit)} stage(s), but layout.pp x layout.pp_virtual_stages = {count}"
        )
    if sum(explicit) != num_layers:
        return f"layout.pp_stage_layers {list(explicit)} sums to {sum(explicit)}, not model.num_layers {num_layers}"
    if any(n < 0 for n in explicit) or any(n < 1 for n in explicit[1:-1]):
        return f"layout.pp_stage_layers {list(explicit)}: every stage but the first and last needs at least 1 layer"
    return None


def split_stages(
    num_layers: int, pp: int, virtual_stages: int = 1, explicit: tuple[int, ...] | None = None, schedule: str = "1f1b"
) -> list[Stage]:
    """Every stage of the pipeline, in model order."""
    if problem := split_problem(num_layers, pp, virtual_stages, explicit, schedule):
        raise ValueError(problem)
    count = pp * virtual_stages
    stages, start = [], 0
    for s, n in enumerate(layer_counts(num_layers, count, explicit)):
        stages.append(Stage(s, s % pp, range(start, start + n), s == 0, s == count - 1))
        start += n
    return stages


def pipeline_stages(recipe) -> list[Stage]:
    """The stages of a recipe's model under its layout (a Recipe; not imported here, to keep this module plain)."""
    lay = recipe.layout
    return split_stages(recipe.model.num_layers, lay.pp, lay.pp_virtual_stages, lay.pp_stage_layers, lay.pp_schedule)


def rank_stages(stages: list[Stage], pp_rank: int) -> list[Stage]:
    """The stages pipeline rank `pp_rank` runs, in model order."""
    return [s for s in stages if s.rank == pp_rank]


def bubble_fraction(pp: int, virtual_stages: int, micro_batches: int) -> float:
    """Idle time of a 1F1B / GPipe pipeline as a fraction of its ideal (bubble-free) step time: (p-1)/(v*m)."""
    return (pp - 1) / (virtual_stages * micro_batches)


def schedule_problem(schedule: str, pp: int, virtual_stages: int, micro_batches: int) -> str | None:
    """Why `schedule` cannot run this pipeline, or None. micro_batches: per pipeline per step (the grad-accum
    steps)."""
    if pp == 1:
        return None
    if schedule != "gpipe" and micro_batches < pp:
        return (
            f"{schedule} needs at least as many micro-batches per step as pipeline stages: {micro_batches}"
            f" micro-batch(es) (global_batch / (micro_batch x DP)) < layout.pp {pp}; raise batch.global_batch,"
            " lower batch.micro_batch or the node count, or use layout.pp_schedule gpipe"
        )
    if schedule == "interleaved_1f1b":
        rounds = max(1, micro_batches // pp)
        if micro_batches % rounds:  # torch's ScheduleInterleaved1F1B runs the micro-batches in whole rounds
            return (
                f"interleaved_1f1b runs micro-batches in rounds of layout.pp {pp}: {micro_batches} micro-batches do"
                f" not split into {rounds} equal rounds; use a multiple of {pp}"
            )
    return None


PIPELINE_SDK = (2, 22)  # first Neuron SDK whose NxDPPModel has manual_pp_partition


def neuron_pipeline_problem(neuron_sdk: str, schedule: str, virtual_stages: int) -> str | None:
    """Why NxD's manual pipeline cannot run this layout (layout.pp > 1 on backend neuron), or None."""
    try:
        too_old = sdk_version(neuron_sdk) < PIPELINE_SDK
    except ValueError:
        too_old = True
    if too_old:
        return (
            f"layout.pp > 1 on backend neuron runs through neuronx-distributed's manual pipeline partition"
            f" (NxDPPModel(manual_pp_partition=True)), which needs Neuron SDK 2.{PIPELINE_SDK[1]} or newer;"
            f" cluster.neuron_sdk is {neuron_sdk!r}. Use cluster.neuron_sdk=2.{PIPELINE_SDK[1]} or later (and that"
            " SDK on the cluster), or layout.pp=1"
        )
    if virtual_stages > 1:
        return (
            f"layout.pp_virtual_stages {virtual_stages}: neuronx-distributed's manual pipeline partition runs one stage"
            " per pipeline rank; use layout.pp_virtual_stages=1 and layout.pp_schedule=1f1b on backend neuron"
        )
    if schedule != "1f1b":
        return (
            f"layout.pp_schedule {schedule!r}: neuronx-distributed's manual pipeline partition trains with its 1F1B"
            " schedule only (no GPipe, no interleaving); use layout.pp_schedule=1f1b on backend neuron"
        )
    return None


def stage_params(m: ModelSection, stage: Stage) -> int:
    """Parameters a pipeline stage holds, unsharded: its layers, plus the embedding on the first stage and the final
    norm and head on the last (recipes/<family>/spec.py)."""
    return (
        sum(m.layer_params_at(i) for i in stage.layers)
        + (m.embedding_params() if stage.first else 0)
        + (m.norm_head_params() if stage.last else 0)
    )
