"""Where a command may write: one guard for every verb that writes a file or directory (predict, embed, eval run,
eval code, eval prepare-data, convert, data to-arrow / preprocess, tokenizer, sbatch, plot), called before any work.

An output is refused, with one line naming it and why, when it
- is one of the command's inputs: the same path, or the same file by another name (a hard link); or, for a
  directory output, holds one (commands replace or fill their output directory: the input would go with it);
- names no directory of its own ('.', '..', '/');
- is or lies inside a checkpoint (a directory with our manifest.json) or inside a run dir's checkpoints/: a file the
  manifest does not list makes the checkpoint fail verification, and the next `train` would move it aside as
  unusable and resume from an older one; a step_N written there would pass for a checkpoint;
- is or lies in another of a run dir's own files (run_files.RUN_ENTRIES: metrics.jsonl, tensorboard/, archived/,
  plots/ but for plot, the lock, the stop files): the run's record would be overwritten. A run dir is known by its
  marks: the lock every trainer takes (kept after the run), or checkpoints/ holding step_N dirs. A new name in a
  run dir (eval/, embeddings/) is fine;
- (a prefix: preprocess's PREFIX.bin/.idx) names a directory, whose outputs would be hidden files in it;
- sits below a regular file, or is a directory where a file is expected (or the reverse);
- is itself a symbolic link. The rule everywhere in trnrecipes: nothing is written or deleted through a link (step
  dirs that are links are refused too), since the write would land where the command line does not say. Links
  among its parent directories are followed (a scratch directory that is a link is common on clusters), and the
  checkpoint checks apply to the path both as given and as resolved (RUN/checkpoints may itself be a link).

Torch-free: `sbatch` and `plan` run it on a login node.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterable
from pathlib import Path

from trnrecipes.config.sections import RecipeError
from trnrecipes.files.run_files import CHECKPOINTS, LOCK_FILE, MANIFEST, STEP_DIR, is_run_entry
from trnrecipes.schema import shown

MANIFEST_READ_LIMIT = 64 << 20  # a manifest.json larger than this is not one of ours (ours list file hashes)


class OutputError(RecipeError):
    """An output path that would overwrite an input, damage a checkpoint, or cannot be written."""


def check_output(
    out: str | Path,
    *,
    flag: str = "--out",
    inputs: Iterable[str | Path] = (),
    directory: bool = False,
    run_entry: str | None = None,
) -> Path:
    """`out` as a Path if a command may write it (a file, or with `directory` a directory), else OutputError.
    `inputs`: what the command reads (files or directories); `flag` names the output in the message; `run_entry`:
    the run dir entry that is the command's own output (plot's plots/), let through."""
    if str(out) == "-":  # standard input to --in; standard output is no place for an output written whole, renamed
        raise OutputError(f"{flag} -: name a file to write (nothing is written to standard output)")
    out = Path(out)
    named = f"{flag} {out}"
    if Path(os.path.normpath(out)).name in ("", ".", ".."):
        raise OutputError(f"{named} names no directory of its own; give a path ending in a new name")
    if out.is_symlink():
        raise OutputError(
            f"{named} is a symbolic link (to {shown(os.readlink(out))}): outputs are never written through a link;"
            " give the path it points to, or a new one"
        )
    if blocker := _not_a_directory_above(out):
        raise OutputError(f"{named}: {blocker}, so nothing can be written below it; choose a path in a directory")
    if special := _special_file(out):
        raise OutputError(
            f"{named} is {special}, not a regular file: the output is written under a temp name and renamed onto its"
            " name, which would replace it; give a new path"
        )
    if directory and out.exists() and not out.is_dir():
        raise OutputError(f"{named} exists and is not a directory; give a new directory (or an empty one)")
    if not directory and out.is_dir():
        raise OutputError(f"{named} is a directory; give a file path (e.g. {out / 'NAME'})")
    real = out.resolve()
    for given in inputs:
        source = Path(given)
        if not source.exists():
            continue
        if real == source.resolve():
            raise OutputError(f"{named} is the input {source}: writing it would overwrite what is read; choose another")
        if out.exists() and os.path.samefile(out, source):
            raise OutputError(
                f"{named} is the same file as the input {source} (a hard link): writing it would overwrite the input;"
                " choose another path"
            )
        if directory and real in source.resolve().parents:
            raise OutputError(
                f"{named} holds the input {source}: the command fills or replaces its output directory; choose a"
                " directory that holds none of its inputs"
            )
    if found := checkpoint_around(real) or checkpoint_around(Path(os.path.abspath(out))):
        kind, where = found
        if kind == "checkpoint":
            why = "a file its manifest.json does not list makes it fail verification (training would set it aside)"
        else:
            why = "only checkpoints belong there (training and eval take every step_N in it for one)"
        raise OutputError(f"{named} would write into {kind} {where}: {why}; write it outside, e.g. beside the run dir")
    if found := run_entry_around(real, run_entry) or run_entry_around(Path(os.path.abspath(out)), run_entry):
        entry, inside = found
        raise OutputError(
            f"{named} would {'write into' if inside else 'overwrite'} {entry.name} of the run dir {entry.parent}, one"
            f" of the run's own files; give a new name in the run dir (e.g. {entry.parent / 'eval' / out.name}) or a"
            " path outside it"
        )
    return out


def _special_file(path: Path) -> str | None:
    """What `path` is where it is neither a regular file nor a directory (a device such as /dev/null, a FIFO, a
    socket), else None."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return None
    for test, what in SPECIAL_FILES:
        if test(mode):
            return what
    return None


