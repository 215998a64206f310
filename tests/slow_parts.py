"""`python tests/slow_parts.py data to-arrow ...`: trnrecipes with each input file a unit of its own (as shards of
128 MB are) and a pause at the end of each unit, once its documents are read and before its part is written, so that
a SIGKILL aimed at a unit lands amid it for certain (SLOW_PARTS_BUSY=1: the process sends progress all through it).
Only the cut and the pause are changed: the real workers, parts, records and join all run. The spawned workers run
this file's top level too (as __mp_main__), so they pause as well.

The first process converts units too (parallel.py): it pauses as the spawned workers do, and what it checks as it
converts (the workers' messages, whether one died) is checked all through its pauses, from within the unit, as
through a long unit.

SLOW_PARTS_HOLD_END=DIR: the first process, once the output is in place, waits (at most 120 s) as it begins clearing up
(it writes DIR/clearing, then waits for DIR/cleared): removing the old shard directory --shard-bytes replaced, or else
its work dir; and again as the interpreter exits (DIR/exiting, then DIR/exit): a test signals it at those moments.

SLOW_PARTS_HOLD=DIR: a spawned worker's first unit is held, not paused: the worker writes DIR/<its pid> and waits for
DIR/go (at most 120 s). A test then acts on a worker it knows to be amid a unit (its outcome not yet sent), whatever
the machine's load; a pause of a fixed time could end, on a loaded CI machine, before the test saw the part. The
first process writes no pid file (a test kills a holder): it converts its first unit without a pause and then waits
until SLOW_PARTS_HOLDERS (default 2) workers hold theirs, or DIR/go, so that it takes no unit they were to take; with
SLOW_PARTS_HOLD_FIRST=1 it holds its first unit (amid it) until DIR/go instead."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time

from trnrecipes.data import parallel, parts

PAUSE_S = float(os.environ.get("SLOW_PARTS_PAUSE_S", "0.3"))
BUSY = os.environ.get("SLOW_PARTS_BUSY") == "1"  # send progress all through the pause, as a long unit does
HOLD = os.environ.get("SLOW_PARTS_HOLD")
HOLDERS = int(os.environ.get("SLOW_PARTS_HOLDERS", "2"))
HOLD_FIRST = os.environ.get("SLOW_PARTS_HOLD_FIRST") == "1"
parts.UNIT_BYTES = 1
_convert_unit = parts.convert_unit
_first = True


def _slow_convert_unit(task, tick):
    global _first
    first, _first = _first, False
    spawned = multiprocessing.parent_process() is not None
    waits = bool(HOLD) and first and not spawned and not HOLD_FIRST  # after its unit, for the workers to hold theirs
    mode = "hold" if HOLD and first and (spawned or HOLD_FIRST) else "none" if waits else "pause"
    outcome = _convert_unit(task, _Slowed(tick, mode))
    if waits:
        while not _go() and sum(name.isdigit() for name in os.listdir(HOLD)) < HOLDERS:
            _tick(tick, 0.02)
    return outcome


class _Slowed:
    """A unit's ticker, pausing or holding (`mode`) at the unit's last call: its documents are read, its part not
    written."""

    def __init__(self, tick, mode: str):
        self.tick, self.mode = tick, mode

    def __call__(self, read: int, final: bool = False) -> None:
        self.tick(read, final)
        if not final or self.mode == "none":
            return
        if self.mode == "hold":
            if multiprocessing.parent_process() is not None:
                with open(os.path.join(HOLD, str(os.getpid())), "w"):
                    pass
            end = time.monotonic() + 120
            while not _go() and time.monotonic() < end:
                _tick(self.tick, 0.02)
            return
        end = time.monotonic() + PAUSE_S
        while time.monotonic() < end:
            _tick(self.tick, min(0.02, max(0.0, end - time.monotonic())))


def _go() -> bool:
    return os.path.exists(os.path.join(HOLD, "go"))


def _tick(tick, wait_s: float) -> None:
    """What a long unit's ticker does between two blocks: progress sent (BUSY), and the stop asked about (the first
    process: the workers' messages read and the workers judged)."""
    if BUSY:
        tick.send(1)
    if tick.stop():
        raise parallel._Stop
    time.sleep(wait_s)


parallel.convert_unit = _slow_convert_unit


def _wait_at(mark: str, go: str) -> None:
    with open(os.path.join(HOLD_END, mark), "w"):
        pass
    end = time.monotonic() + 120
    while not os.path.exists(os.path.join(HOLD_END, go)) and time.monotonic() < end:
        time.sleep(0.01)


HOLD_END = os.environ.get("SLOW_PARTS_HOLD_END")
if HOLD_END and multiprocessing.parent_process() is None:
    import atexit
    import shutil
    import types

    from trnrecipes.data import conversion, corpus_writer

    _remove_work_dir, _rmtree = conversion.remove_work_dir, shutil.rmtree

    def _clearing() -> None:
        if not os.path.exists(os.path.join(HOLD_END, "clearing")):  # the first step only
            _wait_at("clearing", "cleared")

    def _held_remove_work_dir(work, log) -> None:
        _clearing()
        _remove_work_dir(work, log)

    def _held_rmtree(path, *args, **kwargs) -> None:
        if corpus_writer.is_shard_dir(path) and os.path.basename(path).startswith("."):  # the old output moved aside
            _clearing()
        _rmtree(path, *args, **kwargs)

    conversion.remove_work_dir = _held_remove_work_dir
    corpus_writer.shutil = types.SimpleNamespace(rmtree=_held_rmtree)
    atexit.register(_wait_at, "exiting", "exit")

if __name__ == "__main__":
    # Ctrl-C as a terminal's command gets it, whatever this process inherited: a make test started in the background
    # of a non-interactive shell (`bash .ci/run &`) runs with SIGINT ignored, as POSIX shells start asynchronous
    # commands, and every process below it inherits that; this one then ran on through the test's Ctrl-C. The parent
    # only: its workers ignore SIGINT from their start.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from trnrecipes.cli import main

    sys.exit(main())  # argv None: the process's own command line, as the console script runs it
