"""Make this node's job Python ready, first in every job script on every node: what trnrecipes needs and the
Python lacks is installed from the job's wheelhouse on shared storage (`make wheels`: trnrecipes/ops/wheels.py),
offline, held to what the Python already holds, so no Neuron package moves. A node Slurm swaps in mid-run is made
ready the same way. Standard library only (PyYAML may be what is missing).

Exit 0 ready; NOT_READY (4) this node's Python cannot be made ready (the job script tells a node fault, some nodes,
from bad input, every node).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from trnrecipes import REPO_ROOT
from trnrecipes.ops.doctor import NOT_READY, TRAIN_MODULES, _host

MEGATRON = {"megatron.core": "megatron-core"}  # only for Megatron .bin/.idx corpora, as the pre-flight asks
RECORD = "wheels.json"  # trnrecipes.jobs.wheelhouse.RECORD (not imported: that module needs the recipe's packages)


def missing(modules: dict[str, str]) -> list[str]:
    """The distributions of `modules` (module -> distribution) whose module this Python cannot import."""
    found = []
    for module, dist in modules.items():
        try:
            present = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a dotted name whose parent package is missing
            present = False
        if not present:
            found.append(dist)
    return sorted(set(found))


def make_ready(wheels: Path, python: str, modules: dict[str, str]) -> str | None:
    """Install what is missing from `wheels`; None when ready, else why not (one line)."""
    if not missing(modules):
        return None
    record = _record(wheels)
    if isinstance(record, str):
        return f"{python} lacks {', '.join(missing(modules))}; {record}"
    here = "{}.{}".format(*sys.version_info[:2])
    if record.get("python") != here:
        return (
            f"{python} lacks {', '.join(missing(modules))}; the wheels in {wheels} are for Python"
            f" {record.get('python')}, this is Python {here}: install requirements/neuron.txt into it on every node"
        )
    with _locked(Path(sys.prefix) / ".trnrecipes-ready.lock"):  # one installer at a time into a shared venv
        lacking = missing(modules)  # again: another node may have installed them meanwhile
        if not lacking:
            return None
        if why := _install(wheels, lacking):
            return f"{python} lacks {', '.join(lacking)}; installing them from {wheels} failed: {why}"
    importlib.invalidate_caches()
    if still := missing(modules):
        return f"{python} still cannot import {', '.join(still)} after installing them from {wheels}"
    print(f"[ready] {_host()}: installed {', '.join(lacking)} into {python} from {wheels}", flush=True)
    return None


def _record(wheels: Path) -> dict | str:
    """The wheelhouse's record, or why there is none to install from."""
    try:
        record = json.loads((wheels / RECORD).read_text())
    except (OSError, ValueError):
        record = None
    if isinstance(record, dict):
        return record
    if (REPO_ROOT / "requirements" / "wheels" / f"{wheels.name}.txt").is_file():
        sdk = wheels.name.removeprefix("neuron-")
        return f"no wheelhouse at {wheels}: `make wheels sdk={sdk}` on the login node fills it once"
    return (
        f"no wheelhouse at {wheels}, and no wheel lock for this SDK: install requirements/neuron.txt into it on every"
        " node (docs/jobs.md, 'The job's Python'), or bake it into the AMI"
    )


def _install(wheels: Path, lacking: list[str]) -> str | None:
    held = subprocess.run([sys.executable, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True)
    if held.returncode != 0:
        return f"no working pip here ({_error(held.stderr)})"
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as constraints:
        constraints.write(held.stdout)  # every installed distribution stays at its version
        constraints.flush()
        argv = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--find-links", str(wheels),
                "--disable-pip-version-check", "-c", constraints.name, *lacking]  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True)
    return None if done.returncode == 0 else _error(done.stderr)


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock on `path` (flock), or none where the file system refuses one."""
    try:
        handle = open(path, "a")
    except OSError:
        yield
        return
    with handle:
        with contextlib.suppress(OSError):
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _error(text: str) -> str:
    """pip's error line, not the hint after it."""
    lines = text.strip().splitlines() or ["no message"]
    return next((line for line in reversed(lines) if line.startswith("ERROR:")), lines[-1])[:300]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trnrecipes.ops.ready", description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheels", required=True, help="the job's wheelhouse (wheels/neuron-<sdk>)")
    parser.add_argument("--python", default=sys.executable, help="this interpreter as the job names it")
    parser.add_argument("--megatron", action="store_true", help="the recipe reads Megatron .bin/.idx corpora")
    args = parser.parse_args(argv)
    os.environ.setdefault("PIP_NO_INPUT", "1")
    try:
        why = make_ready(Path(args.wheels), args.python, {**TRAIN_MODULES, **(MEGATRON if args.megatron else {})})
    except Exception as err:  # this node's, as far as the script can tell: never a crash's exit 1
        why = f"making {args.python} ready failed: {type(err).__name__}: {err}"
    if why:
        print(f"error: {_host()}: {why}", flush=True)
        return NOT_READY
    return 0


if __name__ == "__main__":
    sys.exit(main())
