"""metrics.jsonl holds each step once: a resumed run removes the records of the steps it trains again (and half a
line left by a kill) into metrics.dropped.jsonl, keeping earlier phases whole; plot and the next phase's history
read one record per step from files written before that (the later record of a step wins)."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest
from test_resume import SMALL, config, finish, start
from test_train import run

from trnrecipes.train.monitor import Metrics, history_until
from trnrecipes.train.plot import read_records

HALF_LINE = '{"step": 6, "loss": 2.7'  # what a kill in the middle of a record's write leaves


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> dict:
    """Phase 1: 4 steps. Phase 2, from its step_4: a checkpoint every 3 steps (written in the step: step_3 is whole
    before step 4 starts), killed after step 5, its file then ending in half a line; resumed from step 3 to 6."""
    tmp = tmp_path_factory.mktemp("metrics")
    run("llama2-tiny", tmp / "phase1", *SMALL, steps=4)
    phase1 = tmp / "phase1/checkpoints/step_4"
    cfg = config(
        tmp, "train.max_steps=6", "checkpoint.every_steps=3", "checkpoint.async_save=false", f"train.init_from={phase1}"
    )
    crashed = start(cfg, TRNRECIPES_CRASH_ONCE=f"{tmp}/crashed:5:0")
    out, _ = crashed.communicate(timeout=600)
    assert crashed.returncode == -signal.SIGKILL, out[-3000:]
    killed = lines(tmp / "run/metrics.jsonl")
    with open(tmp / "run/metrics.jsonl", "a") as f:
        f.write(HALF_LINE)
    out = finish(start(cfg))
    assert re.search(r"resuming from \S+ \(step 3\)", out), out[-3000:]
    return {"run": tmp / "run", "phase1": lines(tmp / "phase1/metrics.jsonl"), "killed": killed}


@pytest.mark.slow
def test_a_resumed_run_logs_each_step_once_and_keeps_the_dropped_records_aside(resumed):
    records = lines(resumed["run"] / "metrics.jsonl")
    assert [(r["phase"], r["step"]) for r in records] == [(1, s) for s in range(1, 5)] + [(2, s) for s in range(1, 7)]
    assert [r["history_step"] for r in records] == list(range(1, 11))
    assert records[:4] == [r | {"phase": 1, "history_step": r["step"]} for r in resumed["phase1"]]  # phase 1 whole
    dropped = [r for r in lines(resumed["run"] / "metrics.dropped.jsonl") if "line" not in r]
    beyond = [r for r in resumed["killed"] if r["phase"] == 2 and r["step"] > 3]  # what the killed attempt logged
    assert [r["step"] for r in beyond] == [4, 5]
    assert dropped == [r | {"dropped_by_resume_from_step": 3, "dropped_at": dropped[0]["dropped_at"]} for r in beyond]


@pytest.mark.slow
def test_half_a_line_left_by_a_kill_goes_aside_and_the_next_record_is_whole(resumed):
    text = (resumed["run"] / "metrics.jsonl").read_text()
    assert HALF_LINE not in text and all(json.loads(line)["step"] for line in text.splitlines())
    (aside,) = [r for r in lines(resumed["run"] / "metrics.dropped.jsonl") if "line" in r]
    assert aside["line"] == HALF_LINE and aside["dropped_by_resume_from_step"] == 3


def test_plot_and_history_read_one_record_per_step_from_an_old_file_with_duplicates(tmp_path: Path):
    # Written before resumes truncated the file: phase 2 resumed from step 3 after logging steps 4-6 (loss 9).
    phase1 = [{"phase": 1, "history_step": s, "step": s, "loss": 5.0, "grad_norm": 1.0} for s in range(1, 5)]
    lost = [{"phase": 2, "history_step": 4 + s, "step": s, "loss": 9.0, "grad_norm": 1.0} for s in range(4, 7)]
    went_on = [{"phase": 2, "history_step": 4 + s, "step": s, "loss": 1.0, "grad_norm": 1.0} for s in range(4, 9)]
    early = [{"phase": 2, "history_step": 4 + s, "step": s, "loss": 2.0, "grad_norm": 1.0} for s in range(1, 4)]
    old = tmp_path / "metrics.jsonl"
    old.write_text("".join(json.dumps(r) + "\n" for r in [*phase1, *early, *lost, *went_on]))

    assert read_records(old) == [*phase1, *early, *went_on]  # phase 1's steps 1-4 are not phase 2's
    assert history_until(old, 7) == [*phase1, *early, *went_on[:4]]


def test_an_old_file_whose_later_attempt_stopped_short_still_reads_in_step_order(tmp_path: Path):
    first = [{"step": s, "loss": 5.0, "grad_norm": 1.0} for s in range(1, 11)]
    again = [{"step": s, "loss": 1.0, "grad_norm": 1.0} for s in (6, 7)]  # resumed from 5, stopped after 7
    old = tmp_path / "metrics.jsonl"
    old.write_text("".join(json.dumps(r) + "\n" for r in [*first, *again]))
    assert read_records(old) == [*first[:5], *again, *first[7:]]  # steps 1-10 in order, 6 and 7 the later ones


def test_a_run_killed_before_logging_its_first_step_keeps_the_history_and_its_phase(tmp_path: Path):
    earlier = [{"step": s, "loss": 5.0} for s in range(1, 5)]
    (tmp_path / "a").mkdir()
    (tmp_path / "a/metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in earlier))
    history = [r | {"phase": 1, "history_step": r["step"]} for r in earlier]
    (tmp_path / "b").mkdir()  # the history copied, then the kill: no record of its own yet, no checkpoint
    (tmp_path / "b/metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in history))
    previous = tmp_path / "a/metrics.jsonl", 4
    metrics = Metrics(tmp_path / "b", True, tensorboard=False, previous=previous, resumed_from=0)
    metrics.log({"step": 1, "loss": 4.0})
    metrics.close()
    assert lines(tmp_path / "b/metrics.jsonl") == [*history, {"step": 1, "loss": 4.0, "phase": 2, "history_step": 5}]
    assert not (tmp_path / "b/metrics.dropped.jsonl").exists()


def test_tokens_seen_counts_on_from_the_resumed_steps_record_whatever_the_batch_now(tmp_path: Path):
    # four steps of 1,024 tokens, resumed from step 3 with 2,048 a step: 3,072 + 2,048 at step 4, not 4 x 2,048
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": 1.0, "tokens_seen": 1024 * s}) + "\n" for s in (1, 2, 3, 4))
    )
    metrics = Metrics(tmp_path, True, tensorboard=False, resumed_from=3)
    assert metrics.tokens_at_resume == 3072
    metrics.close("finished")
    assert Metrics(tmp_path, True, tensorboard=False, resumed_from=0).tokens_at_resume is None  # a fresh start


@pytest.mark.slow
def test_a_resumed_run_flags_the_spikes_an_unstopped_one_does_and_counts_them_all(tmp_path: Path):
    """The spike detector's 20-step window is replayed from metrics.jsonl on resume: it started empty, and no spike
    could be flagged for 20 steps after any requeue (llama2-tiny at lr 1e-2 spikes at steps 21, 23 and 28)."""
    loud = ["optim.lr=1e-2", "train.val_every=1000", "monitor.trackers=[]", "checkpoint.every_steps=22"]
    run("llama2-tiny", tmp_path / "straight", *loud, steps=30)
    run("llama2-tiny", tmp_path / "resumed", *loud, steps=22)
    run("llama2-tiny", tmp_path / "resumed", *loud, steps=30)
    straight, resumed = (lines(tmp_path / name / "metrics.jsonl") for name in ("straight", "resumed"))
    flagged = [r["step"] for r in straight if r["spike"]]
    assert [s for s in flagged if s > 22], flagged  # spikes after the resume, or the test shows nothing
    assert [r["spike"] for r in resumed] == [r["spike"] for r in straight]


def test_a_full_disk_under_metrics_is_one_line_not_a_traceback_requeued_to_fail_again(tmp_path: Path):
    """/dev/full answers every write with ENOSPC, as a shared file system another job filled: the run stopped with a
    traceback and exit 1, which run.sbatch requeues up to max_restarts times to fail the same way."""
    from trnrecipes.cli import requeue_may_pass
    from trnrecipes.config.sections import RecipeError

    metrics = Metrics(tmp_path, True, tensorboard=False, resumed_from=0)
    metrics.file.close()
    metrics.file = open("/dev/full", "a", buffering=1)
    with pytest.raises(RecipeError, match=rf"^run dir {tmp_path}: cannot write metrics.jsonl \(No space left on dev"):
        metrics.log({"step": 1, "loss": 1.0})
    try:
        metrics.log({"step": 1, "loss": 1.0})
    except RecipeError as err:
        assert not requeue_may_pass(err)  # exit 2: the same disk fails the requeue the same way
    metrics.close()  # and closing does not raise over the error that ended the run
