"""Pipeline stages as layout math (trnrecipes/config/stages.py): the layer split, stage placement, what a schedule needs
and the bubble. Torch-free and fast."""

from __future__ import annotations

import pytest

from trnrecipes.config.stages import (
    BUBBLE_WARNING,
    bubble_fraction,
    layer_counts,
    rank_stages,
    schedule_problem,
    split_problem,
    split_stages,
)


def counts(stages) -> list[int]:
    return [len(s.layers) for s in stages]


@pytest.mark.parametrize(
    ("layers", "pp", "expected"),
    [
        (44, 4, [11, 11, 11, 11]),  # NeoX-20B, PP4
        (80, 16, [5] * 16),  # Llama 2 70B, PP16
        (3, 2, [1, 2]),  # the remainder goes to the later stages, away from the embedding
        (10, 4, [2, 2, 3, 3]),
        (5, 5, [1] * 5),
    ],
)
def test_even_split_puts_the_remainder_on_the_later_stages(layers, pp, expected):
    stages = split_stages(layers, pp)
    assert counts(stages) == expected == layer_counts(layers, pp)
    assert [i for s in stages for i in s.layers] == list(range(layers))  # contiguous, in order, every layer once
    assert [s.first for s in stages] == [True] + [False] * (pp - 1)
    assert [s.last for s in stages] == [False] * (pp - 1) + [True]
    assert [s.rank for s in stages] == list(range(pp))


def test_explicit_layer_lists_are_used_as_given_and_may_leave_the_ends_without_layers():
    stages = split_stages(6, 3, explicit=(0, 4, 2))
    assert counts(stages) == [0, 4, 2]
    assert [(s.layers.start, s.layers.stop) for s in stages] == [(0, 0), (0, 4), (4, 6)]
    assert stages[0].first and not stages[0].layers  # only the embedding
    assert counts(split_stages(4, 2, explicit=(4, 0))) == [4, 0]  # the last stage: only the norm and head


def test_interleaved_stages_loop_over_the_ranks():
    stages = split_stages(16, 4, virtual_stages=2, schedule="interleaved_1f1b")
    assert len(stages) == 8 and counts(stages) == [2] * 8
    assert [s.rank for s in stages] == [s.index % 4 for s in stages] == [0, 1, 2, 3, 0, 1, 2, 3]
    held = rank_stages(stages, 1)
    assert [s.index for s in held] == [1, 5] and [list(s.layers) for s in held] == [[2, 3], [10, 11]]
    assert rank_stages(stages, 0)[0].first and rank_stages(stages, 3)[-1].last


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((3, 4, 1, None, "1f1b"), "model.num_layers 3 cannot fill layout.pp 4 x layout.pp_virtual_stages 1 = 4 stages"),
        ((8, 2, 2, None, "1f1b"), "layout.pp_virtual_stages 2 needs layout.pp_schedule interleaved_1f1b"),
        ((8, 2, 1, (4, 2, 2), "1f1b"), r"layout.pp_stage_layers lists 3 stage\(s\), but layout.pp x"),
        ((8, 2, 1, (4, 3), "1f1b"), r"layout.pp_stage_layers \[4, 3\] sums to 7, not model.num_layers 8"),
        ((8, 3, 1, (4, 0, 4), "1f1b"), "every stage but the first and last needs at least 1 layer"),
        ((8, 2, 1, (9, -1), "1f1b"), "every stage but the first and last needs at least 1 layer"),
    ],
)
def test_splits_that_cannot_work_are_refused_naming_the_field(args, message):
    assert split_problem(*args) is not None
    layers, pp, v, explicit, schedule = args
    with pytest.raises(ValueError, match=message):
        split_stages(layers, pp, v, explicit, schedule)


def test_1f1b_needs_as_many_micro_batches_as_stages_and_gpipe_does_not():
    problem = schedule_problem("1f1b", 4, 1, 3)
    assert problem and "3 micro-batch(es)" in problem and "< layout.pp 4" in problem and "gpipe" in problem
    assert schedule_problem("1f1b", 4, 1, 4) is None
    assert schedule_problem("gpipe", 4, 1, 1) is None
    assert schedule_problem("1f1b", 1, 1, 1) is None  # no pipeline, nothing to refuse
    assert schedule_problem("interleaved_1f1b", 4, 2, 2) is not None  # fewer micro-batches than ranks


def test_interleaved_runs_micro_batches_in_whole_rounds_of_pp():
    assert schedule_problem("interleaved_1f1b", 4, 2, 8) is None
    assert schedule_problem("interleaved_1f1b", 4, 2, 12) is None
    assert schedule_problem("interleaved_1f1b", 4, 2, 7) is None  # one round of 7
    assert schedule_problem("interleaved_1f1b", 4, 2, 10) is None  # torch's rounds: 10 // 4 = 2 rounds of 5
    problem = schedule_problem("interleaved_1f1b", 4, 2, 9)  # 9 // 4 = 2 rounds: 9 does not split in 2
    assert problem and "rounds of layout.pp 4" in problem and "use a multiple of 4" in problem


def test_bubble_is_p_minus_1_over_v_times_m():
    assert bubble_fraction(4, 1, 64) == 3 / 64
    assert bubble_fraction(4, 2, 64) == 3 / 128  # interleaving divides it by the virtual stages
    assert bubble_fraction(1, 1, 1) == 0
    assert bubble_fraction(16, 1, 128) > BUBBLE_WARNING > bubble_fraction(16, 1, 256)
