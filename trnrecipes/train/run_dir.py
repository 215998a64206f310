"""What a trainer may do to its run dir: hold it alone (a lock), settle the checkpoints already there before it
writes any (resume, refuse, or archive), and prune. Whether a checkpoint's recipe allows resuming: resume_compat.

Everything here runs on rank 0 only (one per job, whatever the node count) and imports no torch.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

from trnrecipes.checkpoint import DONE, CheckpointError, verify
from trnrecipes.recipe import RecipeError

STEP_DIR = re.compile(r"^step_(\d+)$")
TEMP_DIR = re.compile(r"^\.step_\d+\.tmp$")  # a save in progress (trnrecipes.train.checkpointing)
PRUNING = re.compile(r"^\.prune-step_\d+$")  # a step dir renamed for deletion: gone from view in one rename
UNUSABLE = "unusable"  # checkpoints/unusable/step_N: complete-looking checkpoints that failed verification
LOCK_FILE = ".trnrecipes.lock"
HEARTBEAT_S = 30.0  # the fallback lock (file systems without flock) is stale after 4 missed heartbeats


class RunDirBusy(RecipeError):
    """Another trainer holds the run dir."""


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, dir) of every step_N directory of this run dir, newest first. A symlinked step dir is refused: it
    would make pruning and cleanup act on another run's checkpoint."""
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        if not (m := STEP_DIR.match(p.name)):
            continue
        if p.is_symlink():
            raise CheckpointError(
                f"{p} is a symlink (to {os.readlink(p)}): a run dir holds its own checkpoints. Remove the link; to"
                " start from another run's checkpoint copy it in, or use train.init_from"
            )
        if p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found, reverse=True)


def _move_aside(path: Path, root: Path) -> Path:
    """checkpoints/unusable/step_N[.K]: out of every reader's and pruner's view, kept as evidence."""
    aside = root / UNUSABLE
    aside.mkdir(exist_ok=True)
    target, k = aside / path.name, 0
    while target.exists():
        k += 1
        target = aside / f"{path.name}.{k}"
    os.replace(path, target)
    return target


def settle_checkpoints(root: Path, resume: bool, force_fresh: bool, log=print) -> tuple[int, Path] | None:
    """Before the first save: the checkpoint to resume from (verified), or None to start at step 0.

    - Leftovers of interrupted saves (.step_N.tmp) and prunes (.prune-step_N) are deleted; they were never
      complete. Symlinks among them, or among step dirs, are refused, never followed.
    - resume: step dirs newer than the newest one that verifies are moved to checkpoints/unusable/ (a corrupt or
      half-pruned newer checkpoint must not outrank the valid one in later runs, in pruning or in eval).
    - not resume: a run dir with checkpoints is refused unless force_fresh, which moves checkpoints/ and the
      metrics aside to RUN_DIR/archived/<time>/ (a new run's saves would otherwise mix with the old run's).
    """
    if not root.is_dir():
        return None
    for p in sorted(root.iterdir()):
        if TEMP_DIR.match(p.name) or PRUNING.match(p.name):
            if p.is_symlink():
                raise CheckpointError(f"{p} is a symlink (to {os.readlink(p)}): refusing to write or delete through it")
            log(f"[trnrecipes] removing incomplete checkpoint {p.name}")
            shutil.rmtree(p)
    found = step_dirs(root)
    if not resume:
        if not found:
            return None
        names = ", ".join(p.name for _, p in found[:3]) + (", ..." if len(found) > 3 else "")
        if not force_fresh:
            raise RecipeError(
                f"{root} already has checkpoints ({names}) and checkpoint.resume is false: resume (the default), use"
                " another run_dir, or set checkpoint.force_fresh=true to move them aside and start at step 0"
            )
        archive = _archive(root.parent)
        log(f"[trnrecipes] checkpoint.force_fresh: moved the previous run's checkpoints and metrics to {archive}")
        return None
    for step, path in found:
        try:
            verify(path)
        except CheckpointError as err:
            where = _move_aside(path, root)
            log(f"[trnrecipes] checkpoint {path.name} is unusable, moved to {where} (trying the one before): {err}")
            continue
        return step, path
    return None


def _archive(run_dir: Path) -> Path:
    archive = run_dir / "archived" / time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    while archive.exists():
        archive = archive.with_name(archive.name + "+")
    archive.mkdir(parents=True)
    for name in ("checkpoints", "metrics.jsonl", "tensorboard"):
        if (run_dir / name).exists():
            os.replace(run_dir / name, archive / name)
    return archive


