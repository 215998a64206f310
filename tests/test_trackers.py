"""monitor.trackers mlflow and wandb with the real packages, offline (each training in a network namespace of its own
where `unshare -n` works): a run killed after logging a step beyond its checkpoint, then resumed, holds each of its
4 steps once in the same MLflow run (read back with MLflow's client from RUN_DIR/mlflow.db), with the recipe as params
and the job dir's provenance as tags; W&B's offline run dirs keep the one id and are parsed with W&B's own protobuf
schema; a tracker whose package is missing stops the run in one line naming the extra."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO
from test_resume import config

from trnrecipes.config.recipe import load_recipe
from trnrecipes.config.sections import RecipeError
from trnrecipes.train.loop import Trainer
from trnrecipes.train.trackers import MlflowTracker, TrackedRun

PROVENANCE = {"git_sha": "0123456789abcdef", "command": "trnrecipes sbatch llama2-tiny", "layout": {"tp": 1},
              "files": {"run.sbatch": "ab" * 32}}  # fmt: skip
NO_NETWORK = ["unshare", "-n"] if subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0 else []


def train(cfg: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """`trnrecipes train` on `cfg`, with no network where the machine allows it, and the trackers' defaults (no
    MLFLOW_TRACKING_URI or WANDB_MODE from the calling shell)."""
    clean = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "WANDB_MODE")}
    cmd = [*NO_NETWORK, sys.executable, "-m", "trnrecipes", "train", "--config", str(cfg)]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=clean | env, timeout=300)


def loss_history(run: Path) -> tuple[str, list[tuple[int, float]], object]:
    from mlflow import MlflowClient

    run_id = json.loads((run / "trackers.json").read_text())["mlflow"]["run_id"]
    client = MlflowClient(tracking_uri=f"sqlite:///{run / 'mlflow.db'}")
    return run_id, [(m.step, m.value) for m in client.get_metric_history(run_id, "loss")], client.get_run(run_id)


@pytest.fixture(scope="module")
def tracked(tmp_path_factory) -> dict:
    """4 steps, a checkpoint every 2, killed after step 3 (logged, not saved), resumed from step 2; the recipe.yaml
    in a dir with a provenance.json, as in a job dir."""
    tmp = tmp_path_factory.mktemp("trackers")
    overrides = ["train.max_steps=4", "checkpoint.every_steps=2", "checkpoint.async_save=false"]
    cfg = config(tmp, *overrides, "monitor.trackers=[mlflow,wandb]")
    (tmp / "provenance.json").write_text(json.dumps(PROVENANCE))
    killed = train(cfg, TRNRECIPES_CRASH_ONCE=f"{tmp}/crashed:3:0")
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-3000:] + killed.stderr[-3000:]
    before = loss_history(tmp / "run")
    resumed = train(cfg)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout + resumed.stderr
    records = [json.loads(line) for line in (tmp / "run/metrics.jsonl").read_text().splitlines()]
    return {"run": tmp / "run", "before": before, "after": loss_history(tmp / "run"), "records": records}


@pytest.mark.slow
def test_a_killed_and_resumed_run_continues_the_same_mlflow_run_with_each_step_once(tracked):
    run_id, killed_steps, _ = tracked["before"]
    assert [s for s, _ in killed_steps] == [1, 2, 3]  # step 3 logged, then the kill: its checkpoint is step 2's
    same_id, history, run = tracked["after"]
    assert same_id == run_id and run.info.status == "FINISHED"
    assert history == [(r["step"], r["loss"]) for r in tracked["records"]] and len(history) == 4
    last = tracked["records"][-1]
    for key in ("grad_norm", "param_norm", "lr", "tokens_seen", "tokens_per_s", "mfu", "spike", "val_loss"):
        assert run.data.metrics[key] == pytest.approx(float(last[key])), key


@pytest.mark.slow
def test_the_mlflow_run_holds_the_recipe_as_params_and_the_provenance_as_tags(tracked):
    _, _, run = tracked["after"]
    params, tags = run.data.params, run.data.tags
    assert params["model.family"] == "llama2" and params["train.max_steps"] == "4"
    assert params["monitor.trackers"] == '["mlflow", "wandb"]'
    assert tags["provenance.git_sha"] == PROVENANCE["git_sha"] and tags["provenance.layout.tp"] == "1"
    assert tags["mlflow.source.git.commit"] == PROVENANCE["git_sha"]
    assert not [key for key in tags if key.startswith("provenance.files")]  # the scripts' sha256: for re-rendering


def wandb_records(path: Path):
    """The records of a .wandb file: W&B's LevelDB-style log (a 7-byte header, 32 KiB blocks of chunks with a 7-byte
    header: crc, length, type), each record a wandb_internal_pb2.Record. wandb 0.31 has no Python reader (its
    wandb-core writes and reads them), so the framing is read here and the records with W&B's own protobuf schema."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1)
    pos, parts = 7, b""
    while pos + 7 <= len(data):
        if (left := 32768 - pos % 32768) < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break
        parts += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


