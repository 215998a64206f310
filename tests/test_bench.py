"""bench/bench_model.py end to end at a toy shape: both processes build the same model, agree on the loss, step in
lockstep and report a ratio and peak RSS per family. Only the shape of the report is checked, never a timing: timed
assertions are flaky on a shared machine. The numbers themselves come from `make bench`."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from conftest import REPO

BENCH = REPO / "bench" / "bench_model.py"
ROW = re.compile(
    r"^(?P<family>\w+)\s+loss (?P<ours>[\d.]+) = HF (?P<hf>[\d.]+)\s+ours\s+\d+ tok/s\s+HF\s+\d+ tok/s"
    r"\s+ratio (?P<ratio>[\d.]+)x \(pairs (?P<lo>[\d.]+)-(?P<hi>[\d.]+), goal >= 1.25x\)"
    r"\s+\| peak RSS ours (?P<rss_ours>\d+) MiB, HF (?P<rss_hf>\d+) MiB$",
    re.M,
)


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(BENCH), *args], cwd=REPO, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_bench_model_reports_both_families():
    done = bench("--steps", "3", "--seq", "32", "--batch", "1")
    assert done.returncode == 0, done.stderr
    rows = {m["family"]: m for m in ROW.finditer(done.stdout)}
    assert sorted(rows) == ["llama2", "neox"], done.stdout
    for row in rows.values():
        # Each side's loss comes from its own process: equal losses mean both built the same model and batch.
        assert float(row["ours"]) == pytest.approx(float(row["hf"]), rel=1e-4)
        assert float(row["lo"]) <= float(row["ratio"]) <= float(row["hi"])
        # Peak RSS is counted from the end of setup, yet must still hold the weights: the smaller of the two
        # configs (llama2, 51.7M parameters) has 197 MiB of them in fp32.
        assert int(row["rss_ours"]) > 197 and int(row["rss_hf"]) > 197


def test_bench_model_rejects_bad_arguments():
    done = bench("--steps", "0")
    assert done.returncode == 2
    assert "--steps must be >= 1, not 0" in done.stderr
    done = bench("--family", "gpt2")
    assert done.returncode == 2
    assert "invalid choice: 'gpt2'" in done.stderr
