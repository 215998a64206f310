"""The step line a person watches: tokens seen, elapsed time and an ETA from the mean wall time per step after the
first (compilation and warm-up), the parameter norm where it was measured."""

from __future__ import annotations

import pytest

from trnrecipes.train import monitor
from trnrecipes.train.monitor import Clock, duration, progress_line


def test_durations_read_at_a_glance():
    assert [duration(s) for s in (0, 59.6, 61, 3599, 3600, 86399, 86400 + 3723, 10 * 86400)] == [
        "0:00:00", "0:01:00", "0:01:01", "0:59:59", "1:00:00", "23:59:59", "1d 01:02:03", "10d 00:00:00"
    ]  # fmt: skip


def test_the_eta_leaves_out_the_first_step_and_counts_everything_after(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(monitor.time, "monotonic", lambda: now[0])
    clock = Clock(start_step=10, max_steps=110)  # resumed at step 10
    now[0] = 160.0  # step 11: a minute of compilation
    assert clock.tick(11) == (60.0, None)
    now[0] = 162.0  # step 12: 2 s
    assert clock.tick(12) == (62.0, pytest.approx(2.0 * 98))
    now[0] = 172.0  # step 13: a validation and a save made it 10 s; the mean is 6 s a step
    assert clock.tick(13) == (72.0, pytest.approx(6.0 * 97))
    now[0] = 900.0
    assert clock.tick(110) == (800.0, 0.0)


def test_the_step_line_shows_norms_tokens_time_and_eta():
    record = {"step": 12, "loss": 2.5, "lr": 1e-4, "grad_norm": 0.5, "param_norm": 1234.5678, "tokens_per_s": 5000.0,
              "mfu": 0.41, "tokens_seen": 12 * 4 * 2048, "elapsed_s": 3725.0, "eta_s": 90061.0}  # fmt: skip
    assert progress_line(record, 100) == (
        "step  12/100 | loss 2.5000 | lr 1.00e-04 | grad 0.500 | param 1235 | 5,000 tok/s | MFU 41.00% | 98.3k tokens"
        " | 1:02:05 elapsed, ETA 1d 01:01:01"
    )
    first = {**record, "eta_s": None, "tokens_seen": 3 * 10**12}
    del first["param_norm"]
    assert progress_line(first, 100).endswith("| MFU 41.00% | 3T tokens | 1:02:05 elapsed, ETA --")