def prune(root: Path, keep_last: int, newest_valid: int, log=print) -> None:
    """Keep the newest `keep_last` complete checkpoints up to `newest_valid` (a step known to verify: the one
    resumed from or one this run wrote), delete the older ones. Nothing newer than newest_valid is touched: only
    checkpoints at or below a valid one can be counted, so the newest valid checkpoint is never deleted."""
    candidates = [(s, p) for s, p in step_dirs(root) if s <= newest_valid and (p / DONE).exists()]
    for _, path in candidates[keep_last:]:
        doomed = root / f".prune-{path.name}"
        os.replace(path, doomed)  # one rename: a half-deleted dir is never seen as step_N
        shutil.rmtree(doomed)
        log(f"[trnrecipes] pruned checkpoint {path.name} (checkpoint.keep_last {keep_last})")


# ---- the lock


def _holder_text(path: Path) -> str:
    try:
        h = json.loads(path.read_text())
        job = f", Slurm job {h['job']}" if h.get("job") else ""
        return f"pid {h['pid']} on {h['host']}{job}, since {h['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "an unknown process"


def _holder_record() -> dict:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "job": os.environ.get("SLURM_JOB_ID"),
        "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "heartbeat": time.time(),
    }


class RunDirLock:
    """An exclusive lock on the run dir for the whole training run, taken by the job's rank 0 only.

    flock(2) on RUN_DIR/.trnrecipes.lock: the kernel releases it when the process dies however it dies, so a lock
    left by a crash is never in the way (the file's holder record is then just history). Where the file system has
    no flock (some Lustre mounts), a heartbeat in the file stands in: the holder rewrites it every 30 s and a lock
    whose heartbeat is 2 minutes old, or whose pid is gone on this host, is taken over."""

    def __init__(self, run_dir: Path, log: Callable[[str], None] = print, use_flock: bool = True):
        self.path = Path(run_dir) / LOCK_FILE
        self.log, self.use_flock = log, use_flock
        self._fd: int | None = None
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def acquire(self) -> RunDirLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.use_flock:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise RunDirBusy(self._busy_message()) from None
            except OSError as err:
                os.close(fd)
                if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    raise
                self.log(f"[trnrecipes] {self.path.parent}: no flock on this file system ({err}); using a heartbeat")
                self.use_flock = False
            else:
                self._fd = fd
                self._take_over_notice()
                os.ftruncate(fd, 0)
                os.pwrite(fd, json.dumps(_holder_record()).encode(), 0)
                return self
        self._acquire_heartbeat()
        return self

    def _busy_message(self) -> str:
        return (
            f"run dir {self.path.parent} is in use by another trainer ({_holder_text(self.path)}); wait for it to"
            " finish, stop it, or train into another run_dir"
        )

    def _take_over_notice(self) -> None:
        if self.path.stat().st_size:
            self.log(f"[trnrecipes] taking over the run dir lock left by {_holder_text(self.path)} (no longer running)")

    def _acquire_heartbeat(self) -> None:
        if self.path.exists() and self._alive(self.path):
            raise RunDirBusy(self._busy_message())
        if self.path.exists():
            self._take_over_notice()
        self._write_record()
        self._beat = threading.Thread(target=self._heartbeat, name="run-dir-lock", daemon=True)
        self._beat.start()

    @staticmethod
    def _alive(path: Path) -> bool:
        try:
            h = json.loads(path.read_text())
            if h["host"] == socket.gethostname():
                return Path(f"/proc/{int(h['pid'])}").exists() and int(h["pid"]) != os.getpid()
            return time.time() - float(h["heartbeat"]) < 4 * HEARTBEAT_S
        except (OSError, ValueError, KeyError, TypeError):
            return False  # unreadable: a crash mid-write; nobody can be holding it in a known way

    def _write_record(self) -> None:
        tmp = self.path.with_name(f"{LOCK_FILE}.{os.getpid()}")
        tmp.write_text(json.dumps(_holder_record()))
        os.replace(tmp, self.path)

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            self._write_record()

    def release(self) -> None:
        self._stop.set()
        if self._fd is not None:
            os.ftruncate(self._fd, 0)  # an empty file: the next trainer knows this one ended cleanly
            os.close(self._fd)  # releases the flock
            self._fd = None
        if self._beat is not None:
            self._beat.join()
            self._beat = None
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> RunDirLock:
        return self.acquire()

    def __exit__(self, *_exc) -> None:
        self.release()
