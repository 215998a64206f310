"""Run untrusted model-written code (HumanEval completions) so that it cannot hurt the machine or the harness.

Every program runs in its own process, and where the OS allows it (Linux, started as root):
- its own network namespace (no interfaces up: no loopback, no internet) and mount namespace in which the whole file
  system is read-only except a throw-away working directory, with a private, small tmpfs on /tmp and /dev/shm;
- a uid of its own (claim_uids: one no account, group or running process has), so RLIMIT_NPROC bounds a fork bomb,
  it may not signal the harness, and every process it leaves behind can be found and killed afterwards whatever
  session it moved to;
- rlimits on CPU seconds, address space, file size, open files and processes, and a wall-clock timeout.
Without root only the process, rlimits, timeout and working directory apply (`isolation` says which).
Nothing runs unless the caller has opted in: run_program(..., allow_code_execution=True).

A program passes only if it exits 0 AND ran to its end: the harness appends a line that writes a random per-run token
to a file descriptor only the harness reads. Threat model: this catches programs that stop early and still exit 0
(`sys.exit(0)` or `os._exit(0)` in a completion, before the tests run). It does not stop a program written to forge
the token: the token is in its own source, which it can read.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import grp
import os
import pwd
import resource
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

CLONE_NEWNS, CLONE_NEWNET = 0x00020000, 0x40000000
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18
# Candidate sandbox uids (each also used as its gid), all below nobody (65534); claim_uids takes only free ones.
UID_RANGE = range(65000, 65256)
MAX_WORKERS = 64  # programs at once, one uid each: well inside UID_RANGE even with some of it taken
WORK_BASE = Path("/var/tmp/trnrecipes-sandbox")
# The system interpreter: the venv's may live under /root, which the sandbox uid cannot read.
PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else shutil.which("python3")


class ExecutionNotAllowed(RuntimeError):
    pass


class SandboxError(RuntimeError):
    """The sandbox itself cannot be set up (no free uid), as opposed to a program that fails."""


def require_opt_in(allow_code_execution: bool) -> None:
    if not allow_code_execution:
        raise ExecutionNotAllowed(
            "executing model-generated code needs an explicit opt-in (--allow-code-execution); it runs in a"
            " sandbox, but it is still untrusted code"
        )


@dataclass
class Outcome:
    status: str  # passed | failed | timeout | error (the harness could not run or clean up after it: a failure)
    detail: str  # the last line of stderr, why it timed out, or what went wrong in the harness
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


def isolated() -> bool:
    """Namespaces and a uid of its own need root on Linux; elsewhere only rlimits, timeout and process apply."""
    return os.geteuid() == 0 and os.uname().sysname == "Linux"


def _ids_in_use() -> set[int]:
    """Every uid and gid that an account or group has, or that any running process holds (real, effective, saved
    or file-system: /proc/PID/status)."""
    accounts = pwd.getpwall()
    used = {p.pw_uid for p in accounts} | {p.pw_gid for p in accounts} | {g.gr_gid for g in grp.getgrall()}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                for line in f:
                    if line.startswith(("Uid:", "Gid:")):
                        used.update(int(x) for x in line.split()[1:])
        except OSError:  # it exited meanwhile
            continue
    return used


@contextlib.contextmanager
def claim_uids(count: int) -> Iterator[list[int | None]]:
    """`count` sandbox uids for the block: ones from UID_RANGE that no account, group or running process uses,
    each held with an flock so that a second evaluation on the host skips it (cleanup kills every process of a
    sandbox uid: a uid shared with anyone else would take their processes down). Without isolation: [None] * count.
    """
    if not 1 <= count <= MAX_WORKERS:
        raise ValueError(f"sandbox programs at once must be between 1 and {MAX_WORKERS}, got {count}")
    if not isolated():
        yield [None] * count
        return
    WORK_BASE.mkdir(mode=0o755, parents=True, exist_ok=True)
    held: list[tuple[int, int]] = []
    try:
        used = _ids_in_use()
        for uid in UID_RANGE:
            if len(held) == count:
                break
            if uid in used:
                continue
            fd = os.open(WORK_BASE / f"uid-{uid}.lock", os.O_RDWR | os.O_CREAT, 0o600)  # 0600: no sandbox opens it
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # another evaluation on this host has it
                os.close(fd)
                continue
            held.append((uid, fd))
        if len(held) < count:
            raise SandboxError(
                f"{count} sandbox uids asked for, {len(held)} free in {UID_RANGE.start}-{UID_RANGE.stop - 1} (the"
                " rest belong to accounts, groups, running processes or another evaluation): use fewer --workers"
            )
        yield [uid for uid, _ in held]
    finally:
        for _, fd in held:
            os.close(fd)


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


def run_program(
    program: str, limits: Limits = Limits(), uid: int | None = None, allow_code_execution: bool = False
) -> Outcome:
    """Run `program` (Python source) to completion or timeout. It passes if it exits 0 having run to its last line.

    uid: one of claim_uids's, for callers running several at once; None claims one for this call.
    """
    require_opt_in(allow_code_execution)
    if not isolated():
        uid = None
    elif uid is None:
        with claim_uids(1) as (claimed,):
            return run_program(program, limits, claimed, allow_code_execution)
    else:
        _become_subreaper()
    # Not under /tmp: the sandbox gets a private tmpfs there, which would hide its own working directory.
    WORK_BASE.mkdir(mode=0o755, parents=True, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="run-", dir=WORK_BASE)
    try:
        outcome = _run(program, limits, uid, workdir)
    finally:
        leftover = _remove(workdir)
    if leftover:
        return Outcome("error", leftover, outcome.isolation)
    return outcome


def _run(program: str, limits: Limits, uid: int | None, workdir: str) -> Outcome:
    isolation = "namespaces+uid+rlimits" if uid is not None else "rlimits"
    # The end-of-program marker goes to a file only the harness reads, through an fd the program inherits (not to
    # stdout, which the program may close, replace or flood).
    with tempfile.TemporaryFile() as errors, tempfile.TemporaryFile() as marker:
        token = secrets.token_hex(16)
        end = f"\n\n__import__('os').write({marker.fileno()}, b'{token}')\n"
        Path(workdir, "program.py").write_text(program + end, encoding="utf-8")  # the encoding Python reads
        if uid is not None:
            os.chown(workdir, uid, uid)
            os.chown(Path(workdir, "program.py"), uid, uid)
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "PYTHONDONTWRITEBYTECODE": "1", "LANG": "C.UTF-8"}
        # stderr to a file, not a pipe: a detached grandchild holding the pipe open must not keep us waiting.
        proc = subprocess.Popen(
            [PYTHON, "-I", "program.py"],
            cwd=workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=errors,
            pass_fds=(marker.fileno(),),
            preexec_fn=_child_setup(workdir, uid, limits),
            start_new_session=True,
        )
        try:
            proc.wait(timeout=limits.timeout_s)
        except subprocess.TimeoutExpired:
            return Outcome("timeout", f"no result within {limits.timeout_s:g} s", isolation)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            if uid is not None:
                _kill_uid(uid)
            proc.wait()
        errors.seek(0)
        lines = errors.read()[-65536:].decode(errors="replace").strip().splitlines()
        if proc.returncode != 0:
            return Outcome("failed", lines[-1] if lines else f"exit status {proc.returncode}", isolation)
        marker.seek(0)
        if marker.read() != token.encode():
            return Outcome("failed", "exit status 0 before its last line ran (the tests did not finish)", isolation)
        return Outcome("passed", lines[-1] if lines else "exit status 0", isolation)


def _remove(workdir: str) -> str | None:
    """Remove a program's working directory whatever it left there; why not, if some of it stays."""
    try:
        shutil.rmtree(workdir)
        return None
    except Exception as err:  # e.g. RecursionError: a tree nested deeper than Python's recursion limit
        first = f"{type(err).__name__}: {err}"
    # rm walks any depth. Without root the program ran as us and may have left directories no one may enter.
    commands = [["rm", "-rf", "--", workdir]]
    if os.geteuid() != 0:
        commands.insert(0, ["chmod", "-R", "u+rwx", "--", workdir])
    for cmd in commands:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(cmd, capture_output=True, timeout=120)
    if not os.path.lexists(workdir):
        return None
    # What stays is put out of reach of later programs of the same uid.
    with contextlib.suppress(OSError):
        os.chmod(workdir, 0)
    with contextlib.suppress(OSError):
        os.chown(workdir, 0, 0)
    return f"its working directory {workdir} could not be removed ({first[:200]})"


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
