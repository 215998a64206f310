"""The pre-flight never crashes into a requeue: a failure of the check itself, a job Python that cannot run
trnrecipes, a path this user cannot search, neuron-ls output that is not its JSON, a recipe value with a newline:
each is one `error:` line and exit 2 (bad input, never requeued), and the files checked are the ones named on the
command line, from the caller's directory. Through the real CLI and the generated scripts (plain bash)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml
from conftest import REPO, run_cli
from neuron_standin import env_with, megatron_corpus, neuron_ls, standin_venv

NOBODY = 65534
SETPRIV = Path("/usr/bin/setpriv")
AS_ROOT = os.geteuid() == 0


def errors(done: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("error:")]


def render(tmp_path: Path, recipe: str = "llama2-tiny", *overrides: str) -> Path:
    out = tmp_path / "job"
    args = ["sbatch", "--recipe", recipe, "--nodes", "1", "--out", str(out), "--no-data-check"]
    done = run_cli(*args, "--overrides", " ".join([f"run_dir={tmp_path / 'run'}", *overrides]))
    assert done.returncode == 0, done.stderr
    return out


def python_without(tmp_path: Path, keep: tuple[str, ...]) -> Path:
    """A real interpreter that has the standard library and only the `keep` packages of this venv (no site)."""
    site = tmp_path / "few-packages"
    site.mkdir()
    for name in keep:
        found = Path(__import__(name).__file__).parent
        (site / name).symlink_to(found)
    python = tmp_path / "bin/python"
    python.parent.mkdir()
    python.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} -S "$@"\n')
    python.chmod(0o755)
    return python


def test_a_job_python_without_jinja2_is_told_what_is_missing_not_crashed(tmp_path):
    """The doctor imported the renderer (jinja2) before it checked packages: ModuleNotFoundError, exit 1, requeue."""
    job = render(tmp_path)
    python = python_without(tmp_path, ("yaml",))
    env = {**os.environ, "TRNRECIPES_PYTHON": str(python)}
    done = subprocess.run(["bash", str(job / "run.sbatch")], capture_output=True, text=True, env=env, timeout=120)
    out = done.stdout + done.stderr
    assert done.returncode == 2, out
    assert "Traceback" not in out and "ModuleNotFoundError" not in out
    assert errors(done) and all(f"not installed in {python}" in line for line in errors(done)), out
    assert "requeueing" not in out and not (tmp_path / "run").exists()


@pytest.mark.parametrize("fake", ["/bin/true", "/bin/echo"])
def test_a_job_python_that_is_not_python_is_an_error_not_a_pass(tmp_path, fake):
    job = render(tmp_path)
    done = run_cli("doctor", "--config", str(job / "recipe.yaml"), env={"TRNRECIPES_PYTHON": fake})
    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = errors(done)
    assert f"the job's Python {fake} is not a Python that imports trnrecipes from {REPO}" in line
    env = {**os.environ, "TRNRECIPES_PYTHON": fake}
    script = subprocess.run(["bash", str(job / "run.sbatch")], capture_output=True, text=True, env=env, timeout=120)
    assert script.returncode == 2 and f"the job's Python {fake} is not a Python 3.10+" in errors(script)[0]
    assert not (tmp_path / "run").exists()


def test_relative_paths_name_the_callers_files_not_the_checkouts(tmp_path):
    """doctor re-runs itself under the job's Python in the checkout: a relative --config must still be the caller's."""
    job = render(tmp_path, "llama2-tiny", f"data.path={tmp_path / 'nowhere.arrow'}")
    python = standin_venv(tmp_path / "venv", "2.26")  # this interpreter by another name: the doctor re-runs
    rel = os.path.relpath(job / "recipe.yaml", tmp_path)
    done = run_cli("doctor", "--config", rel, cwd=tmp_path, env={"TRNRECIPES_PYTHON": str(python)})
    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = errors(done)
    assert f"data.path {tmp_path / 'nowhere.arrow'}: {tmp_path / 'nowhere.arrow'} does not exist" in line


@pytest.mark.parametrize(
    ("printed", "shown"),
    [
        ('[{"nc_count": null}]', '[{"nc_count": null}]'),
        ('[{"nc_count": 1e400}]', "1e400"),
        ("neuron-ls: driver not loaded", "driver not loaded"),
    ],
)
def test_neuron_ls_output_that_is_not_its_json_is_named_exit_2(tmp_path, printed, shown):
    prefix = megatron_corpus(tmp_path / "data/wiki")
    job = render(tmp_path, "pythia-70m", f"data.path={prefix}")
    python = standin_venv(tmp_path / "venv", "2.26")
    tool = neuron_ls(tmp_path / "bin", devices=16, cores_per_device=2)
    tool.write_text(f"#!/bin/sh\ncat <<'EOF'\n{printed}\nEOF\n")
    env = env_with(tmp_path / "bin", TRNRECIPES_PYTHON=str(python))
    done = subprocess.run(["bash", str(job / "compile.sbatch")], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = errors(done)
    assert f"{tool} -j printed " in line and shown in line and "not its JSON list of devices" in line
    assert "Traceback" not in done.stdout + done.stderr


def test_a_neuron_ls_that_fails_is_this_nodes_fault_exit_1_not_bad_input(tmp_path):
    """A driver that cannot open a device is the node's: exit 1 (resubmit without it), not 2 (fix the input)."""
    prefix = megatron_corpus(tmp_path / "data/wiki")
    job = render(tmp_path, "pythia-70m", f"data.path={prefix}")
    python = standin_venv(tmp_path / "venv", "2.26")
    tool = neuron_ls(tmp_path / "bin", devices=16, cores_per_device=2)
    tool.write_text("#!/bin/sh\necho 'Failed to open /dev/neuron0' >&2\nexit 1\n")
    env = env_with(tmp_path / "bin", TRNRECIPES_PYTHON=str(python))
    done = subprocess.run(["bash", str(job / "compile.sbatch")], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"{tool} -j failed (exit 1): Failed to open /dev/neuron0" in done.stdout + done.stderr


def test_a_value_with_a_newline_is_refused_at_render_and_by_the_doctor(tmp_path):
    bad = f"{tmp_path}/run\nx"
    done = run_cli("sbatch", "--recipe", str(job_recipe_with(tmp_path, run_dir=bad)), "--nodes", "1", "--out",
                   str(tmp_path / "job2"), "--no-data-check")  # fmt: skip
    assert done.returncode == 2 and not (tmp_path / "job2").exists()
    assert "run_dir '" in done.stderr and "contains a control character (newline, tab, ...)" in done.stderr
    job = render(tmp_path)  # a job dir made before the check: its recipe and script hold the newline
    recipe = yaml.safe_load((job / "recipe.yaml").read_text())
    (job / "recipe.yaml").write_text(yaml.safe_dump({**recipe, "run_dir": bad}))
    script = (job / "run.sbatch").read_text().replace(f"RUN_DIR={tmp_path}/run", f"RUN_DIR='{bad}'")
    (job / "run.sbatch").write_text(script)
    done = run_cli("doctor", "--config", str(job / "recipe.yaml"))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stdout + done.stderr
    (line,) = [x for x in done.stdout.splitlines() if "control character" in x]
    assert "run_dir" in line


def job_recipe_with(tmp_path: Path, **values: str) -> Path:
    recipe = yaml.safe_load((REPO / "recipes/llama2/llama2-tiny.yaml").read_text())
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump({**recipe, **values}))
    return path


