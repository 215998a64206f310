"""What a login node runs, on the Python it has (Ubuntu 22.04's 3.10, 24.04's 3.12): requirements/install.sh (what
make setup runs where no Python 3.11+ is found) makes a fresh venv and installs the login-node tier from the package
registries at that Python's constraints file; then sbatch, plan, doctor and data to-arrow run from it, tokenizer
train's modules import without torch, and data preprocess says in one line that it needs torch. The full install
stops in one line on 3.10, before anything is made or downloaded."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from conftest import REPO
from login_pythons import LOGIN_MINORS, find
from packaging.requirements import Requirement

INSTALL = REPO / "requirements/install.sh"
EXTRAS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
LOGIN_MODULES = "yaml, jinja2, numpy, pyarrow, tqdm, tokenizers, tiktoken, sentencepiece, google.protobuf"


def _pins(minor: str) -> dict[str, str]:
    lines = (REPO / f"requirements/constraints-py{minor}.txt").read_text().splitlines()
    return dict(line.split("==") for line in lines if line and not line.startswith("#"))


def _python(minor: str) -> str:
    python = find(minor)
    if python is None:
        pytest.skip(f"no Python {minor} here (pyenv's versions/{minor}.*, python{minor} on PATH); .ci/run requires it")
    return python


@pytest.fixture(scope="module")
def pip_cache(tmp_path_factory) -> Path:
    """One download cache for this run's venvs, none from earlier runs: the time measured here is CI's."""
    return tmp_path_factory.mktemp("pip-cache")


@pytest.fixture(scope="module")
def installing(pip_cache, tmp_path_factory) -> dict[str, tuple[subprocess.Popen, Path]]:
    """requirements/install.sh's login tier, started for every login Python found at once: the installs mostly wait
    on the registry, so they run side by side."""
    started = {}
    for minor in LOGIN_MINORS:
        if (python := find(minor)) is not None:
            where = tmp_path_factory.mktemp(f"py{minor}")
            env = {**os.environ, "python": python, "PIP_CACHE_DIR": str(pip_cache), "PIP_COMPILE": "0"}
            with open(where / "out", "w") as out, open(where / "err", "w") as err:  # files: a full pipe would stall it
                proc = subprocess.Popen(["bash", str(INSTALL), "login", str(where / "venv")], stdout=out, stderr=err,
                                        env=env, start_new_session=True)  # fmt: skip
            started[minor] = (proc, where)
    yield started
    for proc, _ in started.values():
        if proc.poll() is None:  # the test was deselected or timed out: stop the install and the pip under it
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.slow
@pytest.mark.parametrize("minor", LOGIN_MINORS)
def test_the_login_tier_installs_and_runs_on_the_login_nodes_python(minor, installing, tmp_path):
    _python(minor)
    proc, where = installing[minor]
    proc.wait(timeout=600)  # on a timeout the fixture's teardown stops it
    assert proc.returncode == 0, (where / "out").read_text()[-2000:] + (where / "err").read_text()[-3000:]
    venv = where / "venv"
    py = str(venv / "bin/python")
    listed = subprocess.run([py, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True, timeout=120)
    installed = {re.sub(r"[-_.]+", "-", n).lower(): v for n, v in (x.split("==") for x in listed.stdout.split())}
    del installed["trnrecipes"]
    installed.pop("setuptools", None)  # what the venv came with (3.10, 3.11), unused by trnrecipes
    assert installed == _pins(minor)  # every package at its pin, nothing more (no torch)
    imports = f"import sys, {LOGIN_MODULES}; from transformers import LlamaTokenizer; print(sys.version_info[:2])"
    ran = subprocess.run([py, "-c", imports], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0 and ran.stdout.strip() == str(tuple(map(int, minor.split(".")))), ran.stderr

    def cli(*args: str, job_python: str | None = None) -> subprocess.CompletedProcess[str]:
        run_env = {**os.environ, "TRNRECIPES_RUNS": str(tmp_path / "runs")}
        run_env.pop("PYTHONPATH", None)  # the venv's own editable install, as on a login node
        if job_python:
            run_env["TRNRECIPES_PYTHON"] = job_python
        return subprocess.run([str(venv / "bin/trnrecipes"), *args], capture_output=True, text=True, env=run_env,
                              cwd=tmp_path, timeout=300)  # fmt: skip

    plan = cli("plan", "--recipe", "pythia-70m", "--nodes", "2")
    assert plan.returncode == 0 and "TP 1 x PP 1 x DP 64" in plan.stdout, plan.stderr
    big = cli("sbatch", "--recipe", "llama2-7b", "--nodes", "16", "--no-data-check", "--out", str(tmp_path / "j7b"))
    assert big.returncode == 0 and (tmp_path / "j7b/run.sbatch").is_file(), big.stderr
    tiny = cli("sbatch", "--recipe", "llama2-tiny", "--nodes", "1", "--out", str(tmp_path / "tiny"))
    assert tiny.returncode == 0 and "data/demo/pythondocs.arrow" in (tmp_path / "tiny/recipe.yaml").read_text()
    config = str(tmp_path / "tiny/recipe.yaml")
    # the job's Python is another one (here the test's own, with torch): this one reads the recipe and hands over
    ok = cli("doctor", "--config", config, job_python=sys.executable)
    assert ok.returncode == 0 and f"run ok: python {sys.executable}" in ok.stdout, ok.stdout + ok.stderr
    # run by this venv itself, the check says what training needs, and how: on 3.10 not pip (its pins need 3.11)
    refused = cli("doctor", "--config", config, job_python=py)
    assert refused.returncode == 2 and f"torch not installed in {py}" in refused.stdout, refused.stdout
    advice = "is Python 3.10, and the train install needs 3.11 or 3.12" if minor == "3.10" else f"{py} -m pip install"
    assert advice in refused.stdout, refused.stdout
    if minor == "3.10":  # eval.sbatch runs the checkout's .venv: a login-tier one cannot score
        scoring = cli("doctor", "--config", config, "--job", "eval", job_python=py)
        assert scoring.returncode == 2 and "the eval install needs 3.11 or 3.12" in scoring.stdout, scoring.stdout

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "a first document"}\n{"text": "a second one"}\n{"text": ""}\n{"text": "third"}\n')
    arrow = cli("data", "to-arrow", "--in", str(corpus), "--out", str(tmp_path / "corpus.arrow"))
    assert arrow.returncode == 0 and "3 documents, skipped 1 empty" in arrow.stdout, arrow.stderr
    tokenizer = str(REPO / "data/tokenizers/gpt2")
    megatron = cli("data", "preprocess", "--in", str(corpus), "--tokenizer", tokenizer, "--out", str(tmp_path / "m"))
    assert megatron.returncode == 2 and megatron.stderr.count("\n") == 1, megatron.stderr
    assert "megatron-core, which imports torch: megatron-core is not installed in" in megatron.stderr
    assert not list(tmp_path.glob("m*")) and not list(tmp_path.glob(".m*"))


def test_the_full_install_on_3_10_stops_in_one_line_before_making_anything(tmp_path):
    python = _python("3.10")
    env = {**os.environ, "python": python}
    tier = subprocess.run(["bash", str(INSTALL), "tier", str(tmp_path / "v")], capture_output=True, text=True, env=env)
    assert tier.stdout == "login\n", tier.stderr
    done = subprocess.run(["bash", str(INSTALL), "full", str(tmp_path / "v")], capture_output=True, text=True, env=env,
                          timeout=120)  # fmt: skip
    assert done.returncode == 2 and done.stdout == "" and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("error: training on CPU, make eval, make demo and make test need Python 3.11 or 3.12")
    assert f"{python} is Python 3.10" in done.stderr and "make setup" in done.stderr
    assert not (tmp_path / "v").exists()
    ours = {**os.environ, "python": sys.executable}  # the Python running the tests: 3.11, the full tier's
    assert subprocess.run(["bash", str(INSTALL), "tier", str(tmp_path / "v")], capture_output=True, text=True,
                          env=ours).stdout == "full\n"  # fmt: skip


@pytest.mark.parametrize("minor", ["3.10", "3.11", "3.12"])
def test_each_constraints_file_pins_the_login_extra_within_its_ranges(minor):
    pins = _pins(minor)
    for line in EXTRAS["login"] + tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]:
        req = Requirement(line)
        assert req.name.lower() in pins, f"constraints-py{minor}.txt has no {req.name}"
        assert req.specifier.contains(pins[req.name.lower()]), (minor, line, pins[req.name.lower()])
    assert "torch" not in pins and "megatron-core" not in pins


def test_on_3_11_the_login_pins_are_the_train_installs():
    """.venv on 3.11 holds .[train-deps]'s exact pins; a 3.11 login install takes the same versions."""
    pins = _pins("3.11")
    train = {(r := Requirement(d)).name.lower(): str(r.specifier).removeprefix("==") for d in EXTRAS["train-deps"]}
    assert {Requirement(d).name.lower() for d in EXTRAS["login"]} <= set(train)
    assert {n: v for n, v in pins.items() if n in train} == {n: v for n, v in train.items() if n in pins}