SPECIAL_FILES = (
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
)


def check_outputs(outs: Iterable[str | Path], **kwargs) -> None:
    """check_output for each of a command's outputs (a file and its companion files)."""
    for out in outs:
        check_output(out, **kwargs)


def check_prefix(
    prefix: str, suffixes: tuple[str, ...], *, flag: str = "--out", inputs: Iterable[str | Path] = ()
) -> None:
    """check_output for each PREFIX+suffix a command writes (preprocess: PREFIX.bin, PREFIX.idx, ...), after refusing
    a prefix that names a directory (an existing one, or one ending in '/'): the files would be hidden ones in it."""
    if prefix.endswith(("/", os.sep)) or Path(prefix).is_dir():
        hidden = ", ".join(f"{Path(prefix) / suffix}" for suffix in suffixes[:2])
        raise OutputError(
            f"{flag} {prefix} names a directory: the outputs would be hidden files in it ({hidden}); give a prefix"
            f" like {Path(prefix) / 'corpus'} (writes {Path(prefix) / 'corpus'}{suffixes[0]}, ...)"
        )
    check_outputs([f"{prefix}{suffix}" for suffix in suffixes], flag=flag, inputs=inputs)


def checkpoint_around(path: Path) -> tuple[str, Path] | None:
    """("checkpoint", dir) if `path` (absolute) is a checkpoint or lies in one, ("the run dir checkpoints", dir) if
    it is or lies in a run dir's checkpoints/, else None."""
    for d in (path, *path.parents):
        if _is_checkpoint(d):
            return "checkpoint", d
        if d.name == CHECKPOINTS and _is_run_checkpoints(d):
            return "the run dir checkpoints", d
    return None


def run_dir_in_checkpoints(run_dir: Path) -> str | None:
    """Why a run dir may not be made at `run_dir`, or None: it is or lies in a checkpoint, or in a run's checkpoints/
    (a slip of a path). The run's files would make that checkpoint fail verification, and the run it belongs to
    would set it aside and train its steps again."""
    here = Path(os.path.abspath(run_dir))
    try:
        real = here.resolve()  # links on the way, made or not yet
    except (OSError, RuntimeError):  # a link loop: the caller's own check names it (storage.run_dir_blocker)
        real = here
    if found := checkpoint_around(here) or checkpoint_around(real):
        kind, where = found
        return (
            f"it lies in {kind} {where}: a run's files there would cost a run its checkpoints (set aside as"
            " unusable, their steps trained again); give a run dir outside it"
        )
    return None


def run_entry_around(path: Path, allowed: str | None = None) -> tuple[Path, bool] | None:
    """(RUN_DIR/entry, whether `path` lies inside it) if `path` (absolute) is or lies in one of a run dir's own
    entries other than `allowed`, else None. Only a parent of a path named like an entry is asked if it is a run dir."""
    for d in (path, *path.parents):
        if d.name != allowed and is_run_entry(d.name) and _is_run_dir(d.parent):
            return d, d != path
    return None


def _is_run_dir(d: Path) -> bool:
    """A trainer's run dir: it holds the lock every trainer takes (kept after the run), or checkpoints/ with step_N
    dirs (a run dir copied without its hidden files)."""
    return os.path.lexists(d / LOCK_FILE) or _is_run_checkpoints(d / CHECKPOINTS)


def _not_a_directory_above(out: Path) -> str | None:
    """What stops `out` from being created: a parent that is a regular file (or another non-directory), or a
    parent that is a link to nothing. None if every existing parent is a directory."""
    for parent in reversed(Path(os.path.abspath(out)).parents):
        if parent.is_dir():
            continue
        if parent.is_symlink() and not parent.exists():
            return f"{parent} is a symbolic link to nothing ({shown(os.readlink(parent))})"
        if parent.exists():
            return f"{parent} is a file, not a directory"
        return None  # the rest does not exist yet: the command creates it
    return None


def _is_checkpoint(d: Path) -> bool:
    """A directory holding one of our manifests (a JSON object with "step" and "files"): a finished checkpoint, a
    save in progress, `convert from-hf`'s output, or one moved to unusable/ or archived/."""
    manifest = d / MANIFEST
    try:
        if not manifest.is_file() or manifest.stat().st_size > MANIFEST_READ_LIMIT:
            return False
        data = json.loads(manifest.read_bytes())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "step" in data and "files" in data


def _is_run_checkpoints(d: Path) -> bool:
    """RUN_DIR/checkpoints: beside a trainer's lock file, or holding step_N dirs."""
    if not d.is_dir():
        return False
    if (d.parent / LOCK_FILE).exists():
        return True
    try:
        return any(STEP_DIR.match(child.name) for child in d.iterdir())
    except OSError:
        return False
