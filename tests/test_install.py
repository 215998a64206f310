"""Installs that fit where they land (pyproject.toml): the `neuron` extra resolves together with each Neuron stack's
published pins (tests/constraints/: torch, torch-xla, transformers, numpy, protobuf as the DLAMI venvs hold them) and
changes none of them; a conflicting pin fails the same check; and the core install (PyYAML, Jinja2) renders jobs in a
fresh venv without torch, through the CLI and `make ... sbatch`. These resolve against the package registry (pip
--dry-run: metadata only, nothing installed)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from conftest import REPO

pytestmark = pytest.mark.slow
CONSTRAINTS = sorted((REPO / "tests/constraints").glob("neuron-*.txt"))
PINNED = ("torch", "torch-xla", "transformers", "numpy", "protobuf")


# What a source build reads; the rest of a checkout (venvs, runs, data, build outputs) is left behind. Top-level
# names only: trnrecipes/data is a package.
CHECKOUT_ONLY = {".git", ".venv", ".venv-xla", "build", "runs", "jobs", "data", "wheels", "trnrecipes.egg-info",
                 ".pytest_cache", ".ruff_cache"}  # fmt: skip


def not_sources(directory: str, names: list[str]) -> set[str]:
    return {n for n in names if n == "__pycache__" or (Path(directory) == REPO and n in CHECKOUT_ONLY)}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a copy of the sources: setuptools builds in the source tree (build/, *.egg-info, whose
    bdist dir each build deletes when done), and each xdist worker running a test of this file builds its own, at
    the same time as the other's or an editable install's (CI once failed copying into a bdist dir just deleted)."""
    sources = tmp_path_factory.mktemp("sources") / "trnrecipes"
    shutil.copytree(REPO, sources, ignore=not_sources)
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(sources)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    (found,) = out.glob("trnrecipes-*.whl")
    return found


def start_dry_run(requirement: str, constraints: Path, report: Path) -> subprocess.Popen[str]:
    """Start resolving `requirement` with the stack's packages requested too, each held to the constraints file's
    pin, for the stack's Python; nothing is installed."""
    python = re.search(r"^# python: (\S+)$", constraints.read_text(), re.M)[1]
    pinned = [line.split("=")[0] for line in constraints.read_text().splitlines() if line and not line.startswith("#")]
    # fast-deps: where the index serves no PEP 658 metadata files (as this machine's mirror), each wheel's METADATA
    # by HTTP range requests, not the whole wheel (torch and its CUDA wheels are about 3 GB a stack: 25 s of pip
    # for torch alone against 4 s); where it serves them (PyPI), pip reads those and the flag changes nothing
    argv = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report",
            str(report), "--python-version", python, "--only-binary=:all:", "--use-feature=fast-deps",
            "-c", str(constraints), requirement, *pinned]  # fmt: skip
    # pip --quiet writes little; a failed resolution's report fits a pipe (64 KB) before communicate() reads it
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finished(proc: subprocess.Popen[str]) -> subprocess.CompletedProcess[str]:
    try:
        out, err = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def dry_run(requirement: str, constraints: Path, report: Path) -> subprocess.CompletedProcess[str]:
    return finished(start_dry_run(requirement, constraints, report))


@pytest.fixture(scope="module")
def resolving(wheel, tmp_path_factory) -> dict[str, tuple[subprocess.Popen[str], Path]]:
    """The neuron extra's resolution for every stack, started at once: pip's dry runs mostly wait on the registry, so
    they run side by side (one after another they took about 5 minutes)."""
    started = {}
    for constraints in CONSTRAINTS:
        report = tmp_path_factory.mktemp(constraints.stem) / "report.json"
        started[constraints.stem] = (start_dry_run(f"{wheel}[neuron]", constraints, report), report)
    yield started
    for proc, _ in started.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.parametrize("constraints", CONSTRAINTS, ids=[c.stem for c in CONSTRAINTS])
def test_the_neuron_extra_resolves_with_each_stacks_pins_and_changes_none(resolving, constraints):
    proc, report = resolving[constraints.stem]
    done = finished(proc)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    chosen = {
        i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]
    }
    for line in constraints.read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            assert re.fullmatch(version.replace(".", r"\.").replace("*", ".*"), chosen[name]), (name, chosen[name])
    assert not {"torch-neuronx", "neuronx-cc", "neuronx-distributed"} & set(chosen)
    assert {"numpy", "pyarrow", "safetensors", "tokenizers", "tensorboard", "megatron-core"} <= set(chosen)


def test_a_pin_that_fights_a_stack_fails_the_same_check(tmp_path):
    """The neuron extra plus numpy>=2 (what .[train-deps] pins) cannot live with NxD's numpy 1.25.2: the check fails."""
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["neuron"]
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=68"]\nbuild-backend = "setuptools.build_meta"\n'
        f'[project]\nname = "trnrecipes-probe"\nversion = "0"\ndependencies = {json.dumps([*extra, "numpy>=2"])}\n'
        "[tool.setuptools]\npy-modules = []\n"
    )
    done = dry_run(str(probe), REPO / "tests/constraints/neuron-2.26.txt", tmp_path / "report.json")
    assert done.returncode != 0
    assert "numpy" in done.stderr and ("conflict" in done.stderr.lower() or "ResolutionImpossible" in done.stderr)


def test_the_core_install_renders_in_a_fresh_venv_without_torch(tmp_path):
    """`pip install -e .` (no extras: PyYAML and Jinja2) in a new venv, then plan and sbatch; and `make ... sbatch`
    with a fresh VENV sets up only that."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin/python"
    done = subprocess.run([str(py), "-m", "pip", "install", "-q", "-e", str(REPO)], capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    env = {**os.environ, "TRNRECIPES_RUNS": str(tmp_path / "runs")}
    job = ["--no-data-check", "--out", str(tmp_path / "j")]
    for argv in (
        ["plan", "--recipe", "neox20b", "--nodes", "4"],
        ["sbatch", "--recipe", "neox20b", "--nodes", "4", *job],
    ):
        ran = subprocess.run(
            [str(venv / "bin/trnrecipes"), *argv], capture_output=True, text=True, env=env, timeout=120
        )
        assert ran.returncode == 0, ran.stderr
    assert (tmp_path / "j/run.sbatch").is_file()
    assert subprocess.run([str(py), "-c", "import torch"], capture_output=True).returncode != 0  # no torch there
    make_venv = tmp_path / "make-venv"
    made = subprocess.run(["make", "--no-print-directory", f"VENV={make_venv}", "recipe=neox20b", "nodes=4",
                           "nodatacheck=1", f"out={tmp_path / 'm'}", "sbatch"], cwd=REPO, capture_output=True,
                          text=True, env=env, timeout=900)  # fmt: skip
    assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-2000:]
    assert (tmp_path / "m/run.sbatch").is_file()
    listed = subprocess.run([str(make_venv / "bin/python"), "-m", "pip", "list", "--format=json"], capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    names = {p["name"].lower() for p in json.loads(listed.stdout)}
    assert {"pyyaml", "jinja2", "trnrecipes"} <= names and not {"torch", "numpy", "lm-eval"} & names


def test_the_neuron_requirements_file_is_the_neuron_extra():
    """requirements/neuron.txt is what the per-node install in docs/jobs.md and the doctor's advice install."""
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["neuron"]
    listed = [line for line in (REPO / "requirements/neuron.txt").read_text().splitlines() if line[:1].isalnum()]
    assert listed == extra
