"""`python tests/slow_parts.py data to-arrow ...`: trnrecipes with each input file a unit of its own (as shards of
128 MB are) and a pause after each part a worker writes, so that a SIGKILL aimed between two parts lands there for
certain (SLOW_PARTS_BUSY=1: the worker sends progress all through it). Only the cut and the pause are changed: the
real workers, parts, records and join all run. The spawned workers run this file's top level too (as __mp_main__),
so they pause as well."""

from __future__ import annotations

import os
import sys
import time

from trnrecipes.data import parallel, parts

PAUSE_S = float(os.environ.get("SLOW_PARTS_PAUSE_S", "0.3"))
parts.UNIT_BYTES = 1
_convert_unit = parts.convert_unit


BUSY = os.environ.get("SLOW_PARTS_BUSY") == "1"  # send progress all through the pause, as a long unit does


def _slow_convert_unit(task, tick):
    outcome = _convert_unit(task, tick)
    end = time.monotonic() + PAUSE_S
    while BUSY and time.monotonic() < end:
        tick.send(1)
        time.sleep(0.02)
    time.sleep(max(0.0, end - time.monotonic()))
    return outcome


parallel.convert_unit = _slow_convert_unit

if __name__ == "__main__":
    from trnrecipes.cli import main

    sys.exit(main(sys.argv[1:]))
