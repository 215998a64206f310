"""MLflow and W&B trackers (monitor.trackers): each step record's numbers at its history step, from global rank 0,
with the resolved recipe as the run's parameters and the job dir's provenance as its tags. Each is an optional extra.

A resumed run reopens the tracker runs whose ids RUN_DIR/trackers.json keeps. MLflow then holds each step once, as
metrics.jsonl does: the values of the steps trained again are deleted first; W&B's limits: docs/training.md."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import secrets
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from trnrecipes.config.sections import TRACKER_PACKAGES, RecipeError
from trnrecipes.config.tracking import tracker_setting_problems
from trnrecipes.data.arrow import atomic_output
from trnrecipes.files.run_files import MLFLOW_ARTIFACTS, MLFLOW_DB, TRACKERS, WANDB_DIR

NOT_METRICS = ("step", "history_step", "phase")  # the x axis, not values
PARAM_CHARS, TAG_CHARS = 6000, 8000  # MLflow's limits on a param's and a tag's value (mlflow.utils.validation)


# How a launch ended: its last step trained, an error, or a stop asked for (a signal, the stop file: preemption or
# a time limit) after a save, which a resume continues.
Outcome = Literal["finished", "failed", "stopped"]


class Tracker(Protocol):
    def log(self, values: dict[str, float], step: int) -> None: ...

    def close(self, outcome: Outcome) -> None: ...


@dataclass(frozen=True)
class TrackedRun:
    """What a tracker is told of the run: `resumed_from` is the history step it trains on from (0: a fresh start)."""

    name: str  # the recipe's
    run_dir: Path
    recipe: dict  # the resolved recipe (Recipe.to_dict())
    provenance: dict  # the job dir's provenance.json; {} where the run has none
    resumed_from: int


def require_packages(trackers: tuple[str, ...]) -> None:
    """One line naming the extra if a tracker asked for is not installed (before anything is built)."""
    for name in trackers:
        for module, package in TRACKER_PACKAGES.get(name, ()):
            if importlib.util.find_spec(module) is None:
                raise RecipeError(
                    f"monitor.trackers asks for {name}, but {package} is not installed: install the tracking extra"
                    " (pip install -e '.[tracking]' in the job's Python; make setup does it in .venv), or remove"
                    f" {name} from monitor.trackers"
                )


def numbers(record: dict) -> dict[str, float]:
    """A step record's values a tracker plots: its numbers (a spike flag as 0/1), not its step counters."""
    return {
        key: float(value)
        for key, value in record.items()
        if isinstance(value, (int, float)) and key not in NOT_METRICS  # bool is an int
    }


@contextlib.contextmanager
def _quick_requests():
    """MLflow's HTTP retries while a run is opened: 2 and a 30 s timeout, not its 7 with backoff (4 minutes of
    silence before an unreachable server is told). The user's own settings stand; later logging keeps MLflow's."""
    ours = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}
    added = [name for name in ours if name not in os.environ]
    os.environ.update({name: ours[name] for name in added})
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def open_trackers(names: tuple[str, ...], run: TrackedRun, mlflow_experiment: str | None, wandb_project: str | None):
    """The trackers asked for besides tensorboard (Metrics writes that), their runs created or reopened. A tracker
    whose store cannot be reached is left out with one warning, as one failing mid-run is dropped: training goes
    on (metrics.jsonl keeps everything); a setting that can never work is refused."""
    require_packages(names)
    if problems := tracker_setting_problems(names):  # before any run is opened: none is left RUNNING by the refusal
        raise RecipeError(problems[0])
    state = _read_state(run.run_dir)
    opened: list[Tracker] = []
    if "mlflow" in names:
        try:
            with _quick_requests():
                opened.append(MlflowTracker(run, mlflow_experiment or run.name, state.get("mlflow")))
        except RecipeError:
            raise
        except Exception as err:  # an unreachable tracking server, a store's outage
            _left_out("MLflow", err)
    if "wandb" in names:
        try:
            opened.append(WandbTracker(run, wandb_project or run.name, state.get("wandb")))
        except Exception as err:  # online without an API key, W&B's servers down: metrics.jsonl has it all
            _left_out("W&B", err)
    return opened


