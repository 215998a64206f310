"""`trnrecipes sbatch` and `make ... sbatch`: the job dir, and the table of bad inputs that must write nothing and
run nothing."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import uuid

import pytest
from conftest import REPO

from trnrecipes.config.recipe import load_recipe
from trnrecipes.jobs.render import render_job


def make(*args: str, cwd=REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["make", "--no-print-directory", *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_sbatch_writes_the_job_dir_and_says_what_to_run_next(cli, tmp_path):
    out = tmp_path / "jobs" / "n20"
    runs = {"TRNRECIPES_RUNS": str(tmp_path / "runs")}  # a cluster job's checkpoints go to shared storage
    done = cli("sbatch", "--recipe", "neox20b", "--nodes", "4", "--no-data-check", "--out", str(out), env=runs)
    assert done.returncode == 0, done.stderr
    names = ["compile.sbatch", "eval.sbatch", "logs", "provenance.json", "recipe.yaml", "run.sbatch"]
    assert sorted(p.name for p in out.iterdir()) == names
    assert os.access(out / "run.sbatch", os.X_OK) and os.access(out / "eval.sbatch", os.X_OK)
    assert "TP 8 x PP 4 x DP 4" in done.stdout and f"--dependency=afterok:$id {out}/run.sbatch" in done.stdout
    # on trn1 the model is scored on a GPU node, not by eval.sbatch on a training node (tests/test_eval_job.py)
    assert f"  make eval ckpt={tmp_path / 'runs' / 'neox20b-4n'}   # when run.sbatch is done" in done.stdout
    # the eval job takes one node whatever the training layout
    assert (
        "#SBATCH --nodes=1\n" in (out / "eval.sbatch").read_text()
        and "EXPECTED_NODES=1\n" in (out / "eval.sbatch").read_text()
    )
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["command"] == f"trnrecipes sbatch --recipe neox20b --nodes 4 --out {out}"
    assert prov["layout"]["dp"] == 4 and "git_sha" in prov
    # The resolved recipe is a complete recipe: loading it again gives the same thing.
    assert load_recipe(str(out / "recipe.yaml")) == load_recipe("neox20b", nodes=4)


def test_rerendering_keeps_logs_and_needs_force_to_change_the_recipe(cli, tmp_path):
    out = tmp_path / "job"
    assert cli("sbatch", "--recipe", "pythia-tiny", "--nodes", "1", "--out", str(out)).returncode == 0
    assert (out / "logs").is_dir()  # Slurm's --output needs it before the job starts
    (out / "logs" / "old.out").write_text("keep me")
    assert cli("sbatch", "--recipe", "pythia-tiny", "--nodes", "1", "--out", str(out)).returncode == 0  # same recipe
    assert os.access(out / "run.sbatch", os.X_OK)  # replaced through a temp name: it made them 0644 once
    rendered = (out / "run.sbatch").read_text()
    (out / "run.sbatch").write_text(rendered + "# a fix of my own\n")  # edited by hand: moved aside, not lost
    prov = json.loads((out / "provenance.json").read_text())
    (out / "compile.sbatch").write_text("# as an older template rendered it\n")
    prov["files"]["compile.sbatch"] = hashlib.sha256(b"# as an older template rendered it\n").hexdigest()
    (out / "provenance.json").write_text(json.dumps(prov))
    done = cli("sbatch", "--recipe", "pythia-tiny", "--nodes", "1", "--out", str(out))
    assert done.returncode == 0, done.stderr
    (aside,) = [p for p in out.iterdir() if ".edited-" in p.name]
    assert aside.name.startswith("run.sbatch.edited-") and aside.read_text() == rendered + "# a fix of my own\n"
    assert f"note: run.sbatch: edited since it was rendered; moved to {aside.name}, not lost" in done.stdout
    assert (out / "run.sbatch").read_text() == rendered and "# as an older" not in (out / "compile.sbatch").read_text()
    aside.unlink()
    # a job dir an older trnrecipes rendered (no record): a script changed after its provenance.json is an edit,
    # one as old as it is an older template's, replaced without a copy (the first re-render after an upgrade)
    prov = json.loads((out / "provenance.json").read_text())
    del prov["files"]
    (out / "provenance.json").write_text(json.dumps(prov))
    (out / "compile.sbatch").write_text("# an older template's\n")
    os.utime(out / "compile.sbatch", (0, 0))
    (out / "run.sbatch").write_text(rendered + "# mine\n")
    os.utime(out / "provenance.json", (1, 1))
    done = cli("sbatch", "--recipe", "pythia-tiny", "--nodes", "1", "--out", str(out))
    assert done.returncode == 0 and [p.name[:19] for p in out.iterdir() if ".edited-" in p.name] == [
        "run.sbatch.edited-2"
    ], done.stdout
    assert "note: run.sbatch: changed after it was rendered (by an older trnrecipes" in done.stdout
    for p in out.glob("*.edited-*"):
        p.unlink()
    args = ["sbatch", "--recipe", "pythia-tiny", "--nodes", "1", "--out", str(out), "--overrides", "optim.lr=1e-3"]
    done = cli(*args)
    assert done.returncode == 2 and "already holds a different recipe.yaml" in done.stderr
    assert load_recipe(str(out / "recipe.yaml")).optim.lr == 3e-3  # untouched
    done = cli(*args, "--force")
    assert done.returncode == 0, done.stderr
    assert (out / "logs" / "old.out").read_text() == "keep me"
    assert load_recipe(str(out / "recipe.yaml")).optim.lr == 1e-3
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temp files left


def test_a_forced_rerender_says_what_it_drops_and_leaves_no_other_recipes_script(cli, tmp_path):
    out = tmp_path / "job"
    assert cli("sbatch", "--recipe", "bert-tiny", "--nodes", "1", "--out", str(out)).returncode == 0
    assert (out / "infer.sbatch").is_file()
    done = cli("sbatch", "--recipe", "pythia-tiny", "--nodes", "1", "--out", str(out), "--force")
    assert done.returncode == 0, done.stderr
    assert "  infer.sbatch: removed (of the job it replaces; this recipe has none)" in done.stdout
    assert not (out / "infer.sbatch").exists()  # it would have run bert's inference on pythia's recipe.yaml
    with open(out / "recipe.yaml", "a") as f:
        f.write("# lr tuned on 2024-01-01\n")  # a user's note: the same settings, more text
    done = cli("sbatch", "--recipe", "pythia-tiny", "--nodes", "1", "--out", str(out))
    assert done.returncode == 2, done.stdout
    assert "no setting: comments or layout edited in it, which the new recipe.yaml does not keep" in done.stderr
    (out / "infer.sbatch").write_text("#!/bin/bash\n# my own\n")
    assert cli("sbatch", "--recipe", "pythia-tiny", "--nodes", "1", "--out", str(out), "--force").returncode == 0
    assert (out / "infer.sbatch").read_text() == "#!/bin/bash\n# my own\n"  # not one trnrecipes wrote: kept


def test_out_dir_that_is_not_a_job_dir_is_written_only_with_force(cli, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "run.sbatch").write_text("my own script")
    (out / "notes.txt").write_text("keep")
    args = ["sbatch", "--recipe", "pythia-tiny", "--nodes", "1", "--out", str(out)]
    done = cli(*args)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"{out} is not empty and is not a job dir `trnrecipes sbatch` wrote" in done.stderr
    assert "would replace its run.sbatch" in done.stderr and "--force" in done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "run.sbatch"]
    assert (out / "run.sbatch").read_text() == "my own script"
    assert cli(*args, "--force").returncode == 0
    assert (out / "notes.txt").read_text() == "keep" and (out / "recipe.yaml").exists()
    assert cli(*args).returncode == 0  # now it is a job dir: re-rendering the same recipe needs no force
    (tmp_path / "empty").mkdir()
    assert cli("sbatch", "--recipe", "pythia-tiny", "--nodes", "1", "--out", str(tmp_path / "empty")).returncode == 0
    (tmp_path / "file").write_text("x")
    done = cli("sbatch", "--recipe", "pythia-tiny", "--nodes", "1", "--out", str(tmp_path / "file"))
    assert done.returncode == 2 and "exists and is not a directory" in done.stderr


def test_make_sbatch_default_job_dir(tmp_path):
    done = make("recipe=llama2-tiny", "nodes=2", "sbatch", "overrides=train.max_steps=7 slurm.partition=debug")
    job = REPO / "jobs" / "llama2-tiny-2n"
    try:
        assert done.returncode == 0, done.stderr
        assert "#SBATCH --partition=debug" in (job / "run.sbatch").read_text()
        assert load_recipe(str(job / "recipe.yaml")).train.max_steps == 7
    finally:
        subprocess.run(["rm", "-rf", str(job)], check=True)


def _canary() -> str:
    return f"/tmp/trnrecipes-canary-{uuid.uuid4().hex}"


# (make variables, message): each must fail with exit != 0, name the problem, write no job dir, run nothing.
BAD_MAKE_INPUTS = [
    ({"recipe": "neox21b", "nodes": "4"}, "unknown recipe 'neox21b'; known recipes: "),
    ({"recipe": "neox20b", "nodes": "0"}, "nodes must be a whole number from 1 to 100,000, got '0'"),
    ({"recipe": "neox20b", "nodes": "-1"}, "nodes must be a whole number from 1 to 100,000, got '-1'"),
    ({"recipe": "neox20b", "nodes": "abc"}, "nodes must be a whole number from 1 to 100,000, got 'abc'"),
    ({"recipe": "neox20b", "nodes": "3"}, "global_batch 256 is not divisible by micro_batch 1 x data-parallel 3"),
    ({"recipe": "neox20b", "nodes": "4", "overrides": "optim.lrr=1"}, "optim.lrr: unknown key"),
    ({"recipe": "neox20b", "nodes": "4", "overrides": "batch.micro_batch=two"}, "expected an integer, got 'two'"),
    ({"recipe": "neox20b", "nodes": "4;touch CANARY"}, "nodes must be a whole number from 1 to 100,000, got '4;touch"),
    ({"recipe": "neox20b", "nodes": "$(touch CANARY)"}, "nodes must be a whole number from 1 to 100,000"),
    ({"recipe": "neox20b", "nodes": "`touch CANARY`"}, "nodes must be a whole number from 1 to 100,000"),
    ({"recipe": "neox20b", "nodes": "$(shell touch CANARY)"}, "nodes must be a whole number from 1 to 100,000"),
    ({"recipe": "neox20b;touch CANARY", "nodes": "4"}, "unknown recipe 'neox20b;touch"),
    ({"recipe": "neox20b", "nodes": "4", "overrides": "slurm.job_name='$(touch CANARY)'"}, "slurm.job_name '$(touch"),
    ({"recipe": "neox20b", "nodes": "4", "overrides": "slurm.partition='a;touch CANARY'"}, "slurm.partition 'a;touch"),
    ({"recipe": "neox20b", "nodes": "4", "out": "jobs/x y"}, "job directory"),
    ({"recipe": "neox20b", "nodes": "4", "overrides": "data.path='a b"}, "cannot be split into words (No closing"),
]


@pytest.mark.parametrize(("variables", "message"), BAD_MAKE_INPUTS, ids=[str(v) for v, _ in BAD_MAKE_INPUTS])
def test_bad_input_fails_cleanly_through_make(variables, message, tmp_path):
    canary = _canary()
    variables = {k: v.replace("CANARY", canary) for k, v in variables.items()}
    variables.setdefault("out", str(tmp_path / "job"))
    jobs_before = sorted((REPO / "jobs").glob("*")) if (REPO / "jobs").exists() else []
    done = make(*(f"{k}={v}" for k, v in variables.items()), "sbatch")
    assert done.returncode != 0
    assert message.replace("CANARY", canary) in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert not os.path.exists(canary), "a user value was executed by the shell"
    assert not (tmp_path / "job").exists()
    assert not (REPO / "jobs" / "x y").exists()
    assert (sorted((REPO / "jobs").glob("*")) if (REPO / "jobs").exists() else []) == jobs_before


def test_missing_make_variables_print_usage():
    done = make("sbatch")
    assert done.returncode != 0 and "usage: make recipe=NAME nodes=N sbatch" in done.stderr


def test_user_values_inside_scripts_are_quoted_not_executed(tmp_path):
    canary = _canary()
    weird = f"{tmp_path}/it's a $(touch {canary}) `dir`; x"
    recipe = load_recipe("neox-tiny", nodes=1, overrides=[f"run_dir={weird}", f"cluster.python={weird}/python"])
    job = render_job(recipe, tmp_path / "job", "cmd")
    (tmp_path / "run.sbatch").write_text(job.files["run.sbatch"])
    # Source only the settings block and print what bash sees.
    settings = f"sed -n '/^JOB_DIR=/,/^WORKERS_PER_NODE=/p' {tmp_path}/run.sbatch"
    probe = f"""set -eu; eval "$({settings})"; printf '%s\\n' "$RUN_DIR" "$PYTHON" """
    done = subprocess.run(["bash", "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [weird, f"{weird}/python"]
    assert not os.path.exists(canary)
