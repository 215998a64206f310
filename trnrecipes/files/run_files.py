"""The names of what training writes into a run dir, torch-free: its checkpoints/ with one step_N dir per checkpoint,
the files that make a directory a checkpoint, the lock a trainer holds, and its metrics. The checkpoint format
(checkpoint/format.py), the run dir's keeper (train/run_dir.py) and the output guard (outputs.py) take them from here,
so each name is written once and the guard needs no torch."""

from __future__ import annotations

import re
from pathlib import Path

CHECKPOINTS = "checkpoints"  # RUN_DIR/checkpoints/step_N
STEP_DIR = re.compile(r"^step_(\d+)$")
MANIFEST = "manifest.json"  # sha256 of every file of a checkpoint: a file it does not list makes it fail verification
DONE = "done"  # written last: the checkpoint is whole
LOCK_FILE = ".trnrecipes.lock"  # RUN_DIR/.trnrecipes.lock: rank 0 of the trainer that holds the run dir
METRICS = "metrics.jsonl"  # RUN_DIR/metrics.jsonl: one record per step (train/monitor.py)
METRICS_DROPPED = "metrics.dropped.jsonl"  # beside it: the records a resume took out of it (steps trained again)


def run_dir_of(checkpoint: Path) -> Path | None:
    """RUN_DIR if `checkpoint` is RUN_DIR/checkpoints/step_N (as named, links not followed), else None."""
    checkpoint = Path(checkpoint)
    if STEP_DIR.match(checkpoint.name) and checkpoint.parent.name == CHECKPOINTS:
        return checkpoint.parent.parent
    return None
