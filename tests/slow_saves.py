"""`python tests/slow_saves.py train ...`: trnrecipes with a pause after each checkpoint file a rank writes.

A tiny model's save takes about a millisecond, so a SIGKILL aimed at one misses on a fast idle machine (CI: 0 hits in
20). With the pause its .step_N.tmp stays for a while with some files written and no marker yet, and a kill lands
inside it for certain. Only the pause is added: the real writer, marker, rename and pruning all run."""

from __future__ import annotations

import os
import runpy
import time

from trnrecipes.checkpoint import writer

PAUSE_S = float(os.environ.get("SLOW_SAVES_PAUSE_S", "0.1"))
_hash_and_sync = writer.hash_and_sync


def _slow_hash_and_sync(path):
    digest = _hash_and_sync(path)
    time.sleep(PAUSE_S)
    return digest


writer.hash_and_sync = _slow_hash_and_sync
runpy.run_module("trnrecipes", run_name="__main__", alter_sys=True)
