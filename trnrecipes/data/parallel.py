"""The units of a conversion (parts.py) converted by this process and spawned worker processes, or by this one
alone where one worker is asked for, their outcomes handed back in input order whatever order they finish in:
conversion.py replays each unit's bad records and joins its part in that order. Each process takes the next unit
not yet taken; this one takes one whenever the outcome it waits for has not come, and joins the parts done between
its units. No unit after one that failed is started, and workers stop when their parent is gone (killed), leaving
the parts done for a rerun to resume from.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import queue
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing import resource_tracker
from pathlib import Path
from typing import TYPE_CHECKING

from trnrecipes.data import DataError
from trnrecipes.data.inputs import InputFile
from trnrecipes.data.parts import Task, convert_unit

if TYPE_CHECKING:
    from tqdm import tqdm

PROGRESS_EVERY_S = 0.5
ALIVE_CHECK_S = 0.5
# How long a process waits to take the next unit. Taking one holds a lock its sharers hold for microseconds, so a wait
# this long means a worker was killed holding it (the OOM killer picks no moment), which would block the others.
TAKE_WAIT_S = 10.0


# Ctrl-C reaches every process of the terminal's group, Slurm's SIGTERM every process of the job step: the parent
# stops the workers (SIGKILL) and says what it kept, so a worker ignores both, from its start (_Pool._start), rather
# than print a traceback of its own or be told of as a worker that died.
STOPPING = (signal.SIGINT, signal.SIGTERM)


class WorkerDied(DataError):
    """A worker process ended without an outcome (killed: out of memory?); a rerun resumes."""

    may_pass = True  # not the input's fault: a requeue may pass


def default_workers() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def outcomes_in_order(tasks: list[Task], done: dict[int, dict], workers: int, bar: tqdm, work: Path) -> Iterator[dict]:
    """Each unit's outcome, in input order: recorded for the parts `done`, converted for the others (in this process
    where one worker is asked for, else by this one and `workers - 1` spawned processes). A unit that fails stops
    the units after it from being started: their outcome no longer matters. Closing the iterator stops the workers."""
    todo = [t for t in tasks if t.unit not in done]
    if workers <= 1 or len(todo) <= 1:
        for task in tasks:
            yield done[task.unit] if task.unit in done else convert_unit(task, _Ticker(bar.update))
        return
    pool = _Pool(todo, min(workers, len(todo)) - 1, bar, work)
    try:
        for task in tasks:
            yield done[task.unit] if task.unit in done else pool.outcome(task)
    finally:
        pool.close()


class _Ticker:
    """What a unit's conversion calls as it goes: it passes on the bytes read since the last call (at most every
    PROGRESS_EVERY_S), and raises _Stop where `stop` says the unit is no longer wanted."""

    def __init__(self, send: Callable[[int], None], stop: Callable[[], bool] = lambda: False):
        self.send, self.stop = send, stop
        self.sent, self.last = 0, time.monotonic()

    def __call__(self, read: int, final: bool = False) -> None:
        now = time.monotonic()
        if final or now - self.last >= PROGRESS_EVERY_S:
            if read > self.sent:
                self.send(read - self.sent)
                self.sent = read
            self.last = now
            if self.stop():
                raise _Stop


class _Stop(Exception):
    """The unit is no longer wanted (a unit before it failed), or this worker's parent is gone."""


def _next_task(tasks: list[Task], taken, work: Path | None = None) -> Task | None:
    """The first of `tasks` no process has taken yet (`taken` counts them: they are taken in order), now taken;
    None where all are. WorkerDied where the lock stays held (TAKE_WAIT_S: its holder was killed)."""
    lock = taken.get_lock()
    if not lock.acquire(timeout=TAKE_WAIT_S):
        raise WorkerDied(
            f"a worker died while taking its next unit (out of memory?), leaving the others unable to take theirs; the"
            f" parts done are kept in {work}: rerun the same command to resume from them"
        )
    try:
        k = taken.value
        if k >= len(tasks):
            return None
        taken.value = k + 1
    finally:
        lock.release()
    return tasks[k]


