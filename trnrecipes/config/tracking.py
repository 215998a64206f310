"""Where monitor.trackers' MLflow runs go (MLFLOW_TRACKING_URI), checked before a job starts: by doctor on the login
node and by the trainer before it builds anything (trnrecipes/train/trackers.py opens the runs)."""

from __future__ import annotations

import os
from urllib.parse import urlparse

DATABRICKS_STORES = ("databricks", "databricks-uc", "uc")  # URIs without a scheme that are no path (mlflow's registry)


def mlflow_store_problem(environ: dict[str, str] | None = None) -> str | None:
    """Why MLFLOW_TRACKING_URI cannot take a run, or None: MLflow 3 refuses its file store (a path or a file: URI)
    unless MLFLOW_ALLOW_FILE_STORE is true (mlflow/store/tracking/file_store.py, 3.17): the run would stop at its
    start with MLflow's traceback. doctor says it before the job; training refuses it in one line."""
    environ = os.environ if environ is None else environ
    uri = environ.get("MLFLOW_TRACKING_URI")
    allowed = environ.get("MLFLOW_ALLOW_FILE_STORE", "").strip().lower() in ("true", "1")
    if not uri or allowed or uri in DATABRICKS_STORES or urlparse(uri).scheme not in ("", "file"):
        return None
    return (
        f"MLFLOW_TRACKING_URI {uri} is MLflow's file store, which MLflow 3 refuses unless MLFLOW_ALLOW_FILE_STORE="
        "true: use a database store (sqlite:///PATH/mlflow.db, or a tracking server), or unset it for the run dir's"
        " own RUN_DIR/mlflow.db"
    )


WANDB_MODES = ("online", "offline", "shared", "disabled", "dryrun", "run")  # wandb 0.31's Settings.mode


def wandb_mode_problem(environ: dict[str, str] | None = None) -> str | None:
    """Why WANDB_MODE cannot open a run, or None (unset: offline, trackers.py's default). wandb.init would stop the
    run with a pydantic traceback and exit 1, which run.sbatch requeues: told before the job instead."""
    environ = os.environ if environ is None else environ
    mode = environ.get("WANDB_MODE")
    if not mode or mode in WANDB_MODES:
        return None
    return f"WANDB_MODE {mode!r} is not a W&B mode: one of {', '.join(WANDB_MODES)} (unset: offline, in the run dir)"


def tracker_setting_problems(trackers: tuple[str, ...], environ: dict[str, str] | None = None) -> list[str]:
    """The environment's tracker settings that can never work, for the trackers a recipe asks for: checked by doctor,
    by every rank before the model is built, and before any tracker run is opened."""
    checks = (("mlflow", mlflow_store_problem), ("wandb", wandb_mode_problem))
    return [problem for name, check in checks if name in trackers and (problem := check(environ))]
