"""`trnrecipes health --collectives` over 2 real gloo processes: checked, timed, and a lying rank is caught."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def health(tmp_path, **env: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--rdzv-backend=c10d",
           "--rdzv-endpoint=127.0.0.1:0", "-m", "trnrecipes", "health", "--config", "llama2-tiny",
           "--collectives"]  # fmt: skip
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**os.environ, **env})


def test_collectives_are_checked_and_timed(tmp_path):
    done = health(tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    for op in ("all_gather", "all_reduce", "reduce_scatter"):
        for mb in (1, 16):
            assert re.search(
                rf"\[health\] {op} +{mb} MiB x 2 ranks: +[0-9.]+ ms  algbw +[0-9.]+ GB/s  busbw", done.stdout
            )
    assert "collectives over 2 ranks: ok" in done.stdout


def test_a_rank_returning_wrong_data_fails_the_check(tmp_path):
    done = health(tmp_path, TRNRECIPES_HEALTH_FAULT_RANK="1")
    assert done.returncode != 0
    assert re.search(r"FAILED all_gather: data from rank 1 \(\S+\) is wrong", done.stderr)
    assert "collectives over 2 ranks: FAILED" in done.stdout
