"""The names of what training writes into a run dir, torch-free: its checkpoints/ with one step_N dir per checkpoint,
the files that make a directory a checkpoint, the lock a trainer holds, its metrics and the rest of RUN_ENTRIES.
The checkpoint format (checkpoint/format.py), the run dir's keeper (train/run_dir.py), the monitor and the output
guard (outputs.py) take them from here, so each name is written once and the guard needs no torch."""

from __future__ import annotations

import re
from pathlib import Path

from trnrecipes.config.profiling import PROFILE_DIR

CHECKPOINTS = "checkpoints"  # RUN_DIR/checkpoints/step_N
STEP_DIR = re.compile(r"^step_(\d+)$")
MANIFEST = "manifest.json"  # sha256 of every file of a checkpoint: a file it does not list makes it fail verification
DONE = "done"  # written last: the checkpoint is whole
LOCK_FILE = ".trnrecipes.lock"  # RUN_DIR/.trnrecipes.lock: rank 0 of the trainer that holds the run dir
METRICS = "metrics.jsonl"  # RUN_DIR/metrics.jsonl: one record per step (train/monitor.py)
METRICS_DROPPED = "metrics.dropped.jsonl"  # beside it: the records a resume took out of it (steps trained again)
TENSORBOARD = "tensorboard"  # RUN_DIR/tensorboard/: the monitor's event files
ARCHIVED = "archived"  # RUN_DIR/archived/<time>/: an earlier run's checkpoints and metrics (checkpoint.force_fresh)
TRACKERS = "trackers.json"  # RUN_DIR/trackers.json: the MLflow and W&B runs' ids a resume reopens (train/trackers.py)
MLFLOW_DB = "mlflow.db"  # RUN_DIR/mlflow.db: MLflow's local store where MLFLOW_TRACKING_URI is unset
MLFLOW_ARTIFACTS = "mlflow-artifacts"  # beside it: that store's artifacts
WANDB_DIR = "wandb"  # RUN_DIR/wandb/: W&B's run dirs (offline-run-*)
EVAL_RESULTS = "eval"  # RUN_DIR/eval/step_N/: eval run's results for a run dir (eval's own: not a RUN_ENTRY)
PLOTS = "plots"  # RUN_DIR/plots/: `trnrecipes plot`'s PNGs (its default --out)
PROFILE = PROFILE_DIR  # RUN_DIR/profile/: monitor.profile_steps' traces (config/profiling.py)
LOCK_CLAIM = LOCK_FILE + ".claim"  # beside the lock where the file system has no flock (train/run_dir.py)
FRESH_START = ".fresh_start.json"  # RUN_DIR/.fresh_start.json: the Slurm job that started it at step 0 (resume false)
STOP_FILE = re.compile(r"^\.stop-")  # RUN_DIR/.stop-JOB[.saved]: run.sbatch's stop request and the trainer's answer
# What a run dir holds of its own: the output guard refuses any other command's output that is or lies in one.
RUN_ENTRIES = (CHECKPOINTS, METRICS, METRICS_DROPPED, TENSORBOARD, TRACKERS, MLFLOW_DB, MLFLOW_ARTIFACTS, WANDB_DIR,
               ARCHIVED, PLOTS, PROFILE, LOCK_FILE, LOCK_CLAIM, FRESH_START)  # fmt: skip


def is_run_entry(name: str) -> bool:
    """Whether `name`, in a run dir, is one of the run's own files or directories (RUN_ENTRIES, the stop files)."""
    return name in RUN_ENTRIES or STOP_FILE.match(name) is not None


def run_dir_of(checkpoint: Path) -> Path | None:
    """RUN_DIR if `checkpoint` is RUN_DIR/checkpoints/step_N (as named, links not followed), else None."""
    checkpoint = Path(checkpoint)
    if STEP_DIR.match(checkpoint.name) and checkpoint.parent.name == CHECKPOINTS:
        return checkpoint.parent.parent
    return None


def newest_complete_step(run_dir: Path) -> int:
    """The step of RUN_DIR's newest checkpoint that has its `done` file (0: none), as a resume would find it before
    verifying its files."""
    steps = [0]
    try:
        for entry in (Path(run_dir) / CHECKPOINTS).iterdir():
            match = STEP_DIR.match(entry.name)
            if match and (entry / DONE).exists():
                steps.append(int(match.group(1)))
    except OSError:
        pass
    return max(steps)
