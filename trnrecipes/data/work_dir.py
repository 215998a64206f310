"""OUT.parts/: the work dir of a conversion in parts (parallel.py), so that one killed halfway resumes from the parts
done. It is made whole with its record in it (job.json: the inputs and the settings that decide the parts), locked
while a conversion runs, and removed once the output is written. One without that record, or holding files a
conversion does not write, is never used nor removed (the rule `trnrecipes embed` keeps for its OUT.parts/).
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import os
import re
import secrets
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

from trnrecipes.data import DataError, listed
from trnrecipes.data.inputs import JOB

LOCK = ".lock"
STALE_STAGING_S = 60
FORMAT = 1  # job.json's format
PART = re.compile(r"part_\d{6,}\.(arrow|json|rejects\.jsonl|bin|idx)")
# temp_path's (a suffix may follow: a temp prefix's .bin): a killed run's half-written file, or shard directory
TEMP = re.compile(r"\..+\.\d+-[0-9a-f]{8}\.tmp(\.[a-z.]+)?")


def parts_path(out: str | Path) -> Path:
    """The work dir of the output file, shard directory or prefix `out`: OUT.parts/ beside it."""
    return Path(f"{out}.parts")


def temp_path(path: Path) -> Path:
    """A temp name beside `path`, unique to this process, that TEMP knows."""
    return path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")


def stale_temps(path: Path) -> list[Path]:
    """temp_path's names for `path` whose process no longer runs on this machine: what a killed one left."""
    stale = []
    for temp in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        pid = temp.name[len(path.name) + 2 :].split("-", 1)[0]
        if TEMP.fullmatch(temp.name) and pid.isdigit() and not pid_running(int(pid)):
            stale.append(temp)
    return stale


def pid_running(pid: int) -> bool:
    """Whether process `pid` runs on this machine (another user's included)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: another user's
        return True
    return True


@contextlib.contextmanager
def atomic_file(path: Path, mode: str = "w") -> Iterator:
    """An open temp file that becomes `path` (synced, renamed) only if the block completes."""
    tmp = temp_path(path)
    try:
        with open(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


@contextlib.contextmanager
def opened_work_dir(work: Path, job: dict, command: str) -> Iterator[dict]:
    """`work` made (or found: it must be a conversion's, of this job) and locked; yields the recorded job (a resumed
    one keeps its units). Stale temp files of a killed run are removed first."""
    check_ours(work, command)
    _make(work, job, command)
    with open(work / LOCK, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DataError(f"another `trnrecipes data {command}` is writing {work}; wait for it or stop it") from None
        for entry in os.scandir(work):  # under the lock: nobody is writing them
            if TEMP.fullmatch(entry.name):
                _remove(Path(entry.path))
        try:
            saved = json.loads((work / JOB).read_text())
        except (OSError, ValueError) as err:
            raise DataError(f"{work / JOB}: unreadable ({err}); remove {work} to start over") from None
        if diffs := differences(saved if isinstance(saved, dict) else {}, job):
            raise DataError(
                f"{work} holds a partial conversion made from other inputs or settings: {'; '.join(diffs)}. Rerun with"
                f" the same ones to resume, or remove {work} (or choose another --out) to start over"
            )
        yield saved


def differences(saved: dict, job: dict) -> list[str]:
    """What differs, in words, between the job that made a work dir and this one: the inputs (paths, in order) and
    the settings that decide the parts. Sizes and times are each part's to check (a changed file is read again)."""
    diffs = []
    if saved.get("format") != job["format"]:
        diffs.append(f"format {saved.get('format')} -> {job['format']} (made by another version of trnrecipes)")
    if saved.get("command") != job["command"]:
        diffs.append(f"made by `data {saved.get('command')}`, not `data {job['command']}`")
    was = [(i.get("path"), i.get("kind")) for i in saved.get("inputs", []) if isinstance(i, dict)]
    now = [(i["path"], i["kind"]) for i in job["inputs"]]
    if was != now:
        k = next((k for k, (a, b) in enumerate(zip(was, now, strict=False)) if a != b), min(len(was), len(now)))
        first = f"#{k + 1} {was[k][0] if k < len(was) else 'none'} -> {now[k][0] if k < len(now) else 'none'}"
        diffs.append(f"inputs: {len(was)} files -> {len(now)} (the first that differs: {first})")
    for key, value in job["settings"].items():
        if saved.get("settings", {}).get(key) != value:
            diffs.append(f"{key} {saved.get('settings', {}).get(key)!r} -> {value!r}")
    return diffs


