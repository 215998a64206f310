"""Shared by the tests. `make test` runs them on two pytest-xdist workers (--dist loadgroup): each worker is a
process of its own, with its own session fixtures, tmp_path and ports. The tests that share something outside
tmp_path are in a group of SHARED, whose tests one worker runs in turn."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/golden.py

REPO = Path(__file__).resolve().parent.parent
CLUSTER = REPO / "tests" / "slurm" / "cluster.sh"


# By file, in the controller's scheduler (which sees node ids, not marks): under pytest 9, pytest-xdist 3.8's
# xdist_group marks group nothing (they rename node ids by an attribute pytest no longer reads).
SHARED = {
    "tests/test_slurm.py": "slurm",  # the loopback cluster that slurm_env starts, and stops at the session's end
    "tests/test_node_ready.py": "slurm",
    "tests/test_readme.py": "repo",  # jobs/ and runs/ of the checkout (make demo, demo-cls), and port 29500
    "tests/test_sbatch_cli.py": "repo",  # make sbatch's default job dir in jobs/
    "tests/test_eval_data.py": "repo",  # build/downloads of the checkout (a wheel fetched there where it is missing)
}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadgroup with the groups of SHARED: each test on its own, the tests of a group together."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SharedGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return SHARED.get(nodeid.split("::", 1)[0], nodeid)

    return SharedGroups(config, log)


def run_cli(*args: str, cwd: Path = REPO, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m trnrecipes ...` in a fresh interpreter, as users run it."""
    return subprocess.run(
        [sys.executable, "-m", "trnrecipes", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=120,
    )


def rank_launcher(nproc: int) -> list[str]:
    """The command that starts `nproc` ranks of the script or `-m module` after it: tests/ranks.py, torchrun's
    environment without torchrun's own start-up."""
    return [sys.executable, str(REPO / "tests" / "ranks.py"), str(nproc)]


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture(scope="session")
def slurm_env(tmp_path_factory) -> dict[str, str]:
    """Start the loopback cluster (tests/slurm/cluster.sh, installing Slurm if needed) once per session; the
    environment for its clients (tests/test_slurm.py, tests/test_node_ready.py)."""
    was_running = subprocess.run(["bash", str(CLUSTER), "status"], capture_output=True, text=True).returncode == 0
    done = subprocess.run(["bash", str(CLUSTER), "start"], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        pytest.fail(f"tests/slurm/cluster.sh start failed (exit {done.returncode}):\n{done.stdout}\n{done.stderr}")
    conf = re.search(r"^SLURM_CONF=(.+)$", done.stdout, re.M)
    addr = re.search(r"^NODE_ADDR=(.+)$", done.stdout, re.M)
    assert conf and addr, done.stdout + done.stderr
    # Not the variables of a job this test might itself run in: only the test cluster's config.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TRNRECIPES_"))}
    env["SLURM_CONF"] = conf.group(1)
    env["NODE_ADDR"] = addr.group(1)
    yield env
    if not was_running:
        subprocess.run(["bash", str(CLUSTER), "stop"], capture_output=True, text=True, timeout=120)
