"""AdamW (ours vs torch.optim), the lr schedule, stochastic rounding, the grad-norm spike detector, plots."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from trnrecipes.recipe import OptimConfig
from trnrecipes.train.monitor import SpikeDetector
from trnrecipes.train.optim import AdamW, lr_at, no_decay_params, stochastic_round_bf16

CFG = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10, decay_steps=110, weight_decay=0.1, betas=(0.9, 0.95))


def test_adamw_equals_torch_adamw_in_fp32():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    reference = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    reference.load_state_dict(model.state_dict())
    ours = AdamW(list(model.parameters()), CFG)
    theirs = torch.optim.AdamW(reference.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for step in range(20):
        x = torch.randn(32, 8)
        for m in (model, reference):
            m(x).pow(2).mean().backward()
        lr = lr_at(step, CFG)
        ours.set_lr(lr)
        for group in theirs.param_groups:
            group["lr"] = lr
        ours.step()
        theirs.step()
        ours.zero_grad()
        theirs.zero_grad()
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_no_decay_option_exempts_norms_and_biases():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    assert no_decay_params(model, decay_norms_and_biases=True) == set()
    exempt = no_decay_params(model, decay_norms_and_biases=False)
    assert exempt == {id(model[0].bias), id(model[1].weight), id(model[1].bias)}


def test_schedule_warmup_then_cosine_to_min_lr():
    assert lr_at(0, CFG) == pytest.approx(1e-4)
    assert lr_at(9, CFG) == pytest.approx(1e-3)
    assert lr_at(60, CFG) == pytest.approx((1e-3 + 1e-4) / 2)  # half way through the decay
    assert lr_at(110, CFG) == pytest.approx(1e-4) and lr_at(500, CFG) == pytest.approx(1e-4)
    lin = OptimConfig(lr=1e-3, min_lr=0.0, warmup_steps=0, decay_steps=100, schedule="linear")
    assert lr_at(25, lin) == pytest.approx(7.5e-4)
    const = OptimConfig(lr=1e-3, min_lr=0.0, warmup_steps=5, decay_steps=100, schedule="constant")
    assert lr_at(80, const) == 1e-3
    values = [lr_at(s, CFG) for s in range(10, 111)]
    assert all(a >= b for a, b in itertools.pairwise(values))


def test_stochastic_rounding_is_unbiased_and_nearest_is_not():
    gen = torch.Generator().manual_seed(0)
    # values between bf16 neighbours, where round-to-nearest always goes the same way
    x = torch.tensor([1.0 + 2**-9, 0.3 + 1e-4, -2.7183, 1e-3 + 1e-7], dtype=torch.float32)
    n = 200_000
    samples = stochastic_round_bf16(x.repeat(n, 1), gen).float()
    mean = samples.mean(0)
    assert torch.all(((mean - x) / x).abs() < 3e-5), (mean - x) / x
    nearest = x.to(torch.bfloat16).float()
    assert torch.all(((nearest - x) / x).abs() > 1e-4)  # biased by up to half an ulp (2^-9 relative)
    # every SR result is one of x's two bf16 neighbours: the fp32 bits truncated (toward zero) or one bf16 ulp out
    bits = x.view(torch.int32) & -65536
    toward_zero, away = bits.view(torch.float32), (bits + 65536).view(torch.float32)
    assert torch.all((samples == toward_zero) | (samples == away))
    assert torch.all((samples == toward_zero).any(0) & (samples == away).any(0))


def test_spike_detector_counts_and_recovery_lengths():
    series = [1.0] * 20 + [1.5] + [1.0] * 5 + [2.0, 1.8, 1.6] + [1.0] * 30 + [1.05]
    det = SpikeDetector(window=20, margin=0.1)
    starts = [i for i, g in enumerate(series) if det.update(g)]
    assert starts == [20, 26]
    assert det.summary() == {"spikes": 2, "recovery_histogram": {1: 1, 3: 1}}
    assert not det.in_spike  # 1.05 after 30 calm steps is not a spike (mean 1.0 + 0.1)


def test_spike_detector_needs_a_full_window():
    det = SpikeDetector(window=20)
    assert not any(det.update(g) for g in [1.0] * 5 + [10.0])


def test_plot_overlays_two_runs(tmp_path, cli):
    for name, scale in (("gpu", 1.0), ("trn", 1.01)):
        run = tmp_path / name
        run.mkdir()
        lines = [
            json.dumps({"step": s, "loss": scale * (10 - s / 10), "grad_norm": 1.0, "param_norm": 50.0 + s})
            for s in range(1, 31)
        ]
        (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    done = cli("plot", str(tmp_path / "gpu"), str(tmp_path / "trn"), "--out", str(tmp_path / "plots"))
    assert done.returncode == 0, done.stderr
    for key in ("loss", "grad_norm", "param_norm"):
        png = tmp_path / "plots" / f"{key}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    done = cli("plot", str(tmp_path / "missing"))
    assert done.returncode == 2 and "no metrics.jsonl" in done.stderr
