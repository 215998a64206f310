"""What a trainer may do to its run dir: check that it can write there, hold it alone (a lock), settle the
checkpoints already there before it writes any (resume, refuse, or archive). Pruning old checkpoints is the writer's
(trnrecipes.checkpoint.writer.prune); whether a checkpoint's recipe allows resuming, resume_compat's.

Everything here runs on rank 0 only (one per job, whatever the node count) and imports no torch.
"""

from __future__ import annotations

import contextlib
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

from trnrecipes.checkpoint import CheckpointError, CheckpointReadError, verify_training
from trnrecipes.checkpoint.format import STORAGE_ERRNOS, step_dirs
from trnrecipes.checkpoint.writer import PRUNING
from trnrecipes.config.sections import RecipeError
from trnrecipes.data.work_dir import atomic_file
from trnrecipes.files.outputs import run_dir_in_checkpoints
from trnrecipes.files.run_files import (
    ARCHIVED,
    CHECKPOINTS,
    EVAL_RESULTS,
    FRESH_START,
    LOCK_CLAIM,
    LOCK_FILE,
    METRICS,
    METRICS_DROPPED,
    TENSORBOARD,
    TRACKERS,
)
from trnrecipes.schema import shown

TEMP_DIR = re.compile(r"^\.step_\d+\.tmp$")  # a save in progress (trnrecipes.checkpoint.writer)
UNUSABLE = "unusable"  # checkpoints/unusable/step_N: complete-looking checkpoints that failed verification
RECORD_BYTES = 512  # the lock file's holder record, space-padded JSON


class RunDirBusy(RecipeError):
    """Another trainer holds the run dir."""


def require_writable(run_dir: Path) -> None:
    """Before anything else is done to it: the run dir, and its checkpoints/ if there is one, take a new file.
    Tried with a probe file rather than os.access: root passes every mode bit, and a read-only mount fails only
    when written to. Nor is it made inside a checkpoint (files.outputs.run_dir_in_checkpoints)."""
    if why := run_dir_in_checkpoints(run_dir):
        raise RecipeError(f"run dir {run_dir}: {why}; nothing was changed")
    for directory in (run_dir, run_dir / "checkpoints"):
        probe = directory / f".trnrecipes-probe-{os.getpid()}-{os.urandom(4).hex()}"
        try:
            if directory == run_dir:
                run_dir.mkdir(parents=True, exist_ok=True)
            elif not directory.is_dir():
                continue
            os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o600))
            probe.unlink()
        except OSError as err:
            if err.errno not in STORAGE_ERRNOS:
                raise
            raise RecipeError(
                f"run dir {run_dir} is not writable: {err}; nothing was changed. Make it writable for this user (uid"
                f" {os.geteuid()}), or train into another run_dir, and resubmit"
            ) from None


def _move_aside(path: Path, root: Path) -> Path:
    """checkpoints/unusable/step_N[.K]: out of every reader's and pruner's view, kept as evidence."""
    aside = root / UNUSABLE
    if aside.is_symlink() or (aside.exists() and not aside.is_dir()):
        raise CheckpointError(f"{aside} exists and is not a directory: cannot move {path.name} aside into it")
    aside.mkdir(exist_ok=True)
    target, k = aside / path.name, 0
    while target.exists():
        k += 1
        target = aside / f"{path.name}.{k}"
    os.replace(path, target)
    return target


def _remove_leftovers(root: Path, log) -> None:
    """Leftovers of interrupted saves (.step_N.tmp) and prunes (.prune-step_N): never complete, so deleted."""
    for p in sorted(root.iterdir()):
        if not (TEMP_DIR.match(p.name) or PRUNING.match(p.name)):
            continue
        if p.is_symlink():
            link = shown(os.readlink(p))
            raise CheckpointError(f"{p} is a symlink (to {link}): refusing to write or delete through it")
        what = "an interrupted prune's leftover" if PRUNING.match(p.name) else "incomplete checkpoint"
        log(f"[trnrecipes] removing {what} {p.name}")
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()


