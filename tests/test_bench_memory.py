"""bench/bench_memory.py end to end at llama2-tiny's shape: three layouts trained one after the other under torchrun,
a row each with the peak RSS of the largest rank, and the two ratio lines. Only the shape of the report is checked,
never the ratios: they depend on the model size (the tiny model is all torch overhead) and on the machine. The
numbers themselves come from `make bench` (the >= 300M-parameter model)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from conftest import REPO

BENCH = REPO / "bench" / "bench_memory.py"
ROW = re.compile(
    r"^(?P<config>TP1 DP1|TP2|DP2 ZeRO-1)\s+(?P<ranks>\d)\s+(?P<peak>\d+) MiB\s+(?P<built>\d+) MiB"
    r"\s+(?P<local>[\d.]+)M\s+(?P<theory>\d+) MiB\s+(?P<ratio>[\d.]+)$",
    re.M,
)
RATIO = re.compile(r"^(?P<what>TP=2 / TP=1|DP=2 ZeRO-1 / TP=1 DP=1): (?P<ratio>[\d.]+) \(.*goal: well under 1", re.M)


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(BENCH), *args], cwd=REPO, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_bench_memory_reports_three_layouts_and_two_ratios():
    done = bench("--shape", "tiny", "--steps", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {m["config"]: m for m in ROW.finditer(done.stdout)}
    assert list(rows) == ["TP1 DP1", "TP2", "DP2 ZeRO-1"], done.stdout
    assert [int(r["ranks"]) for r in rows.values()] == [1, 2, 2]
    for row in rows.values():
        assert int(row["peak"]) >= int(row["built"]) > 0  # the peak so far, read after the build and at the end
        assert float(row["local"]) > 0 and int(row["theory"]) >= 0 and float(row["ratio"]) > 0
    assert float(rows["TP1 DP1"]["ratio"]) == 1.0
    ratios = {m["what"]: float(m["ratio"]) for m in RATIO.finditer(done.stdout)}
    assert list(ratios) == ["TP=2 / TP=1", "DP=2 ZeRO-1 / TP=1 DP=1"], done.stdout
    assert all(r > 0 for r in ratios.values())
    assert re.search(r"^model: [\d.]+M parameters", done.stdout, re.M), done.stdout


def test_bench_memory_rejects_bad_arguments():
    done = bench("--steps", "0")
    assert done.returncode == 2
    assert "--steps must be >= 1, not 0" in done.stderr
    done = bench("--shape", "7b")
    assert done.returncode == 2
    assert "invalid choice: '7b'" in done.stderr
    done = bench("model.hidden_size=8")
    assert done.returncode == 2
    assert "unexpected arguments: model.hidden_size=8" in done.stderr


LOSS_ROW = re.compile(
    r"^(?P<mode>gathered|vocab-parallel)\s+(?P<before>\d+) MiB\s+(?P<peak>\d+) MiB\s+(?P<growth>-?\d+) MiB"
    r"\s+(?P<loss>[\d.]+)\s+(?P<seconds>[\d.]+)$",
    re.M,
)


@pytest.mark.slow
def test_bench_memory_loss_phase_reports_both_paths_and_the_ratio():
    """--loss at 512 tokens (the numbers: 8192, docs/benchmarks.md): a row for each path, the same loss from both,
    and the ratio line. Even here the vocab-parallel peak is the lower: the gathered path holds the whole
    vocabulary's logits, three times over."""
    done = bench("--loss", "--seq", "512")
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {m["mode"]: m for m in LOSS_ROW.finditer(done.stdout)}
    assert list(rows) == ["gathered", "vocab-parallel"], done.stdout
    assert rows["gathered"]["loss"] == rows["vocab-parallel"]["loss"]
    assert int(rows["vocab-parallel"]["peak"]) < int(rows["gathered"]["peak"])
    ratio = re.search(r"^vocab-parallel / gathered: peak (?P<peak>[\d.]+), growth [\d.]+ .*goal", done.stdout, re.M)
    assert ratio and 0 < float(ratio["peak"]) < 1, done.stdout