class _Pool:
    """This process and `spawned` worker processes converting `tasks`, each taking the next one not yet taken. The
    JSON parsing is CPU-bound, so threads would share one core. This process converts a unit whenever the outcome it
    waits for has not come: --workers 2 costs one interpreter more than --workers 1, not two, and the parts done are
    joined between its units rather than all after the last one."""

    def __init__(self, tasks: list[Task], spawned: int, bar: tqdm, work: Path):
        context = multiprocessing.get_context("spawn")  # fork would copy the parent's threads and locks
        self.tasks, self.bar, self.work = tasks, bar, work
        self.results = context.Queue()
        self.taken = context.Value("q", 0)  # how many of `tasks` a process has taken
        self.first_failed = context.Value("q", max(t.unit for t in tasks) + 1, lock=False)
        args = (tasks, self.taken, self.results, self.first_failed, os.getpid())
        self.processes = [context.Process(target=_serve, args=args, daemon=True) for _ in range(spawned)]
        self.outcomes: dict[int, dict] = {}
        self.running: dict[int, Task] = {}  # pid -> its task
        self.checked = time.monotonic()
        try:
            self._start()
        except BaseException:  # a start failing (EAGAIN), or SIGTERM meanwhile: the workers started are stopped (they
            self.processes = [p for p in self.processes if p.pid is not None]  # ignore it, and nothing would read
            self.close()  # their queue: exiting would wait for them)
            raise

    def _start(self) -> None:
        """The workers started with SIGINT and SIGTERM blocked, so that they reach a worker's _serve, which ignores
        them, even if sent amid its interpreter's start and imports (half a second, or seconds on a loaded node): a
        spawned process keeps the mask it is started with. Blocked, not ignored, here: a signal sent to this process
        meanwhile waits (or another thread takes it) rather than being lost. Python's multiprocessing.resource_tracker
        starts its process the same way, and clears these bits of the mask when it starts one: it is made to run
        first, before each start."""
        if not hasattr(signal, "pthread_sigmask"):  # not POSIX
            for p in self.processes:
                p.start()
            return
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, [])
        for p in self.processes:
            resource_tracker.ensure_running()
            signal.pthread_sigmask(signal.SIG_BLOCK, STOPPING)
            try:
                p.start()
            finally:  # between starts: a signal that came during one is taken before the next
                signal.pthread_sigmask(signal.SIG_SETMASK, previous)

    def outcome(self, task: Task) -> dict:
        while task.unit not in self.outcomes:
            # Checked on a clock, not only when the queue is quiet: the other workers' progress keeps it busy, and
            # a worker killed (out of memory) an hour into a day-long conversion must be told of then, not at the end.
            if time.monotonic() - self.checked >= ALIVE_CHECK_S:
                self._settle(task, ended=False)
                self.checked = time.monotonic()
                continue
            self._drain()  # outcomes sent already are joined before this process takes a unit
            if task.unit in self.outcomes:
                break
            own = _next_task(self.tasks, self.taken, self.work)
            if own is not None:
                self._convert(own, task)
                continue
            try:
                message = self.results.get(timeout=ALIVE_CHECK_S)
            except queue.Empty:
                self._settle(task, ended=all(p.exitcode is not None for p in self.processes))  # read before the look
                continue
            self._take(message, task)
        return self.outcomes.pop(task.unit)

    def _convert(self, own: Task, waiting: Task) -> None:
        """`own` converted in this process. As it goes (every PROGRESS_EVERY_S), the workers' messages are read and
        the workers judged, as while waiting for `waiting`: a worker dead amid a unit is told of during a long unit
        of this process's. What that judgement raises (WorkerDied, a worker's crash) stops the unit and is raised
        from here, not from within the unit, whose conversion would take a DataError for the input's fault."""
        fault: list[Exception] = []

        def stop() -> bool:
            try:
                self._settle(waiting, ended=False)
            except Exception as err:  # raised below, once the unit is stopped
                fault.append(err)
                return True
            self.checked = time.monotonic()
            return own.unit > self.first_failed.value

        outcome = {"unit": own.unit, "status": "cancelled"}
        if not stop():
            try:
                outcome = convert_unit(own, _Ticker(self.bar.update, stop))
            except _Stop:
                pass
        if fault:
            raise fault[0]
        self._record(own.unit, outcome)

    def _settle(self, task: Task, ended: bool) -> None:
        """Read what the workers already sent (what they sent before they ended is theirs, not lost); then, where
        `task`'s outcome is still missing, judge them. `ended`: every worker had ended before this look, so nothing
        more will come."""
        self._drain()
        if task.unit not in self.outcomes:
            self._check_alive(task, quiet=ended)

    def _drain(self) -> None:
        while True:
            try:
                message = self.results.get_nowait()
            except queue.Empty:
                return
            self._take(message, None)

    def _take(self, message: tuple, waiting: Task | None) -> None:
        kind, pid, unit, payload = message
        if kind == "start":
            self.running[pid] = payload
        elif kind == "progress":
            self.bar.update(payload)
        elif kind == "crash":
            failed = self.running.get(pid) or waiting
            raise RuntimeError(f"converting {_names(failed) if failed else f'unit {unit}'} failed:\n{payload}")
        else:
            self.running.pop(pid, None)
            self._record(unit, payload)

    def _record(self, unit: int, outcome: dict) -> None:
        self.outcomes[unit] = outcome
        if outcome["status"] != "done":
            self.first_failed.value = min(self.first_failed.value, unit)

    def _check_alive(self, waiting: Task, quiet: bool) -> None:
        """A worker that died amid a unit fails the conversion. `quiet`: every worker had ended before the queue was
        found empty, and every unit was taken, so nothing more will come and `waiting` never will."""
        for p in self.processes:
            if p.exitcode not in (None, 0) and p.pid in self.running:
                lost = self.running[p.pid]
                how = f"signal {-p.exitcode}" if p.exitcode < 0 else f"exit code {p.exitcode}"
                raise WorkerDied(
                    f"the worker converting {_names(lost)} died ({how}: out of memory?); the parts done are kept in"
                    f" {self.work}: rerun the same command to resume from them"
                )
        if quiet and self.taken.value >= len(self.tasks):
            raise WorkerDied(f"every worker ended before {_names(waiting)} was converted; rerun to resume")

    def close(self) -> None:
        for p in self.processes:
            if p.is_alive():
                p.kill()
            p.join()
        self.results.cancel_join_thread()
        self.results.close()