def settle_checkpoints(
    root: Path, resume: bool, force_fresh: bool, log=print, restarted: bool = False
) -> tuple[int, Path] | None:
    """Before the first save: the checkpoint to resume from (verified), or None to start at step 0.

    - Leftovers of interrupted saves and prunes are deleted. Symlinks among them, or among step dirs, are refused.
    - resume: step dirs newer than the newest one that verifies are moved to checkpoints/unusable/ (a corrupt
      newer checkpoint must not outrank the valid one in later runs, in pruning or in eval). If none verifies,
      nothing is moved and the run is refused: starting over at step 0 is the user's call (force_fresh).
      An I/O error while reading is not corruption: it stops the run and moves nothing.
    - not resume: a run dir with checkpoints is refused unless force_fresh, which moves checkpoints/ and the
      metrics aside to RUN_DIR/archived/<time>/ (a new run's saves would otherwise mix with the old run's). A
      restarted job (`restarted`: a requeue, HyperPod's auto-resume) resumes its own checkpoints instead: refusing
      them would end the job its requeue just continued, and archiving again would throw its progress away.
    """
    if not root.is_dir():
        return None
    _remove_leftovers(root, log)
    found = step_dirs(root)
    if not found:
        return None
    names = ", ".join(p.name for _, p in found[:3]) + (", ..." if len(found) > 3 else "")
    if not resume and restarted:
        log(
            "[trnrecipes] a restart of the job that started this run (a requeue or auto-resume): resuming its"
            " checkpoints; checkpoint.resume false and force_fresh apply to the job's first launch"
        )
    if not resume and not restarted:
        if not force_fresh:
            raise RecipeError(
                f"{root} already has checkpoints ({names}) and checkpoint.resume is false: resume (the default), use"
                " another run_dir, or set checkpoint.force_fresh=true to move them aside and start at step 0"
            )
        archive = _archive(root.parent)
        log(f"[trnrecipes] checkpoint.force_fresh: moved the previous run's checkpoints and metrics to {archive}")
        return None
    unusable: list[tuple[Path, CheckpointError]] = []
    for step, path in found:
        try:
            verify_training(path)
        except CheckpointReadError:
            raise
        except CheckpointError as err:
            unusable.append((path, err))
            continue
        for bad, err in unusable:
            where = _move_aside(bad, root)
            log(f"[trnrecipes] checkpoint {bad.name} is unusable, moved to {where}: {err}")
        return step, path
    raise RecipeError(
        f"{root}: none of its checkpoints ({names}) verifies, the newest because: {unusable[0][1]}. Nothing was"
        " changed. Repair or remove them, or start over with checkpoint.resume=false checkpoint.force_fresh=true"
        " (which moves them aside)"
    )


def record_fresh_start(run_dir: Path, env=os.environ) -> None:
    """A run started at step 0 with checkpoint.resume false: which launch of which Slurm job started it, so that
    job's restarts are known (restarted_job)."""
    record = {"slurm_job_id": env.get("SLURM_JOB_ID"), "restart_count": _restarts(env),
              "launch_id": env.get("TRNRECIPES_LAUNCH_ID")}  # fmt: skip
    with atomic_file(run_dir / FRESH_START) as f:
        f.write(json.dumps(record) + "\n")


def restarted_job(run_dir: Path, env=os.environ) -> bool:
    """Whether this launch restarts the run in the run dir (started at step 0 with checkpoint.resume false): the
    same Slurm job, either requeued since (a higher SLURM_RESTART_COUNT) or in the same run of its script
    (HyperPod's --auto-resume reruns the step, with no restart count). Not: another job, the same allocation's
    script run again (salloc), a job requeued before the run ever started (its checkpoints are another run's), no
    Slurm at all (bash run.sbatch, EKS)."""
    job = env.get("SLURM_JOB_ID")
    try:
        started = json.loads((run_dir / FRESH_START).read_text())
    except (OSError, ValueError):
        return False
    if not job or not isinstance(started, dict) or started.get("slurm_job_id") != job:
        return False
    launch = env.get("TRNRECIPES_LAUNCH_ID")
    same_launch = launch is not None and started.get("launch_id") == launch
    earlier = started.get("restart_count")
    return same_launch or (isinstance(earlier, int) and _restarts(env) > earlier)


def _restarts(env) -> int:
    try:
        return int(env.get("SLURM_RESTART_COUNT") or 0)
    except ValueError:
        return 0


def _archive(run_dir: Path) -> Path:
    archive = run_dir / ARCHIVED / time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    while archive.exists():
        archive = archive.with_name(archive.name + "+")
    archive.mkdir(parents=True)
    # the next run: new tracker runs; eval's results of the old weights (its RUN_DIR/eval/step_N would refuse the new)
    for name in (CHECKPOINTS, METRICS, METRICS_DROPPED, TENSORBOARD, TRACKERS, EVAL_RESULTS):
        if (run_dir / name).exists():
            os.replace(run_dir / name, archive / name)
    return archive


# ---- the lock


def _holder_text(record: dict | None) -> str:
    try:
        job = f", Slurm job {shown(record['job'])}" if record.get("job") else ""
        return f"pid {int(record['pid'])} on {shown(record['host'])}{job}, since {shown(record['since'])}"
    except (AttributeError, KeyError, TypeError, ValueError):
        return "an unknown process"


