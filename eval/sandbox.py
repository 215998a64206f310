"""Run untrusted model-written code (HumanEval completions) so that it cannot hurt the machine or the harness.

Every program runs in its own process, and where the OS allows it (Linux, started as root):
- its own network namespace (no interfaces up: no loopback, no internet) and mount namespace in which the whole file
  system is read-only except a throw-away working directory, with a private, small tmpfs on /tmp and /dev/shm;
- a uid of its own (65000 + slot), so RLIMIT_NPROC bounds a fork bomb, it may not signal the harness, and every
  process it leaves behind can be found and killed afterwards whatever session it moved to;
- rlimits on CPU seconds, address space, file size, open files and processes, and a wall-clock timeout.
Without root only the process, rlimits, timeout and working directory apply (`isolation` says which).
Nothing runs unless the caller has opted in: run_program(..., allow_code_execution=True).
"""

from __future__ import annotations

import ctypes
import os
import resource
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

CLONE_NEWNS, CLONE_NEWNET = 0x00020000, 0x40000000
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18
UID_BASE = 65000
WORK_BASE = Path("/var/tmp/trnrecipes-sandbox")
# The system interpreter: the venv's may live under /root, which the sandbox uid cannot read.
PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else shutil.which("python3")


class ExecutionNotAllowed(RuntimeError):
    pass


@dataclass
class Outcome:
    status: str  # passed | failed | timeout
    detail: str  # the last line of stderr, or why it timed out
    isolation: str  # what contained it: "namespaces+uid+rlimits" or "rlimits"

    @property
    def passed(self) -> bool:
        return self.status == "passed"


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 10.0
    memory_mb: int = 1024
    max_procs: int = 32
    max_file_mb: int = 16
    max_open_files: int = 64


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _mount(libc, source, target, fstype, flags, data=None) -> None:
    enc = [None if x is None else x.encode() for x in (source, target, fstype, data)]
    if libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]) != 0:
        raise OSError(ctypes.get_errno(), f"mount {target}")


def _child_setup(workdir: str, uid: int | None, limits: Limits):
    """Runs in the child between fork and exec: namespaces and mounts (as root), rlimits, then the uid drop."""

    def setup() -> None:
        if uid is not None:
            libc = _libc()
            if libc.unshare(CLONE_NEWNS | CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "unshare")
            _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)  # nothing we do here leaks to the host
            _mount(libc, workdir, workdir, None, MS_BIND)  # the one writable place, kept writable below
            _mount(libc, "/", "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY)
            for tmp in ("/tmp", "/dev/shm"):
                if os.path.isdir(tmp):
                    _mount(libc, "tmpfs", tmp, "tmpfs", 0, f"size={limits.max_file_mb}m,mode=1777")
            os.chdir(workdir)  # enter the writable bind mount (the cwd set before it points below it)
        cpu = int(limits.timeout_s) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
        memory = limits.memory_mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        size = limits.max_file_mb << 20
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits.max_open_files, limits.max_open_files))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if uid is not None:
            resource.setrlimit(resource.RLIMIT_NPROC, (limits.max_procs, limits.max_procs))
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)

    return setup


PR_SET_CHILD_SUBREAPER = 36
_subreaper = False


def _become_subreaper() -> None:
    """Orphans of sandboxed programs are re-parented to this process instead of init (which, in a container, may
    never reap them): their zombies would otherwise keep counting against the sandbox uid's process limit."""
    global _subreaper
    if not _subreaper:
        _libc().prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        _subreaper = True


def _uid_pids(uid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and os.stat(f"/proc/{entry}").st_uid == uid:
                pids.append(int(entry))
        except FileNotFoundError:
            continue
    return pids


def _kill_uid(uid: int) -> None:
    """Every process of the sandbox's own uid, wherever it went (setsid, double fork, a fork bomb refilling its
    slots): `kill -9 -1` run AS that uid reaches all of them at once, which a scan-then-kill loop can not."""

    def become() -> None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)

    for _ in range(50):
        pids = _uid_pids(uid)
        if not pids:
            return
        subprocess.run(["/bin/kill", "-9", "-1"], preexec_fn=become, capture_output=True)
        for pid in pids:  # reap the ones re-parented to us (only these pids: other children are not ours to reap)
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
        time.sleep(0.01)


def run_program(program: str, limits: Limits = Limits(), slot: int = 0, allow_code_execution: bool = False) -> Outcome:
    """Run `program` (Python source) to completion or timeout; exit status 0 means passed."""
    if not allow_code_execution:
        raise ExecutionNotAllowed(
            "executing model-generated code needs an explicit opt-in (--allow-code-execution); it runs in a"
            " sandbox, but it is still untrusted code"
        )
    isolated = os.geteuid() == 0 and os.uname().sysname == "Linux"
    uid = UID_BASE + slot if isolated else None
    if isolated:
        _become_subreaper()
    # Not under /tmp: the sandbox gets a private tmpfs there, which would hide its own working directory.
    WORK_BASE.mkdir(mode=0o755, parents=True, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="run-", dir=WORK_BASE)
    try:
        Path(workdir, "program.py").write_text(program)
        if uid is not None:
            os.chown(workdir, uid, uid)
            os.chown(Path(workdir, "program.py"), uid, uid)
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "PYTHONDONTWRITEBYTECODE": "1", "LANG": "C.UTF-8"}
        # stderr to a file, not a pipe: a detached grandchild holding the pipe open must not keep us waiting.
        errors = tempfile.TemporaryFile()
        proc = subprocess.Popen(
            [PYTHON, "-I", "program.py"],
            cwd=workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=errors,
            preexec_fn=_child_setup(workdir, uid, limits),
            start_new_session=True,
        )
        try:
            proc.wait(timeout=limits.timeout_s)
            status = "passed" if proc.returncode == 0 else "failed"
            errors.seek(0)
            lines = errors.read()[-65536:].decode(errors="replace").strip().splitlines()
            detail = lines[-1] if lines else f"exit status {proc.returncode}"
        except subprocess.TimeoutExpired:
            status, detail = "timeout", f"no result within {limits.timeout_s:g} s"
        finally:
            errors.close()
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            if uid is not None:
                _kill_uid(uid)
            proc.wait()
        return Outcome(status, detail, "namespaces+uid+rlimits" if uid is not None else "rlimits")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021, the Codex paper): 1 - C(n - c, k) / C(n, k), computed stably."""
    if not 0 <= c <= n or k < 1:
        raise ValueError(f"need 0 <= c <= n and k >= 1, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    prob_all_fail = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_fail *= 1.0 - k / i
    return 1.0 - prob_all_fail
