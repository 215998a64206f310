"""bench/bench_model.py end to end at a toy shape: both processes build the same model, agree on the loss, step in
lockstep and report a ratio and peak RSS per family. Only the shape of the report is checked, never a timing: timed
assertions are flaky on a shared machine. The numbers themselves come from `make bench`."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import pytest
from conftest import REPO

BENCH = REPO / "bench" / "bench_model.py"
ROW = re.compile(
    r"^(?P<config>[\w.-]+)\s+loss (?P<ours>[\d.]+) = HF (?P<hf>[\d.]+)\s+ours\s+\d+ tok/s\s+HF\s+\d+ tok/s"
    r"\s+ratio (?P<ratio>[\d.]+)x \(pairs (?P<lo>[\d.]+)-(?P<hi>[\d.]+), goal >= 1.25x\)"
    r"\s+\| peak RSS ours (?P<rss_ours>\d+) MiB, HF (?P<rss_hf>\d+) MiB\n"
    r"\s+kernel floor: GEMMs (?P<gemm>[\d.]+) s \+ attention (?P<attn>[\d.]+) s per step = (?P<floor_tok>\d+) tok/s"
    r" at most, a ratio of (?P<bound>[\d.]+)x if a step did nothing else$",
    re.M,
)


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(BENCH), *args], cwd=REPO, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_bench_model_reports_a_config_of_each_family():
    done = bench("--steps", "3", "--seq", "32", "--batch", "1", "--config", "pythia-14m", "--config", "llama2-6x128")
    assert done.returncode == 0, done.stderr
    rows = {m["config"]: m for m in ROW.finditer(done.stdout)}
    assert sorted(rows) == ["llama2-6x128", "pythia-14m"], done.stdout
    for row in rows.values():
        # Each side's loss comes from its own process: equal losses mean both built the same model and batch.
        assert float(row["ours"]) == pytest.approx(float(row["hf"]), rel=1e-4)
        assert float(row["lo"]) <= float(row["ratio"]) <= float(row["hi"])
        # Peak RSS is counted from the end of setup, yet must still hold the weights: llama2-6x128 has 9.4M
        # parameters, 36 MiB in fp32 (and the process its Python, torch and transformers).
        assert int(row["rss_ours"]) > 36 and int(row["rss_hf"]) > 36
        floor_s = float(row["gemm"]) + float(row["attn"])
        assert float(row["gemm"]) > 0 and float(row["attn"]) > 0
        # The two times are printed to the millisecond, so their sum is known to within 1 ms.
        assert 32 / (floor_s + 0.001) - 1 <= int(row["floor_tok"]) <= 32 / max(floor_s - 0.001, 1e-9) + 1


@pytest.mark.parametrize(
    "config, linears",
    [
        ("pythia-14m", {(128, 384): 6, (128, 128): 6, (128, 512): 6, (512, 128): 6, (128, 50304): 1}),
        # Llama's fused qkv and fused gate_up (2 x 1376) projections, its down projection and the head.
        ("llama2-6x512", {(512, 1536): 6, (512, 512): 6, (512, 2752): 6, (1376, 512): 6, (512, 32000): 1}),
    ],
)
def test_kernel_floor_covers_every_linear_of_the_step(config, linears):
    """The floor times three GEMMs per linear at these shapes: every projection of every layer and the LM head."""
    from trnrecipes.models import build_model
    from trnrecipes.recipe import ModelConfig

    spec = importlib.util.spec_from_file_location("bench_model", BENCH)
    bench_model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_model)
    family, sizes = bench_model.CONFIGS[config]
    model = build_model(ModelConfig(family=family, max_seq_len=32, **sizes), device="meta")
    assert bench_model.linear_shapes(model) == linears


def test_bench_model_rejects_bad_arguments():
    done = bench("--steps", "0")
    assert done.returncode == 2
    assert "--steps must be >= 1, not 0" in done.stderr
    done = bench("--config", "gpt2")
    assert done.returncode == 2
    assert "invalid choice: 'gpt2'" in done.stderr