def check_ours(work: Path, command: str) -> None:
    """DataError unless `work` is absent or a conversion's work dir: a directory (not a link) holding its record and
    nothing but a conversion's files. It is removed when done, so one it did not make is never adopted."""
    if not work.exists() and not work.is_symlink():
        return
    if work.is_symlink() or not work.is_dir():
        raise DataError(f"{work} exists and is not a work dir a conversion made; move it away or choose another --out")
    if not (work / JOB).is_file():
        raise DataError(
            f"{work} exists and was not made by `trnrecipes data {command}` (no {JOB} in it): a conversion removes"
            " its work dir when done, so it uses none it did not make; move it away or choose another --out"
        )
    if foreign := _foreign(work):
        raise DataError(
            f"{work} holds files `trnrecipes data {command}` did not write ({listed(foreign, limit=5)}): it removes"
            " that dir when done; move them out of it (its parts then resume) or choose another --out"
        )


def remove_work_dir(work: Path, log) -> None:
    """A conversion's files out of `work`, then `work` itself if nothing else is in it (a file put there meanwhile
    stays, and so does the dir). One removed already (by hand, meanwhile) is left so."""
    if not work.is_dir():
        return
    foreign = _foreign(work)
    # The record last: a removal cut short leaves parts a rerun can still tell for this conversion's (and a walk
    # of the inputs still skips), not anonymous part files.
    for name in sorted(set(os.listdir(work)) - set(foreign), key=lambda n: (n == JOB, n)):
        _remove(work / name)
    if foreign:
        log(f"[trnrecipes] left {work} in place: it holds files the conversion did not write ({listed(foreign, 5)})")
    else:
        work.rmdir()


def _foreign(work: Path) -> list[str]:
    """The entries of `work` a conversion does not write: anything but its record, its lock, parts and temp files
    (regular files all, but a temp shard directory; no links)."""
    return sorted(
        e.name
        for e in os.scandir(work)
        if e.is_symlink()
        or not (
            (e.is_file() and (e.name in (JOB, LOCK) or PART.fullmatch(e.name) or TEMP.fullmatch(e.name)))
            or (e.is_dir() and TEMP.fullmatch(e.name))
        )
    )


def _make(work: Path, job: dict, command: str) -> None:
    """`work` created whole, the job's record already in it (a temp dir renamed into place), so that a dir without
    the record is never a conversion's."""
    if work.exists():
        return
    work.parent.mkdir(parents=True, exist_ok=True)
    for old in stale_temps(work):  # a process killed while it made its work dir: a hidden dir nothing else removes
        with contextlib.suppress(OSError):  # removed meanwhile, by another conversion
            # Made a minute ago or more: one of a process on another node (its pid means nothing here) lives for the
            # milliseconds it takes to write the job's record.
            stale = time.time() - old.lstat().st_mtime > STALE_STAGING_S and old.is_dir() and not old.is_symlink()
            if stale and all(n == JOB or TEMP.fullmatch(n) for n in os.listdir(old)):
                shutil.rmtree(old, ignore_errors=True)
    staging = temp_path(work)
    staging.mkdir()  # not mkdtemp: its mode 0700 would stay
    try:
        with atomic_file(staging / JOB) as f:
            f.write(json.dumps(job, indent=1) + "\n")
    except BaseException:  # a full disk: no staging dir left beside the output
        shutil.rmtree(staging, ignore_errors=True)
        raise
    try:
        os.rename(staging, work)  # fails if another conversion made it first (its record in it: not empty)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        check_ours(work, command)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()