def _serve(tasks, taken, results, first_failed, parent: int) -> None:
    """A worker: converts the tasks it takes until none is left; a task after a unit that failed is skipped, and a
    worker whose parent is gone (killed) stops."""
    for s in STOPPING:
        signal.signal(s, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPPING)  # blocked since its start; one sent meanwhile is dropped
    _die_with(parent)
    try:
        _convert_tasks(tasks, taken, results, first_failed, parent)
    finally:
        if os.getppid() != parent:  # nobody reads what it sent: exit without waiting for the pipe to take it
            results.cancel_join_thread()


def _die_with(parent: int) -> None:
    """Have the kernel kill this worker the moment its parent dies (Linux): a rerun started at once would otherwise
    overlap workers still finishing the killed conversion's parts. (The kernel's signal follows the thread that
    started the worker: the pool is made and driven by the conversion's own thread.) Elsewhere the workers' checks
    of their parent (every PROGRESS_EVERY_S while converting) stop them."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ulong = ctypes.c_ulong
        done = ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, ulong(signal.SIGKILL), ulong(0), ulong(0),
                                                       ulong(0))  # fmt: skip
    except (OSError, AttributeError):
        return
    if done != 0:
        return
    if os.getppid() != parent:  # it died before the request took effect
        os._exit(0)


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _convert_tasks(tasks, taken, results, first_failed, parent: int) -> None:
    pid = os.getpid()

    def stop(task: Task) -> bool:
        return os.getppid() != parent or task.unit > first_failed.value

    while os.getppid() == parent:
        try:
            task = _next_task(tasks, taken)
        except WorkerDied:  # the lock's holder was killed: the parent, taking units too, finds it and says so
            return
        if task is None:
            return
        if stop(task):
            results.put(("outcome", pid, task.unit, {"unit": task.unit, "status": "cancelled"}))
            continue
        results.put(("start", pid, task.unit, task))
        ticker = _Ticker(lambda n: results.put(("progress", pid, task.unit, n)), lambda: stop(task))  # noqa: B023
        try:
            outcome = convert_unit(task, ticker)
        except _Stop:
            outcome = {"unit": task.unit, "status": "cancelled"}
        except BaseException:  # a bug, not the data: the parent shows it
            results.put(("crash", pid, task.unit, traceback.format_exc()))
            return
        results.put(("outcome", pid, task.unit, outcome))


def _names(task: Task) -> str:
    files: tuple[InputFile, ...] = task.files
    return files[0].name + (f" (and {len(files) - 1} more files)" if len(files) > 1 else "")


@dataclass
class Progress:
    """The conversion's progress bar: bytes of input read, with their rate and an ETA."""

    total: int
    initial: int
    enabled: bool

    def bar(self) -> tqdm:
        from tqdm import tqdm  # here, not at the top: the spawned workers import this module and need no bar

        return tqdm(
            total=self.total,
            initial=self.initial,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            mininterval=1.0,
            disable=None if self.enabled else True,
        )