class RunDirLock:
    """An exclusive lock on the run dir for the whole training run, taken by the job's rank 0 only.

    Two layers, because shared file systems differ:
    - flock(2) on RUN_DIR/.trnrecipes.lock: the kernel drops it when the process dies however it dies, so a crash
      never leaves the dir locked.
    - a holder record in that file (host, pid, Slurm job, heartbeat), rewritten in place every `heartbeat_s`. Where
      flock is node-local (NFS local_lock=flock, Lustre localflock) a second node's flock succeeds; a fresh record
      from another holder still refuses it. Where there is no flock at all, an O_EXCL claim file serialises the
      check-and-write. A record whose heartbeat stops is stale after 4 beats (a crashed node): its successor waits
      that long at most, and takes over once the beat has stopped. Hosts' clocks are assumed to agree within a beat.
    """

    def __init__(self, run_dir: Path, log: Callable[[str], None] = print, use_flock: bool = True, heartbeat_s=30.0):
        self.path = Path(run_dir) / LOCK_FILE
        self.log, self.use_flock, self.heartbeat_s = log, use_flock, heartbeat_s
        since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.record = {"host": socket.gethostname(), "pid": os.getpid(), "job": os.environ.get("SLURM_JOB_ID"),
                       "since": since, "token": os.urandom(8).hex()}  # fmt: skip
        self._fd: int | None = None
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def acquire(self) -> RunDirLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as err:  # ELOOP: a symlink planted where the lock goes
            raise RunDirBusy(f"{self.path}: cannot open the run dir lock ({err.strerror or err})") from None
        try:
            if self.use_flock and not self._flock(fd):
                raise RunDirBusy(self._busy(self._read(fd)))
            with self._claim():
                self._wait_out_previous_holder(fd)
                self._write(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._beat = threading.Thread(target=self._heartbeat, name="run-dir-lock", daemon=True)
        self._beat.start()
        return self

    def _flock(self, fd: int) -> bool:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False
        except OSError as err:
            if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            self.log(f"[trnrecipes] {self.path.parent}: no flock on this file system ({err}); using the heartbeat only")
            self.use_flock = False
            return True

    @contextlib.contextmanager
    def _claim(self):
        """Without flock, contenders take turns through an O_EXCL file (one left by a crash is stale after 60 s)."""
        if self.use_flock:
            yield
            return
        claim = self.path.with_name(LOCK_CLAIM)
        deadline = time.monotonic() + 120
        while True:
            try:
                os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o644))
                break
            except FileExistsError:
                with contextlib.suppress(FileNotFoundError):
                    if time.time() - claim.stat().st_mtime > 60:
                        claim.unlink()
                if time.monotonic() > deadline:
                    raise RunDirBusy(f"{claim}: another trainer is taking the run dir lock; try again") from None
                time.sleep(0.05)
        try:
            yield
        finally:
            claim.unlink(missing_ok=True)

    @staticmethod
    def _read(fd: int) -> dict | None:
        try:
            record = json.loads(os.pread(fd, 4096, 0) or b"null")
            return record if isinstance(record, dict) else None
        except (OSError, ValueError):
            return None

    def _alive(self, record: dict | None) -> bool:
        """Whether a record may belong to a running trainer: fresh heartbeat, and on this host a live pid."""
        try:
            fresh = time.time() - float(record["heartbeat"]) < 4 * self.heartbeat_s
            if record["host"] == self.record["host"]:
                return fresh and int(record["pid"]) != os.getpid() and Path(f"/proc/{int(record['pid'])}").exists()
            return fresh
        except (KeyError, TypeError, ValueError):
            return False

    def _wait_out_previous_holder(self, fd: int) -> None:
        record = self._read(fd)
        if record is not None and not self._alive(record):
            self.log(f"[trnrecipes] taking over the run dir lock left by {_holder_text(record)} (no longer running)")
            return
        first = record
        while self._alive(record):
            if record.get("heartbeat") != first.get("heartbeat"):  # still beating: it is held elsewhere
                raise RunDirBusy(self._busy(record))
            time.sleep(self.heartbeat_s / 4)
            record = self._read(fd)
        if first is not None:
            self.log(f"[trnrecipes] taking over the run dir lock left by {_holder_text(first)} (its heartbeat stopped)")

    def _write(self, fd: int) -> None:
        # In place (the flock stays on this inode), padded to one size and never truncated first: a reader never
        # sees an empty file, which would read as "no holder".
        data = json.dumps({**self.record, "heartbeat": time.time()}).ljust(RECORD_BYTES).encode()
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                current = self._read(self._fd)
                if current is not None and current.get("token") != self.record["token"]:
                    self.log(f"[trnrecipes] ERROR: the run dir lock was taken over by {_holder_text(current)}")
                    return
                self._write(self._fd)
            except OSError as err:  # a flaky shared FS: keep trying; the record goes stale only after 4 misses
                self.log(f"[trnrecipes] warning: could not refresh the run dir lock: {err}")

    def _busy(self, record: dict | None) -> str:
        return (
            f"run dir {self.path.parent} is in use by another trainer ({_holder_text(record)}); wait for it to"
            " finish, stop it, or train into another run_dir"
        )

    def release(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
            self._beat = None
        if self._fd is not None:
            with contextlib.suppress(OSError):
                if (self._read(self._fd) or {}).get("token") == self.record["token"]:
                    os.ftruncate(self._fd, 0)  # empty: the next trainer knows this one ended cleanly
            os.close(self._fd)  # drops the flock
            self._fd = None

    def __enter__(self) -> RunDirLock:
        return self.acquire()

    def __exit__(self, *_exc) -> None:
        self.release()
