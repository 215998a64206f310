"""Where a job's nodes find the wheels that make their job Python ready (wheels/neuron-<sdk>/ in the checkout, on the
shared file system; `make wheels` fills it: trnrecipes/ops/wheels.py), and whether it is there and current, which
`sbatch` says. Torch-free."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from trnrecipes.config.sections import Recipe
from trnrecipes.config.stacks import AMI_PYTHON, SDK_RELEASES, sdk_version

RECORD = "wheels.json"  # beside the wheels: the SDK, Python, platform and the lock's sha256 they were made from


def lock_path(sdk: str, repo_root: Path) -> Path:
    """The lock of what trnrecipes needs beyond Neuron SDK `sdk`'s DLAMI venv."""
    return repo_root / "requirements" / "wheels" / f"neuron-{sdk}.txt"


def wheels_dir(sdk: str, repo_root: Path) -> Path:
    return repo_root / "wheels" / f"neuron-{sdk}"


def job_wheels(recipe: Recipe, repo_root: Path) -> str:
    """The wheelhouse a job's scripts make their nodes ready from: a Neuron stack's, else none (the checkout's .venv
    is the job's Python, already on the shared file system)."""
    return str(wheels_dir(recipe.cluster.neuron_sdk, repo_root)) if recipe.cluster.backend == "neuron" else ""


def lock_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def wheels_problem(recipe: Recipe, repo_root: Path) -> str | None:
    """Why the job's nodes could not be made ready from its wheelhouse, or None (also where nothing is locked)."""
    if recipe.cluster.backend != "neuron":
        return None
    sdk = recipe.cluster.neuron_sdk
    lock, where = lock_path(sdk, repo_root), wheels_dir(sdk, repo_root)
    if not lock.is_file():
        locked = ", ".join(sorted(f.stem.removeprefix("neuron-") for f in lock.parent.glob("neuron-*.txt")))
        return (
            f"Neuron SDK {sdk} has no wheel lock (locked: {locked}): the job cannot make its nodes ready; install"
            " requirements/neuron.txt into the DLAMI venv on every node yourself, or bake it into the AMI"
            " (docs/jobs.md, 'The job's Python')"
        )
    if twin := _other_venv(recipe):  # the lock is for the release's default venv's Python
        venv_python, ami = twin
        locked = lock_header(lock, "python")
        if locked and locked != venv_python:
            return (
                f"cluster.python {recipe.cluster.python} is the {ami} venv of Neuron SDK {sdk} (Python {venv_python});"
                f" its wheel lock is for the default venv's Python {locked}: no wheelhouse can make its nodes ready."
                " Install requirements/neuron.txt into that venv on every node yourself, or bake it into the AMI"
                " (docs/jobs.md, 'The job's Python')"
            )
    fill = f"`make wheels sdk={sdk}` (once, on a host with the package registry) fills it"
    try:
        record = json.loads((where / RECORD).read_text())
    except (OSError, ValueError):
        return (
            f"no wheels for Neuron SDK {sdk} in {where}: a node whose job Python lacks trnrecipes' packages (a node"
            f" Slurm swaps in, too) cannot be made ready by the job; {fill}"
        )
    if record.get("lock_sha256") != lock_digest(lock):
        return f"{where} was made from another {lock.name} than this checkout's; {fill} again"
    return None


def _other_venv(recipe: Recipe) -> tuple[str, str] | None:
    """(its Python, its AMI) where cluster.python is one of the release's DLAMI venvs other than the default."""
    release = SDK_RELEASES.get(sdk_version(recipe.cluster.neuron_sdk))
    if release is None or not recipe.cluster.python:
        return None
    for venv, ami in list(zip(release.venvs, release.amis, strict=True))[1:]:
        if recipe.cluster.python.rstrip("/").startswith(venv + "/") and ami in AMI_PYTHON:
            return AMI_PYTHON[ami], ami
    return None


def lock_header(path: Path, key: str) -> str | None:
    """A lock's (or a stack's pin file's) `# KEY: value` header line: the Python and platform it is for."""
    found = re.search(rf"^# {key}: (\S+)$", path.read_text(), re.M)
    return found[1] if found else None
