"""Where checkpoints go (trnrecipes/jobs/storage.py): a cluster job names shared storage (recipe.run_dir or
$TRNRECIPES_RUNS), `sbatch` and `plan` say how much the checkpoints take and how much is free there, and `sbatch`
refuses a job whose checkpoints cannot fit, writing nothing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import REPO

from trnrecipes.cli import main
from trnrecipes.config.recipe import load_recipe
from trnrecipes.jobs import storage
from trnrecipes.jobs.storage import checkpoint_footprint, run_dir_for, run_dir_problem, storage_report


def test_a_cluster_job_without_shared_storage_is_refused_naming_both_ways(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("TRNRECIPES_RUNS", raising=False)
    out = tmp_path / "job"
    argv = ["sbatch", "--recipe", "llama2-7b", "--nodes", "16", "--out", str(out), "--no-data-check"]
    assert main(argv) == 2 and not out.exists()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        "error: run_dir: llama2-7b-16n (16 nodes) needs its checkpoints on shared storage, not in the checkout:"
        " keep_last 3 x 67.4 GB (+1 while saving); export TRNRECIPES_RUNS=/fsx/runs"
    )
    one_node = ["sbatch", "--recipe", "pythia6.9b", "--nodes", "1", "--out", str(out), "--no-data-check"]
    assert main(one_node) == 2 and "(274.3 GB of checkpoints) needs its checkpoints" in capsys.readouterr().err


def test_trnrecipes_runs_places_the_run_dir_and_sbatch_says_what_fits(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("TRNRECIPES_RUNS", str(tmp_path / "runs"))
    out = tmp_path / "job"
    assert main(["sbatch", "--recipe", "llama2-smoke-trn2", "--nodes", "2", "--out", str(out)]) == 0
    run_dir = tmp_path / "runs/llama2-smoke-trn2-2n"
    assert f"\nRUN_DIR={run_dir}\n" in (out / "run.sbatch").read_text()
    printed = capsys.readouterr().out
    assert f"checkpoints  {run_dir}/checkpoints: 295.0 MB each (bf16 weights + fp32 AdamW moments)" in printed
    assert "keep_last 2 (+1 while saving) = 885.0 MB; " in printed and " free there" in printed
    assert not run_dir.exists()  # said, not made: the trainer makes it


def test_checkpoints_that_cannot_fit_are_refused_and_a_tight_fit_warned(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("TRNRECIPES_RUNS", str(tmp_path / "runs"))
    need = checkpoint_footprint(load_recipe("llama2-smoke-trn2", nodes=2))[1]
    real = shutil.disk_usage

    def free_space(free: int):  # the file system under tmp_path, with this much free
        monkeypatch.setattr(storage.shutil, "disk_usage", lambda p: real(p)._replace(free=free))

    out = tmp_path / "job"
    argv = ["sbatch", "--recipe", "llama2-smoke-trn2", "--nodes", "2", "--out", str(out)]
    free_space(need - 1)
    assert main(argv) == 2 and not out.exists()
    assert "but the checkpoints need 885.0 MB more (keep_last 2 x 295.0 MB + 1 while saving)" in capsys.readouterr().err
    free_space(need + need // 2)
    assert main(argv) == 0 and (out / "run.sbatch").is_file()
    assert "free is less than twice what the checkpoints need (885.0 MB)" in capsys.readouterr().err
    free_space(need - 1)  # plan says so and goes on
    assert main(["plan", "--recipe", "llama2-smoke-trn2", "--nodes", "2"]) == 0
    assert "warning: " in capsys.readouterr().err


def test_checkpoints_already_there_count_toward_the_room_needed(tmp_path, monkeypatch):
    recipe = load_recipe("llama2-smoke-trn2", nodes=2, overrides=f"run_dir={tmp_path / 'run'}")
    step = tmp_path / "run/checkpoints/step_10"
    step.mkdir(parents=True)
    (step / "weights.bin").write_bytes(b"\0" * 1000)
    assert storage._held(tmp_path / "run") == 1000
    most = checkpoint_footprint(recipe)[1]
    real = shutil.disk_usage
    monkeypatch.setattr(storage.shutil, "disk_usage", lambda p: real(p)._replace(free=most - 500))
    assert storage_report(recipe, tmp_path / "run")[2] is None  # 1000 bytes of it are there already
    monkeypatch.setattr(storage.shutil, "disk_usage", lambda p: real(p)._replace(free=most - 1500))
    assert "need" in storage_report(recipe, tmp_path / "run")[2]


def test_local_recipes_keep_the_checkouts_runs_dir_and_paths_resolve_as_before(tmp_path):
    tiny = load_recipe("llama2-tiny", nodes=2)
    assert run_dir_problem(tiny, None) is None and run_dir_for(tiny, REPO, None) == REPO / "runs/llama2-tiny-2n"
    given = load_recipe("llama2-7b", nodes=16, overrides="run_dir=runs/mine")  # named: the user's choice
    assert run_dir_problem(given, None) is None and run_dir_for(given, REPO, None) == REPO / "runs/mine"
    assert run_dir_for(load_recipe("llama2-7b", nodes=16), REPO, "/fsx/runs") == Path("/fsx/runs/llama2-7b-16n")


@pytest.mark.parametrize(
    ("name", "nodes", "gb"), [("llama2-70b", 8, 689.8), ("neox20b", 4, 205.5), ("llama2-7b", 16, 67.4)]
)
def test_a_checkpoint_is_bf16_weights_and_two_fp32_moments(name, nodes, gb, tmp_path):
    recipe = load_recipe(name, nodes=nodes)
    one, most = checkpoint_footprint(recipe)
    assert round(one / 1e9, 1) == gb and most == one * (recipe.checkpoint.keep_last + 1)
    line, warning, error = storage_report(recipe, Path("/nonexistent-fs/runs/x"))
    assert "free space unknown (nonexistent-fs is not there from this host)" in line and not warning and not error


def test_sbatch_refuses_what_the_trainer_would_refuse_of_the_run_dirs_checkpoints(tmp_path, capsys):
    """Found at the job's first second, after its wait in the queue, before: a recipe the run dir's newest
    checkpoint was not trained with, or checkpoint.resume false on a run dir with checkpoints."""
    import yaml

    run = tmp_path / "run"
    trained = load_recipe("pythia-tiny", 1, f"run_dir={run}")
    for step, whole in ((5, True), (10, True), (15, False)):  # step_15: a save cut short, which the trainer skips
        ckpt = run / f"checkpoints/step_{step}"
        ckpt.mkdir(parents=True)
        (ckpt / "recipe.yaml").write_text(yaml.safe_dump(trained.to_dict(), sort_keys=False))
        (ckpt / "state.json").write_text(json.dumps({"step": step, "dp": 2}))  # as trained: two workers
        if whole:
            (ckpt / "done").write_text("")
    (run / "checkpoints/step_15/recipe.yaml").write_text("model: {hidden_size: 7}\n")  # never compared

    def sbatch(*overrides: str) -> tuple[int, str]:
        out = tmp_path / "job"
        shutil.rmtree(out, ignore_errors=True)
        argv = ["sbatch", "--recipe", "pythia-tiny", "--nodes", "1", "--out", str(out)]
        code = main([*argv, "--overrides", " ".join([f"run_dir={run}", *overrides])])
        assert (code == 0) == out.exists()  # refused: nothing written
        return code, capsys.readouterr().err

    assert sbatch("train.max_steps=300") == (0, "")  # free to change
    code, err = sbatch("optim.lr=0.01", "model.hidden_size=256")
    assert code == 2 and f"run dir {run}: the job would resume from step_10, which was trained with another" in err
    assert "model.hidden_size: 128 -> 256 (cannot change on resume); optim.lr: 0.003 -> 0.01; restore" in err, err
    assert sbatch("optim.lr=0.01", "checkpoint.allow_changes=[optim.lr]")[0] == 0
    code, err = sbatch("checkpoint.resume=false")
    assert code == 2 and f"run dir {run} already has checkpoints (step_10 the newest) and checkpoint.resume" in err
    (run / ".fresh_start.json").write_text('{"slurm_job_id": "41"}\n')  # a job started this run at step 0
    code, err = sbatch("checkpoint.resume=false")  # re-rendered for its requeue, which resumes them
    assert code == 0 and "warning: run dir " in err and "a new submission of this job (not the requeue" in err, err
    (run / ".fresh_start.json").unlink()
    assert sbatch("checkpoint.resume=false", "checkpoint.force_fresh=true")[0] == 0
    code, err = sbatch("train.seed=7")  # other data order: the saved data position would index other documents
    assert code == 2 and "train.seed: 1234 -> 7; restore" in err, err
    code, err = sbatch("cluster.workers_per_node=1")  # each data-parallel rank's position is its own
    assert code == 2 and "data-parallel size 2 -> 1 (name layout.dp to restart the data stream); restore" in err, err
    assert sbatch("cluster.workers_per_node=1", "checkpoint.allow_changes=[layout.dp]")[0] == 0
