"""monitor.profile_steps and monitor.trackers: a profiled window writes a Chrome trace of those steps' forward ops
(and only when they end); the step line, metrics and plan say which steps are profiled; on torch-xla + NxD the
rendered run.sbatch sets the Neuron runtime's capture for the training step and nothing profiles in process; no
tracker writes no TensorBoard events; bad windows are refused naming the value."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from test_train import run

from trnrecipes.config.profiling import describe, neuron_profile_env
from trnrecipes.config.recipe import load_recipe
from trnrecipes.config.sections import RecipeError
from trnrecipes.jobs.render import render_job
from trnrecipes.train.profile import rank_env


def trace_events(path: Path) -> list[dict]:
    return json.loads(path.read_text())["traceEvents"]


def test_a_profiled_window_writes_a_trace_of_those_steps_forward_and_backward(tmp_path: Path, capsys):
    result, _ = run(
        "llama2-tiny", tmp_path, "monitor.profile_steps=[2,3]", "monitor.trackers=[]", "train.log_every=1", steps=4
    )
    assert len(result.losses) == 4
    (trace,) = (tmp_path / "profile").iterdir()
    assert trace.name == "rank0-steps2-3.json"
    names = {e.get("name") for e in trace_events(trace)}
    assert {"trnrecipes step 2", "trnrecipes step 3"} <= names and "trnrecipes step 1" not in names
    assert "trnrecipes step 4" not in names
    assert {"aten::mm", "aten::embedding"} & names and any("Backward" in str(n) for n in names)  # forward, backward
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("profiled", False) for r in records] == [False, True, True, False]
    out = capsys.readouterr().out
    assert "profiling steps 2-3 on the first rank of each node with torch.profiler" in out
    assert "| profiled" in out and f"profile of steps 2-3: {trace}" in out
    assert not (tmp_path / "tensorboard").exists()  # monitor.trackers []: no TensorBoard writer


def test_on_nxd_the_capture_is_kept_by_the_first_rank_of_each_node_of_a_launch_that_trains_the_window(
    monkeypatch, tmp_path
):
    recipe = load_recipe("llama2-7b", 4, ["monitor.profile_steps=[5,6]"])
    for rank, local_rank, expected in ((0, 0, "1"), (32, 0, "1"), (33, 1, "0"), (5, 5, "0")):
        monkeypatch.setenv("NEURON_RT_INSPECT_ENABLE", "1")  # as run.sbatch exports it to every worker
        rank_env(recipe, rank, local_rank, str(tmp_path))
        assert os.environ["NEURON_RT_INSPECT_ENABLE"] == expected, (rank, local_rank)
    everyone = load_recipe("llama2-7b", 4, ["monitor.profile_steps=[5,6]", "monitor.profile_ranks=all"])
    monkeypatch.setenv("NEURON_RT_INSPECT_ENABLE", "1")
    rank_env(everyone, 33, 1, str(tmp_path))
    assert os.environ["NEURON_RT_INSPECT_ENABLE"] == "1"
    for step, expected in ((5, "1"), (6, "0")):  # a requeued launch resuming inside the window, then past it
        (tmp_path / f"checkpoints/step_{step}").mkdir(parents=True)
        (tmp_path / f"checkpoints/step_{step}/done").touch()
        (tmp_path / f"checkpoints/step_{step + 10}").mkdir()  # an incomplete one does not count
        monkeypatch.setenv("NEURON_RT_INSPECT_ENABLE", "1")
        rank_env(recipe, 0, 0, str(tmp_path))
        assert os.environ["NEURON_RT_INSPECT_ENABLE"] == expected, step


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["monitor.profile_steps=[3,2]"], "monitor.profile_steps [3, 2]: the first step comes after the last"),
        (["monitor.profile_steps=[2,101]"], "step 101 is past train.max_steps 100"),
        (["monitor.profile_steps=[0,2]"], "monitor.profile_steps: must be > 0"),
        (["monitor.trackers=[tensorboard,tensorboard]"], "monitor.trackers: each tracker once"),
        (["monitor.trackers=[neptune]"], "monitor.trackers[0]: expected one of 'tensorboard', 'mlflow', 'wandb', got"),
        # the profiler holds the window in host memory: 60 steps of the tiny model took 1.1 GB more
        (["monitor.profile_steps=[2,60]"], "monitor.profile_steps [2, 60]: 59 steps, at most 20: the profiler holds"),
        # wandb.init's UsageError came after the model was built, as a traceback and exit 1 (a requeue)
        (["monitor.trackers=[wandb]", "monitor.wandb_project=team/run#1"], "W&B takes at most 128 characters, none of"),
        (
            ["monitor.trackers=[mlflow]", f"monitor.mlflow_experiment={'x' * 501}"],
            "MLflow takes at most 500 characters",
        ),
        # the rate fell from its peak to min_lr in one step
        (["optim.warmup_steps=50", "optim.decay_steps=50"], "optim.decay_steps 50 must be > optim.warmup_steps 50"),
    ],
)
def test_bad_monitor_settings_are_refused_naming_the_value(overrides, message):
    with pytest.raises(RecipeError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_recipe("pythia-tiny", 1, overrides)


def test_on_nxd_run_sbatch_sets_the_runtime_capture_for_the_training_step_only(tmp_path: Path):
    recipe = load_recipe("llama2-7b", 4, ["monitor.profile_steps=[5,6]"])
    assert recipe.stack == "xla-nxd"
    job = render_job(recipe, tmp_path / "job", "test")
    run_sbatch, compile_sbatch = job.files["run.sbatch"], job.files["compile.sbatch"]
    env = dict((name, value) for name, value, _ in neuron_profile_env(recipe))
    assert env["NEURON_RT_INSPECT_ENABLE"] == "1" and env["NEURON_RT_INSPECT_DEVICE_PROFILE"] == "1"
    assert env["NEURON_RT_INSPECT_SYSTEM_PROFILE"] == "0"
    head, train = run_sbatch.split("# ---- Train ----")
    assert "export NEURON_RT_INSPECT_ENABLE=1" in head.split("# ---- Profiling")[1]  # after the health checks
    run_dir = re.search(r"^RUN_DIR=(\S+)$", run_sbatch, re.M).group(1)
    assert f"export NEURON_RT_INSPECT_OUTPUT_DIR={run_dir}/profile/neuron " in run_sbatch
    assert "NEURON_RT_INSPECT" not in compile_sbatch and "NEURON_RT_INSPECT" not in run_sbatch.split("# ---- Pre")[0]
    unset = next(line for line in train.splitlines() if line.startswith("unset NEURON_RT_INSPECT_ENABLE"))
    assert (
        train.index("training exited") < train.index(unset) < train.index("then diagnose; fi")
    )  # not for the health check
    assert "each graph's first execution" in describe(recipe) and "view -d RUN_DIR/profile/neuron" in describe(recipe)
    plain = render_job(load_recipe("llama2-7b", 4), tmp_path / "plain", "test")
    assert "NEURON_RT_INSPECT" not in plain.files["run.sbatch"]


def test_plan_says_which_steps_are_profiled(cli):
    done = cli("plan", "--recipe", "pythia-tiny", "--nodes", "1", "--overrides", "monitor.profile_steps=[3,4]")
    assert done.returncode == 0, done.stderr
    assert "profiling steps 3-4 on the first rank of each node with torch.profiler" in done.stdout
    quiet = cli("plan", "--recipe", "pythia-tiny", "--nodes", "1")
    assert "profiling" not in quiet.stdout


def test_a_trace_or_tensorboard_dir_that_cannot_be_written_is_one_line_not_a_traceback(tmp_path: Path):
    """A profile/ or tensorboard/ that is a file here stands for a full or read-only disk: the trace is lost with a
    warning and training goes on (it raised before the step's checkpoint: exit 1, a requeue); TensorBoard is refused
    in one line (exit 2) before the first step."""
    from trnrecipes.train.monitor import Metrics
    from trnrecipes.train.profile import StepProfiler

    recipe = load_recipe("pythia-tiny", 1, ["monitor.profile_steps=[1,2]"])
    (tmp_path / "profile").write_text("not a directory")
    said: list[str] = []
    profiler = StepProfiler(recipe, tmp_path, rank=0, local_rank=0, device_type="cpu", log=said.append)
    for step in (1, 2):
        with profiler.start_step(step):
            pass
        profiler.end_step(step)
    assert len(said) == 1 and said[0].startswith("[trnrecipes] warning: the profile of steps 1-2 could not be written")
    (tmp_path / "tensorboard").write_text("not a directory")
    with pytest.raises(RecipeError, match=r"TensorBoard cannot write .*tensorboard \(File exists\); make it"):
        Metrics(tmp_path, True, tensorboard=True, resumed_from=0)


def test_a_checkpoint_saved_before_the_launch_checks_still_loads(tmp_path: Path):
    """The profile window's cap, decay_steps > warmup_steps and the trackers' name rules refuse a launch; a
    checkpoint saved with such settings before they existed is read back for eval, convert, init_from, resume."""
    import torch
    import yaml

    from trnrecipes.checkpoint import write_model_checkpoint
    from trnrecipes.checkpoint.format import checkpoint_recipe

    ckpt = write_model_checkpoint(tmp_path / "ck", {"w": torch.zeros(4)}, load_recipe("pythia-tiny"))
    saved = yaml.safe_load((ckpt / "recipe.yaml").read_text())
    saved["monitor"]["profile_steps"] = [5, 40]
    saved["optim"]["warmup_steps"] = saved["optim"]["decay_steps"] = 50
    (ckpt / "recipe.yaml").write_text(yaml.safe_dump(saved))
    assert checkpoint_recipe(ckpt).monitor.profile_steps == (5, 40)
    with pytest.raises(RecipeError, match="36 steps, at most 20"):  # launching it is refused
        load_recipe(str(ckpt / "recipe.yaml"))
