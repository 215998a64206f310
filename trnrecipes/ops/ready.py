"""Make this node's job Python ready, first in every job script on every node: what trnrecipes needs and the
Python lacks is installed from the job's wheelhouse on shared storage (`make wheels`: trnrecipes/ops/wheels.py),
offline, held to what the Python already holds, so no Neuron package moves. A node Slurm swaps in mid-run is made
ready the same way. Standard library only (PyYAML may be what is missing).

Exit 0 ready; 4 this node's Python cannot be made ready (the job script tells a node fault, one node, from bad
input, every node).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from trnrecipes.ops.doctor import TRAIN_MODULES, _host

NOT_READY = 4
NEEDED = {**TRAIN_MODULES, "megatron.core": "megatron-core"}  # requirements/neuron.txt and PyYAML, by module


def missing() -> list[str]:
    """The distributions of NEEDED whose module this Python cannot import."""
    found = []
    for module, dist in NEEDED.items():
        try:
            present = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a dotted name whose parent package is missing
            present = False
        if not present:
            found.append(dist)
    return sorted(set(found))


def make_ready(wheels: Path, python: str) -> str | None:
    """Install what is missing from `wheels`; None when ready, else why not (one line)."""
    lacking = missing()
    if not lacking:
        return None
    named = f"{python} lacks {', '.join(lacking)}"
    try:
        record = json.loads((wheels / "wheels.json").read_text())
    except (OSError, ValueError):
        return (
            f"{named} and there is no wheelhouse at {wheels}: `make wheels sdk=<cluster.neuron_sdk>` on the login"
            " node fills it once (or install requirements/neuron.txt into it on every node)"
        )
    here = "{}.{}".format(*sys.version_info[:2])
    if record.get("python") != here:
        return f"{named}; the wheels in {wheels} are for Python {record.get('python')}, this is Python {here}"
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as held:
        freeze = subprocess.run([sys.executable, "-m", "pip", "freeze", "--exclude-editable"], capture_output=True,
                                text=True)  # fmt: skip
        if freeze.returncode != 0:
            return f"{named} and has no working pip to install them with ({_last(freeze.stderr)})"
        held.write("".join(line + "\n" for line in freeze.stdout.splitlines() if " @ " not in line))  # pins only
        held.flush()
        argv = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--find-links", str(wheels),
                "--disable-pip-version-check", "-c", held.name, *lacking]  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        return f"{named}; installing them from {wheels} failed: {_last(done.stderr)}"
    importlib.invalidate_caches()
    still = missing()
    if still:
        return f"{named}; after installing from {wheels} it still cannot import {', '.join(still)}"
    print(f"[ready] {_host()}: installed {', '.join(lacking)} into {python} from {wheels}", flush=True)
    return None


def _last(text: str) -> str:
    return ((text.strip().splitlines() or ["no message"])[-1])[:300]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trnrecipes.ops.ready", description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheels", required=True, help="the job's wheelhouse (wheels/neuron-<sdk>)")
    parser.add_argument("--python", default=sys.executable, help="this interpreter as the job names it")
    args = parser.parse_args(argv)
    os.environ.setdefault("PIP_NO_INPUT", "1")
    why = make_ready(Path(args.wheels), args.python)
    if why:
        print(f"error: {_host()}: {why}", flush=True)
        return NOT_READY
    return 0


if __name__ == "__main__":
    sys.exit(main())
