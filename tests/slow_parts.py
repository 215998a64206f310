"""`python tests/slow_parts.py data to-arrow ...`: trnrecipes with each input file a unit of its own (as shards of
128 MB are) and a pause after each part a worker writes, so that a SIGKILL aimed between two parts lands there for
certain (SLOW_PARTS_BUSY=1: the worker sends progress all through it). Only the cut and the pause are changed: the
real workers, parts, records and join all run. The spawned workers run this file's top level too (as __mp_main__),
so they pause as well.

The first process converts units too (parallel.py): it pauses as the spawned workers do, and what it checks as
it converts (the workers' messages, whether one died) is checked all through its pauses, as through a long unit.

SLOW_PARTS_HOLD=DIR: a spawned worker's first part is held, not paused: the worker writes DIR/<its pid> and waits
for DIR/go (at most 120 s). A test then acts on a worker it knows to be amid a unit (its outcome not yet sent),
whatever the machine's load; a pause of a fixed time could end, on a loaded CI machine, before the test saw the
part. The first process never holds (a test kills a holder): after its first part it waits until SLOW_PARTS_HOLDERS
(default 2) workers hold theirs, or DIR/go, so that it takes no unit they were to take."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time

from trnrecipes.data import parallel, parts

PAUSE_S = float(os.environ.get("SLOW_PARTS_PAUSE_S", "0.3"))
parts.UNIT_BYTES = 1
_convert_unit = parts.convert_unit


BUSY = os.environ.get("SLOW_PARTS_BUSY") == "1"  # send progress all through the pause, as a long unit does


HOLD = os.environ.get("SLOW_PARTS_HOLD")
HOLDERS = int(os.environ.get("SLOW_PARTS_HOLDERS", "2"))
_held = False


def _slow_convert_unit(task, tick):
    global _held
    outcome = _convert_unit(task, tick)
    if HOLD and not _held:
        _held = True
        spawned = multiprocessing.parent_process() is not None
        if spawned:
            with open(os.path.join(HOLD, str(os.getpid())), "w"):
                pass
        go, end = os.path.join(HOLD, "go"), time.monotonic() + 120
        while not os.path.exists(go) and time.monotonic() < end:
            if not spawned and sum(name.isdigit() for name in os.listdir(HOLD)) >= HOLDERS:
                break
            _tick(tick, 0.02)
        return outcome
    end = time.monotonic() + PAUSE_S
    while time.monotonic() < end:
        _tick(tick, min(0.02, max(0.0, end - time.monotonic())))
    return outcome


def _tick(tick, wait_s: float) -> None:
    if BUSY:
        tick.send(1)
    if tick.stop():
        raise parallel._Stop
    time.sleep(wait_s)


parallel.convert_unit = _slow_convert_unit

if __name__ == "__main__":
    # Ctrl-C as a terminal's command gets it, whatever this process inherited: in a make test run on two workers, it
    # once inherited an ignored SIGINT (from what, not found: neither xdist nor execnet ignores it) and ran on through
    # the test's Ctrl-C. The parent only: its workers ignore SIGINT from their start.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from trnrecipes.cli import main

    sys.exit(main(sys.argv[1:]))