@pytest.mark.slow
def test_wandb_writes_offline_run_dirs_under_the_one_id_with_the_steps_logged(tracked):
    kept = json.loads((tracked["run"] / "trackers.json").read_text())["wandb"]
    dirs = sorted((tracked["run"] / "wandb").glob("offline-run-*"))
    assert len(dirs) == 2 and all(d.name.endswith(f"-{kept['id']}") for d in dirs)  # one per launch
    runs, history = [], {}
    for record in wandb_records(dirs[-1] / f"run-{kept['id']}.wandb"):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            runs.append(record.run)
        elif kind == "history":
            items = {item.key or ".".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history[record.history.step.num] = items
    (run,) = runs
    assert (run.run_id, run.project) == (kept["id"], "llama2-tiny") and "git-0123456789ab" in run.tags
    config = {item.key or ".".join(item.nested_key): json.loads(item.value_json) for item in run.config.update}
    assert config["model"]["family"] == "llama2" and config["provenance"] == {
        k: v for k, v in PROVENANCE.items() if k != "files"
    }  # the scripts' sha256 are for re-rendering
    expected = {r["step"]: r["loss"] for r in tracked["records"] if r["step"] > 2}  # the resumed launch's steps
    assert {step: items["loss"] for step, items in history.items()} == expected


def test_a_tracker_whose_package_is_missing_stops_the_run_in_one_line_naming_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` fail as where it is not installed
    recipe = load_recipe("llama2-tiny", overrides=[f"run_dir={tmp_path / 'run'}", "monitor.trackers=[wandb]"])
    with pytest.raises(RecipeError) as err:
        Trainer(recipe)
    message = str(err.value)
    assert "\n" not in message and "wandb is not installed" in message and "pip install -e '.[tracking]'" in message
    assert not (tmp_path / "run").exists()  # stopped before anything was built or written


def test_a_store_without_sql_access_gets_a_new_run_linked_to_the_old_where_steps_would_repeat(monkeypatch, tmp_path):
    """MLflow's file store stands in for a tracking server: neither lets the client delete a metric value."""
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    recipe = {"model": {"family": "llama2"}, "train": {"max_steps": 4}}
    first = MlflowTracker(TrackedRun("tiny", tmp_path, recipe, {}, resumed_from=0), "tiny", None)
    for step in (1, 2, 3):
        first.log({"loss": 10.0 - step}, step)  # then killed: no close
    kept = json.loads((tmp_path / "trackers.json").read_text())["mlflow"]
    same = MlflowTracker(TrackedRun("tiny", tmp_path, recipe, {}, resumed_from=3), "tiny", kept)
    assert same.run_id == first.run_id  # nothing beyond step 3 to repeat
    again = MlflowTracker(TrackedRun("tiny", tmp_path, recipe, {}, resumed_from=2), "tiny", kept)
    client = MlflowClient()
    assert again.run_id != first.run_id and client.get_run(again.run_id).data.tags["trnrecipes.continues_run"] == (
        first.run_id
    )
    assert json.loads((tmp_path / "trackers.json").read_text())["mlflow"]["run_id"] == again.run_id
    assert [m.step for m in client.get_metric_history(first.run_id, "loss")] == [1, 2, 3]  # the old run untouched
    client.delete_run(again.run_id)  # deleted in the UI: it takes no more values
    kept = json.loads((tmp_path / "trackers.json").read_text())["mlflow"]
    fresh = MlflowTracker(TrackedRun("tiny", tmp_path, recipe, {}, resumed_from=3), "tiny", kept)
    assert fresh.run_id not in (again.run_id, first.run_id)
    fresh.log({"loss": 6.0}, 4)
    client.delete_experiment(client.get_run(fresh.run_id).info.experiment_id)
    with pytest.raises(RecipeError, match=r"the MLflow experiment 'tiny' in .* is deleted: restore it"):
        MlflowTracker(TrackedRun("tiny", tmp_path / "other", recipe, {}, resumed_from=0), "tiny", None)


def test_a_file_store_is_refused_in_one_line_and_an_unreachable_server_left_out_at_once(monkeypatch, tmp_path, capsys):
    from trnrecipes.config.tracking import mlflow_store_problem
    from trnrecipes.train.trackers import open_trackers

    cases = (("file:///fsx/mlruns", "", True), ("./mlruns", "", True), ("./mlruns", "True", False),
             ("sqlite:///fsx/mlflow.db", "", False), ("http://mlflow:5000", "", False), ("databricks", "", False),
             ("databricks-uc", "", False))  # fmt: skip
    for uri, allowed, refused in cases:
        problem = mlflow_store_problem({"MLFLOW_TRACKING_URI": uri, "MLFLOW_ALLOW_FILE_STORE": allowed})
        assert (problem is not None) == refused, uri
    assert mlflow_store_problem({}) is None
    run = TrackedRun("tiny", tmp_path, {"train": {"max_steps": 4}}, {}, resumed_from=0)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())  # MLflow's traceback, exit 1: requeued
    with pytest.raises(RecipeError, match=r"is MLflow's file store, which MLflow 3 refuses unless MLFLOW_ALLOW_FILE"):
        open_trackers(("mlflow",), run, None, None)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9/")  # nothing listens: 4 minutes, then a traceback
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    assert open_trackers(("mlflow",), run, None, None) == []
    err = capsys.readouterr().err
    assert "[trnrecipes] warning: MLflow could not be opened (MlflowException: API request to" in err
    assert "MLFLOW_HTTP_REQUEST_MAX_RETRIES" not in os.environ  # MLflow's own retries for the run's logging


def test_a_run_whose_params_the_store_refuses_is_ended_failed_not_left_running(monkeypatch, tmp_path, capsys):
    """A store that rejects the recipe's params rejects them at every launch: no run left RUNNING by any of them."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    from trnrecipes.train.trackers import open_trackers

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)

    def refuse(self, run_id, metrics=(), params=(), tags=(), **kw):
        raise MlflowException("INVALID_PARAMETER_VALUE: a param the store refuses")  # e.g. a server's own limits

    monkeypatch.setattr(MlflowClient, "log_batch", refuse)
    run = TrackedRun("tiny", tmp_path, {"train": {"max_steps": 4}}, {}, resumed_from=0)
    for _ in range(2):
        assert open_trackers(("mlflow",), run, None, None) == []
    assert capsys.readouterr().err.count("MLflow could not be opened (MlflowException: INVALID_PARAMETER_VALUE") == 2
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    assert [r.info.status for r in runs] == ["FAILED", "FAILED"]


def test_a_wandb_mode_that_is_none_is_refused_first_and_a_wandb_that_cannot_open_is_left_out(
    monkeypatch, tmp_path, capsys
):
    """WANDB_MODE=off, or online without an API key: wandb.init's traceback after the model was built, exit 1 and a
    requeue, with the MLflow run opened before it left RUNNING."""
    from trnrecipes.train.trackers import open_trackers

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("WANDB_MODE", "off")
    run = TrackedRun("tiny", tmp_path, {"train": {"max_steps": 4}}, {}, resumed_from=0)
    with pytest.raises(RecipeError, match=r"WANDB_MODE 'off' is not a W&B mode: one of online, offline, shared"):
        open_trackers(("mlflow", "wandb"), run, None, None)
    assert not (tmp_path / "mlflow.db").exists()  # refused before any run was opened
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: no key
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    assert open_trackers(("wandb",), run, None, None) == []
    assert "[trnrecipes] warning: W&B could not be opened (" in capsys.readouterr().err


def test_mlflow_without_sqlalchemy_is_refused_in_one_line_naming_the_package(monkeypatch):
    from trnrecipes.train.trackers import require_packages

    monkeypatch.setitem(sys.modules, "sqlalchemy", None)  # mlflow-skinny alone: its local store cannot open
    with pytest.raises(RecipeError, match=r"asks for mlflow, but SQLAlchemy is not installed: install the tracking"):
        require_packages(("tensorboard", "mlflow"))


class _Tracker:
    def __init__(self, fail: str = ""):
        self.fail, self.logged, self.closed = fail, [], None

    def log(self, values, step):
        if self.fail == "log":
            raise ConnectionError("tracking server unreachable")
        self.logged.append((step, values["loss"]))

    def close(self, outcome):
        if self.fail == "close":
            raise ConnectionError("tracking server unreachable")
        self.closed = outcome


def test_a_tracker_that_fails_is_dropped_with_one_warning_and_the_run_goes_on(tmp_path, capsys):
    from trnrecipes.train.monitor import Metrics

    metrics = Metrics(tmp_path, enabled=True, tensorboard=False, resumed_from=0)
    down, fine, late = _Tracker("log"), _Tracker(), _Tracker("close")  # stand-ins for a server going away
    metrics.trackers = [down, fine, late]
    for step in (1, 2):
        metrics.log({"step": step, "loss": 3.0 - step})
    metrics.close("finished")
    err = capsys.readouterr().err
    assert err.count("_Tracker failed logging step 1 (ConnectionError: tracking server unreachable)") == 1
    assert "_Tracker failed closing its run" in err and "metrics.jsonl and the console go on" in err
    assert fine.logged == [(1, 2.0), (2, 1.0)] and fine.closed == "finished" and late.logged == fine.logged
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_a_stopped_launch_is_killed_in_mlflow_and_preempted_in_wandb_and_a_resume_reopens_it(monkeypatch, tmp_path):
    """A stop (preemption, a time limit: saved, to be resumed) is not a finished run in either tracker."""
    from mlflow import MlflowClient

    from trnrecipes.train.trackers import WandbTracker

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    recipe = {"model": {"family": "llama2"}, "train": {"max_steps": 4}}
    mlflow = MlflowTracker(TrackedRun("tiny", tmp_path, recipe, {}, resumed_from=0), "tiny", None)
    wandb = WandbTracker(TrackedRun("tiny", tmp_path, recipe, {}, resumed_from=0), "tiny", None)
    for tracker in (mlflow, wandb):
        tracker.log({"loss": 9.0}, 1)
        tracker.close("stopped")
    client = MlflowClient(tracking_uri=mlflow.uri)
    assert client.get_run(mlflow.run_id).info.status == "KILLED"
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    kinds = {r.WhichOneof("record_type"): r for r in wandb_records(run_file)}
    assert "preempting" in kinds and kinds["exit"].exit.exit_code == 1
    kept = json.loads((tmp_path / "trackers.json").read_text())["mlflow"]
    again = MlflowTracker(TrackedRun("tiny", tmp_path, recipe, {}, resumed_from=1), "tiny", kept)
    assert again.run_id == mlflow.run_id and client.get_run(again.run_id).info.status == "RUNNING"
    again.close("finished")
    assert client.get_run(again.run_id).info.status == "FINISHED"
