"""Where a job's checkpoints go, how much room they take, and whether that file system has it: said by `sbatch` and
`plan`, and refused by `sbatch` before a job is written that could not keep its checkpoints.

A checkpoint is the weights in their training dtype plus two fp32 AdamW moments per parameter
(trnrecipes.config.preemption.checkpoint_bytes; the TP/PP/ZeRO-1 layout splits it into files, it does not change
its size), and a run keeps checkpoint.keep_last of them, plus the one being written before the oldest is pruned.
A multi-node cluster job, or any job keeping more than LOCAL_LIMIT of checkpoints, must say where they go:
recipe.run_dir, or $TRNRECIPES_RUNS/<job name>; the rest (the demo, tiny and smoke recipes on one node) default to
runs/ in the checkout.
Torch-free.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from trnrecipes.config.cluster import LOCAL_INSTANCES
from trnrecipes.config.preemption import checkpoint_bytes
from trnrecipes.config.sections import Recipe
from trnrecipes.files.outputs import run_dir_in_checkpoints
from trnrecipes.files.reach import blocked
from trnrecipes.files.run_files import CHECKPOINTS, STEP_DIR
from trnrecipes.jobs.mounts import SHARED_TYPES, mount_of, read_mountinfo

RUNS_ENV = "TRNRECIPES_RUNS"
LOCAL_LIMIT = 10 * 2**30  # more checkpoint bytes than this (10 GiB) do not belong in a checkout, on any instance


def run_dir_for(recipe: Recipe, repo_root: Path, runs_root: str | None) -> Path:
    """recipe.run_dir (relative to the repository root), else RUNS_ROOT/<job name>, else runs/<job name> in the
    checkout."""
    if recipe.run_dir:
        path = Path(recipe.run_dir).expanduser()
        return path if path.is_absolute() else repo_root / path
    if runs_root:
        return Path(runs_root).expanduser().absolute() / recipe.job_name
    return repo_root / "runs" / recipe.job_name


def checkpoint_footprint(recipe: Recipe) -> tuple[int, int]:
    """(bytes of one checkpoint, bytes at the most on disk: keep_last + 1 while the next is written)."""
    one = checkpoint_bytes(recipe)
    return one, one * (recipe.checkpoint.keep_last + 1)


def run_dir_problem(recipe: Recipe, runs_root: str | None) -> str | None:
    """Why this job may not put its checkpoints in the checkout by default, or None."""
    one, most = checkpoint_footprint(recipe)
    spread = recipe.cluster.nodes > 1 and recipe.cluster.instance not in LOCAL_INSTANCES  # a loopback test is local
    if recipe.run_dir or runs_root or not (spread or most > LOCAL_LIMIT):
        return None
    why = f"{recipe.cluster.nodes} nodes" if recipe.cluster.nodes > 1 else f"{_size(most)} of checkpoints"
    return (
        f"run_dir: {recipe.job_name} ({why}) needs its checkpoints on shared storage, not in the checkout: keep_last"
        f" {recipe.checkpoint.keep_last} x {_size(one)} (+1 while saving); export {RUNS_ENV}=/fsx/runs (each job"
        " in a directory of its name there) or pass --overrides run_dir=/fsx/runs/NAME (docs/checkpoints.md)"
    )


def run_dir_blocker(run_dir: Path) -> str | None:
    """Why the job could not make or use `run_dir`, or None: a symbolic link on the way (or the run dir itself)
    that leads nowhere or into a loop, a directory this user cannot search, or a file where a directory goes.
    run.sbatch's `mkdir -p` would otherwise fail after the nodes were allocated. Or a place inside a checkpoint or a
    run's checkpoints/ (a slip of a path): the run's files would make that checkpoint fail verification, and the
    run it belongs to would set it aside and train its steps again."""
    if why := run_dir_in_checkpoints(run_dir):
        return why
    for path in (*reversed(Path(os.path.abspath(run_dir)).parents), Path(os.path.abspath(run_dir))):
        if why := blocked(path):
            return why
        if not os.path.exists(path):
            return None  # the rest is made by the job
        if not os.path.isdir(path):
            return f"{path} is a file, not a directory"
    return None


def node_local_warnings(
    recipe: Recipe, repo_root: Path, job_dir: Path, run_dir: Path | None, mountinfo: str | None = None
) -> list[str]:
    """A multi-node cluster job's checkout, job dir and run dir (None: not looked at, --no-data-check) on a file
    system that is not a network or parallel one (jobs/mounts.py SHARED_TYPES): one warning per mount, naming its
    type. A 1-node job is not judged: its node may be this host. Each place is judged by its nearest existing
    directory, unless that is / (a /fsx not mounted here); nothing where there is no mountinfo (`mountinfo`: its
    text, else this process's)."""
    if recipe.cluster.nodes == 1 or recipe.cluster.instance in LOCAL_INSTANCES:
        return []
    text = read_mountinfo() if mountinfo is None else mountinfo
    if text is None:
        return []
    places = {
        f"the checkout {repo_root} (each node runs the job from it)": repo_root,
        f"job dir {job_dir} (Slurm writes its logs/ there from the job's first node)": job_dir,
        f"run dir {run_dir} (every node writes checkpoints there and resumes from them)": run_dir,
    }
    on: dict[tuple[str, str], list[str]] = {}
    for what, path in places.items():
        if path is None:
            continue
        path = Path(os.path.abspath(path))
        anchor = _nearest_existing(path)
        if anchor != path and anchor == Path(anchor.anchor):
            continue
        if (mount := mount_of(os.path.realpath(anchor), text)) and mount[1] not in SHARED_TYPES:
            on.setdefault(mount, []).append(what)
    warnings = []
    for (point, kind), what in on.items():
        named, verb, pronoun = (
            (what[0], "is", "it") if len(what) == 1 else (f"{', '.join(what[:-1])} and {what[-1]}", "are", "them")
        )
        warnings.append(
            f"{named} {verb} on {kind} (mounted at {point}), not a network or parallel file system (nfs, lustre, ...)"
            f" that all {recipe.cluster.nodes} nodes of the job mount: put {pronoun} on the cluster's shared storage"
            f" (a checkout there; --out; run_dir or {RUNS_ENV}), docs/jobs.md"
        )
    return warnings


def _nearest_existing(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path(path.anchor)


def _held(run_dir: Path) -> int:
    """Bytes of the complete checkpoints already in the run dir (a resumed run's): they count toward its keep_last."""
    total = 0
    root = run_dir / CHECKPOINTS
    try:
        if not root.is_dir():
            return 0
        for step in root.iterdir():
            if STEP_DIR.fullmatch(step.name) and step.is_dir() and not step.is_symlink():
                total += sum(f.stat().st_size for f in step.rglob("*") if f.is_file() and not f.is_symlink())
    except OSError:  # a file pruned while counting, or one this user may not read: count what was seen
        pass
    return total


def storage_report(recipe: Recipe, run_dir: Path, look: bool = True) -> tuple[str, str | None, str | None]:
    """(the line sbatch and plan print, a warning or None, an error or None). The error: the file system holding
    the run dir has less free space than the checkpoints need; the warning: less than twice that. Measured on the
    run dir's nearest existing ancestor; where that is / (a login node without the cluster's /fsx), free space is
    not known and nothing is judged; nor with look=False (--no-data-check)."""
    one, most = checkpoint_footprint(recipe)
    weights = "bf16" if recipe.precision.dtype == "bf16" else "fp32"
    line = (
        f"checkpoints  {run_dir / CHECKPOINTS}: {_size(one)} each ({weights} weights + fp32 AdamW moments), keep_last"
        f" {recipe.checkpoint.keep_last} (+1 while saving) = {_size(most)}"
    )
    if not look:
        return f"{line}; free space not checked (--no-data-check)", None, None
    if why := run_dir_blocker(run_dir):
        return line, None, f"run dir {run_dir}: {why}; choose another run_dir (or {RUNS_ENV})"
    anchor = _nearest_existing(run_dir)
    if anchor == Path(anchor.anchor):  # not even the run dir's top directory (/fsx) is there: another file system
        return f"{line}; free space unknown ({run_dir.parts[1]} is not there from this host)", None, None
    if not os.access(anchor, os.W_OK | os.X_OK):
        return line, None, f"run dir {run_dir}: {anchor} is not writable by this user; choose another run_dir"
    need = max(0, most - _held(run_dir))
    free = shutil.disk_usage(anchor).free
    line += f"; {_size(free)} free there"
    if free < need:
        return (
            line,
            None,
            (
                f"{run_dir}: {_size(free)} free, but the checkpoints need {_size(need)} more (keep_last"
                f" {recipe.checkpoint.keep_last} x {_size(one)} + 1 while saving); free space, lower"
                f" checkpoint.keep_last or choose another run_dir / {RUNS_ENV}"
            ),
        )
    if free < 2 * need:
        return line, f"{run_dir}: {_size(free)} free is less than twice what the checkpoints need ({_size(need)})", None
    return line, None, None


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    raise AssertionError


def runs_root_from_env() -> str | None:
    return os.environ.get(RUNS_ENV) or None