def _left_out(tracker: str, err: Exception) -> None:
    said = (str(err).strip().splitlines() or [""])[0][:300]
    print(
        f"[trnrecipes] warning: {tracker} could not be opened ({type(err).__name__}: {said}); this launch logs"
        " nothing to it (metrics.jsonl and the console go on; a resume tries again)",
        file=sys.stderr,
        flush=True,
    )


def _read_state(run_dir: Path) -> dict:
    try:
        state = json.loads((run_dir / TRACKERS).read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def _save_state(run_dir: Path, name: str, entry: dict) -> None:
    """Record a tracker run's id before anything is logged to it: a kill after that keeps it for the resume."""
    state = _read_state(run_dir) | {name: entry}
    with atomic_output(run_dir / TRACKERS) as tmp:
        Path(tmp).write_text(json.dumps(state, indent=2) + "\n")


def flatten(tree: dict, prefix: str = "") -> dict[str, str]:
    """{"model.dim": "64", ...}: nested sections joined by dots, lists as JSON."""
    flat: dict[str, str] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat |= flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = json.dumps(value) if isinstance(value, (list, tuple)) else str(value)
    return flat


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


class MlflowTracker:
    """An MLflow run in MLFLOW_TRACKING_URI's store, else the SQLite one at RUN_DIR/mlflow.db (MLflow's recommended
    local backend). Metric values are logged at the history step; params are the recipe when the run is made."""

    def __init__(self, run: TrackedRun, experiment: str, kept: dict | None):
        from mlflow import MlflowClient
        from mlflow.exceptions import MlflowException

        self.uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{run.run_dir.resolve() / MLFLOW_DB}"
        self.client = MlflowClient(tracking_uri=self.uri)
        self.run_id: str | None = None
        previous = (kept or {}).get("run_id")  # a new run made here is linked to it by a tag
        if kept and kept.get("tracking_uri") == self.uri:
            with contextlib.suppress(MlflowException, KeyError):  # gone from the store: a new run
                info = self.client.get_run(kept["run_id"]).info
                # deleted in the UI (kept until garbage-collected): it takes no more values, so a new run too
                self.run_id = info.run_id if info.lifecycle_stage == "active" else None
        if self.run_id is not None and not self._drop_beyond(run.resumed_from):
            previous, self.run_id = self.run_id, None
        if self.run_id is None:
            self.run_id = self._create(run, experiment, previous)
        else:
            self._log_changed_params(run)
            self.client.update_run(self.run_id, status="RUNNING")
        _save_state(run.run_dir, "mlflow", {"tracking_uri": self.uri, "run_id": self.run_id})

    def _create(self, run: TrackedRun, experiment: str, previous: str | None) -> str:
        from mlflow.entities import Param, RunTag

        found = self.client.get_experiment_by_name(experiment)
        if found is not None and found.lifecycle_stage != "active":
            raise RecipeError(
                f"the MLflow experiment {experiment!r} in {self.uri} is deleted: restore it (mlflow experiments"
                " restore) or name another with monitor.mlflow_experiment"
            )
        if found is not None:
            experiment_id = found.experiment_id
        else:  # the local store's artifacts in the run dir, not in ./mlruns wherever training was started
            local = None if os.environ.get("MLFLOW_TRACKING_URI") else (run.run_dir.resolve() / MLFLOW_ARTIFACTS)
            experiment_id = self.client.create_experiment(experiment, local.as_uri() if local else None)
        tags = {f"provenance.{k}": v for k, v in flatten(run.provenance).items()} | {"run_dir": str(run.run_dir)}
        if run.provenance.get("git_sha"):
            tags["mlflow.source.git.commit"] = str(run.provenance["git_sha"])  # shown by MLflow's UI
        if previous:
            tags["trnrecipes.continues_run"] = previous
        run_id = self.client.create_run(experiment_id, run_name=run.run_dir.name).info.run_id
        params = [Param(k, _cut(v, PARAM_CHARS)) for k, v in flatten(run.recipe).items()]
        tag_list = [RunTag(k, _cut(v, TAG_CHARS)) for k, v in tags.items()]
        try:
            for i in range(0, max(len(params), len(tag_list)), 100):  # log_batch takes 100 params and tags at a time
                self.client.log_batch(run_id, params=params[i : i + 100], tags=tag_list[i : i + 100])
        except BaseException:
            # A store that refuses the params refuses them at every launch: each run left RUNNING would be one
            # more orphan in the UI. This one is ended FAILED; the launch goes on without MLflow (open_trackers).
            with contextlib.suppress(Exception):
                self.client.set_terminated(run_id, "FAILED")
            raise
        return run_id

    def _log_changed_params(self, run: TrackedRun) -> None:
        """A param cannot change in MLflow: a resumed run's new or changed recipe values (a longer max_steps) go in
        as tags resumed_at_<step>.<key>."""
        from mlflow.entities import RunTag

        logged = self.client.get_run(self.run_id).data.params
        changed = [
            RunTag(f"resumed_at_{run.resumed_from}.{k}", _cut(v, TAG_CHARS))
            for k, v in flatten(run.recipe).items()
            if logged.get(k) != _cut(v, PARAM_CHARS)
        ]
        for i in range(0, len(changed), 100):
            self.client.log_batch(self.run_id, tags=changed[i : i + 100])

    def _drop_beyond(self, step: int) -> bool:
        """Delete the run's metric values beyond history step `step` (a killed attempt's, trained again now).
        MLflow has no API for that; its SQL stores hold them in two tables, edited here in one transaction. False
        where there are some and the store is not a SQL one (a tracking server): the caller starts a new run."""
        store = self.client._tracking_client.store
        if type(store).__name__ != "SqlAlchemyStore":  # its module needs SQLAlchemy, which a server's client may lack
            latest = self.client.get_run(self.run_id).data.metrics
            return not latest or all(
                m.step <= step for key in latest for m in self.client.get_metric_history(self.run_id, key)
            )
        from mlflow.store.tracking.dbmodels.models import SqlLatestMetric, SqlMetric

        with store.ManagedSessionMaker(read_only=False) as session:
            mine = session.query(SqlMetric).filter(SqlMetric.run_uuid == self.run_id)
            if mine.filter(SqlMetric.step > step).delete() == 0:
                return True
            session.query(SqlLatestMetric).filter(SqlLatestMetric.run_uuid == self.run_id).delete()
            latest: dict[str, SqlMetric] = {}
            for m in mine.all():  # the latest value of each key, as the store picks it: by step, time, value
                if m.key not in latest or (m.step, m.timestamp, m.value) > (
                    latest[m.key].step,
                    latest[m.key].timestamp,
                    latest[m.key].value,
                ):
                    latest[m.key] = m
            session.add_all(
                SqlLatestMetric(
                    run_uuid=self.run_id, key=m.key, value=m.value, timestamp=m.timestamp, step=m.step, is_nan=m.is_nan
                )
                for m in latest.values()
            )
        return True

    def log(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def close(self, outcome: Outcome) -> None:
        # A stopped launch is KILLED (MLflow's status for a run ended from outside), not FINISHED: a resume reopens
        # it RUNNING.
        self.client.set_terminated(self.run_id, {"finished": "FINISHED", "failed": "FAILED"}.get(outcome, "KILLED"))


class WandbTracker:
    """A W&B run in WANDB_MODE's mode, offline where it is unset (training nodes often have no network): offline it
    writes RUN_DIR/wandb/offline-run-<time>-<id>/, one per launch, under the one id kept."""

    def __init__(self, run: TrackedRun, project: str, kept: dict | None):
        import wandb

        mode = os.environ.get("WANDB_MODE") or "offline"
        run_id = (kept or {}).get("id") or secrets.token_hex(6)
        _save_state(run.run_dir, "wandb", {"id": run_id, "project": project})
        (run.run_dir / WANDB_DIR).mkdir(parents=True, exist_ok=True)
        git = str(run.provenance.get("git_sha") or "")[:12]
        self.run = wandb.init(
            dir=run.run_dir,
            project=project,
            name=run.run_dir.name,
            id=run_id,
            resume=None if mode == "offline" else "allow",  # offline, wandb 0.31 ignores resume with a warning
            mode=mode,
            config=run.recipe | {"provenance": run.provenance},
            tags=[f"git-{git}"] if git else None,
            settings=wandb.Settings(console="off"),  # the trainer's console stays as it is
        )

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self, outcome: Outcome) -> None:
        if outcome == "stopped":  # W&B's preempted state (a non-zero exit after mark_preempting): to be resumed
            self.run.mark_preempting()
        self.run.finish(exit_code=0 if outcome == "finished" else 1)
