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

from trnrecipes.config.sections import ModelConfig
from trnrecipes.models import build_model

BENCH = REPO / "bench" / "bench_model.py"
ROW = re.compile(
    r"^(?P<config>[\w.-]+)\s+loss (?P<ours>[\d.]+) = HF (?P<hf>[\d.]+)\s+ours\s+\d+ tok/s\s+HF\s+\d+ tok/s"
    r"\s+ratio (?P<ratio>[\d.]+)x \(pairs (?P<lo>[\d.]+)-(?P<hi>[\d.]+), goal >= 1.25x\)"
    r"\s+\| peak RSS ours (?P<rss_ours>\d+) MiB, HF (?P<rss_hf>\d+) MiB\n"
    r"\s+kernel floor (?P<floor>[\d.]+) s per step \(GEMMs (?P<gemm>[\d.]+) s, attention (?P<attn>[\d.]+) s\)"
    r" = (?P<floor_tok>\d+) tok/s at most; HF/floor (?P<bound>[\d.]+)x \(pairs (?P<blo>[\d.]+)-(?P<bhi>[\d.]+)\),"
    r" the ratio if a step did nothing else$",
    re.M,
)


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_model", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
        # The floor is printed to 0.1 ms; its throughput is tokens over it. The bound is a median of pairs.
        floor_s = float(row["floor"])
        assert 32 / (floor_s + 1e-4) - 1 <= int(row["floor_tok"]) <= 32 / max(floor_s - 1e-4, 1e-9) + 1
        assert float(row["blo"]) <= float(row["bound"]) <= float(row["bhi"])


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
    bench_model = load_bench()
    model = build_model(bench_model.model_config(config, 32), device="meta")
    assert bench_model.linear_shapes(model) == linears


def test_a_floor_sample_times_each_gemm_and_attention_at_the_step_shapes(monkeypatch):
    """Each distinct linear's three GEMMs once, weighted by how many there are; attention once per layer, with
    Llama's grouped-query k/v at their own head count. Every timing is replaced by 1 s, so the sums are counts."""
    import torch

    bench_model = load_bench()
    monkeypatch.setattr(bench_model, "timed_s", lambda fn: (fn(), 1.0)[1])
    gemms, attentions = [], []
    mm, sdpa = torch.mm, torch.nn.functional.scaled_dot_product_attention

    def mm_spy(a, b, out=None):
        gemms.append((tuple(a.shape), tuple(b.shape)))
        return mm(a, b, out=out)

    def sdpa_spy(q, k, v, **kwargs):
        attentions.append((tuple(q.shape), tuple(k.shape), tuple(v.shape), kwargs))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(torch, "mm", mm_spy)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa_spy)
    sizes = dict(vocab_size=80, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, ffn_hidden_size=24)
    model = build_model(ModelConfig(family="llama2", max_seq_len=8, **sizes), device="meta")
    floor = bench_model.floor_sampler(model, batch=2, seq=8)()
    assert floor == {"gemm_s": 3 * 4 + 1, "attention_s": 3}  # 4 linears per layer and the head; 3 layers
    # qkv: 32 -> (4 + 2 * 2) heads x 8; out 32 -> 32; gate_up 32 -> 2 x 24; down 24 -> 32; head 32 -> 80.
    for n_in, n_out in [(32, 64), (32, 32), (32, 48), (24, 32), (32, 80)]:
        assert ((16, n_in), (n_in, n_out)) in gemms  # y = x W^T
        assert ((16, n_out), (n_out, n_in)) in gemms  # dx = dy W
        assert ((n_out, 16), (16, n_in)) in gemms  # dW = dy^T x
    assert len(gemms) == 3 * 5
    assert attentions == [((2, 4, 8, 8), (2, 2, 8, 8), (2, 2, 8, 8), {"is_causal": True, "enable_gqa": True})]


def test_bench_model_rejects_bad_arguments():
    done = bench("--steps", "0")
    assert done.returncode == 2
    assert "--steps must be >= 1, not 0" in done.stderr
    done = bench("--config", "gpt2")
    assert done.returncode == 2
    assert "invalid choice: 'gpt2'" in done.stderr