@pytest.fixture
def shared():
    """A directory every user can write (pytest's tmp_path is root's alone), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="trnrecipes-preflight-"))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def as_user(cmd: list[str], cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    """`cmd` as an unprivileged user: nobody when the tests run as root (root passes every mode bit)."""
    if AS_ROOT:
        if not SETPRIV.exists():
            pytest.fail(f"running as root, these tests run as nobody with {SETPRIV} (util-linux): install it")
        cmd = [str(SETPRIV), f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--", *cmd]
    env = {**os.environ, "HOME": "/tmp", "PYTHONDONTWRITEBYTECODE": "1", "MPLCONFIGDIR": "/tmp"}
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.parametrize("what", ["corpus", "run dir"])
def test_a_path_this_user_cannot_search_is_named_by_sbatch_plan_and_doctor(shared, what):
    """PermissionError tracebacks (exit 1: the job was requeued into the same failure) become one line."""
    private = shared / "private"
    private.mkdir(mode=0o700)  # root's (or this user's alone, with its mode taken away below)
    corpus = REPO / "data/demo/pythondocs.arrow"
    if what == "corpus":
        shutil.copy(corpus, private / "c.arrow")
        overrides = [f"data.path={private / 'c.arrow'}", f"run_dir={shared / 'run'}"]
    else:
        overrides = [f"run_dir={private / 'run'}"]
    if not AS_ROOT:
        private.chmod(0)
    py = [sys.executable, "-m", "trnrecipes"]
    args = ["--recipe", "llama2-tiny", "--nodes", "1", "--overrides", " ".join(overrides)]
    reason = f"{private} is not searchable by user "
    done = as_user([*py, "sbatch", *args, "--out", str(shared / "x")])
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert reason in done.stderr and not (shared / "x").exists()
    planned = as_user([*py, "plan", *args])
    assert planned.returncode == 0 and "Traceback" not in planned.stderr, planned.stderr
    assert reason in planned.stderr
    job = render(shared, "llama2-tiny", *overrides[:1]) if what == "corpus" else render(shared)
    doctor = [sys.executable, "-m", "trnrecipes.ops.doctor", "--config", str(job / "recipe.yaml"), "--python"]
    doctor += [sys.executable]
    doctor += ["--run-dir", str(private / "run")] if what == "run dir" else []
    checked = as_user(doctor)
    assert checked.returncode == 2 and "Traceback" not in checked.stdout + checked.stderr, checked.stdout
    (line,) = errors(checked)
    assert reason in line and ("data.path" in line if what == "corpus" else "run dir" in line)
