"""AdamW (ours vs torch.optim and vs its old per-parameter loop), the lr schedule, stochastic rounding, the grad-norm
spike detector, plots."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
import torch

from trnrecipes.config.sections import OptimConfig
from trnrecipes.optim import adamw
from trnrecipes.optim.adamw import AdamW, no_decay_params
from trnrecipes.optim.rounding import WEIGHTS, round_flat_, stream_constant, stream_key
from trnrecipes.optim.schedule import lr_at
from trnrecipes.parallel.sharding import chunk_range
from trnrecipes.train.monitor import SpikeDetector

CFG = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10, decay_steps=110, weight_decay=0.1, betas=(0.9, 0.95))
# updates of ~1e-2 move bf16 weights of ~1 (ulp 2^-7 or 2^-8) under round to nearest too, so every weight changes
LOUD = OptimConfig(lr=2e-2, min_lr=2e-3, warmup_steps=3, decay_steps=20, weight_decay=0.1, betas=(0.9, 0.95))


class OldLoopAdamW(AdamW):
    """AdamW.step as it was before the multi-tensor rewrite: ~15 small ops per parameter. The reference for it (with
    the moments' updates written as one rounding per op, as adamw_update has them since the step compiles)."""

    @torch.no_grad()
    def step(self) -> None:
        beta1, beta2 = self.betas
        self.step_count += 1
        bias1 = 1 - beta1**self.step_count
        bias2 = 1 - beta2**self.step_count
        step_size = self.lr / bias1
        for i, (p, m, v) in enumerate(zip(self.params, self.exp_avg, self.exp_avg_sq, strict=True)):
            if p.grad is None:
                continue
            param, grad = self._mine(p, i), self._mine(p.grad, i).float()
            m.mul_(beta1).add_(grad * (1 - beta1))
            v.mul_(beta2).add_(grad * grad * (1 - beta2))
            update = (v / bias2).sqrt_().add_(self.eps).reciprocal_().mul_(m).mul_(step_size)
            decay = self.weight_decay and id(p) not in self.no_decay
            if param.dtype == torch.float32:
                if decay:
                    param.mul_(1 - self.lr * self.weight_decay)
                param.sub_(update)
                continue
            master = param.float()
            if decay:
                master.mul_(1 - self.lr * self.weight_decay)
            master.sub_(update)
            param.copy_(master)


SHAPES = [(16, 8), (16,), (4, 16), (4,), (1, 5), (7, 3, 2), (33, 9)]


def make_params(dtypes: list[torch.dtype]) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(d)) for s, d in zip(SHAPES, dtypes, strict=True)]


def clone(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def run(opt: AdamW, steps: range, skip: set[tuple[int, int]] = frozenset()) -> None:
    """Steps with random gradients, the same for every optimizer at the same step; (step, i) in skip: no grad."""
    for step in steps:
        gen = torch.Generator().manual_seed(1000 + step)
        for i, p in enumerate(opt.params):
            grad = torch.randn(p.shape, generator=gen).to(p.dtype)
            p.grad = None if (step, i) in skip else grad
        opt.set_lr(lr_at(step, LOUD))
        opt.step()
        opt.zero_grad()


def assert_bitwise_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x.detach().view(-1).view(torch.uint8), y.detach().view(-1).view(torch.uint8))


def test_adamw_equals_torch_adamw_in_fp32():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    reference = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    reference.load_state_dict(model.state_dict())
    ours = AdamW(list(model.parameters()), CFG, no_decay=no_decay_params(model, decay_norms_and_biases=False))
    exempt = no_decay_params(reference, decay_norms_and_biases=False)
    groups = [
        {"params": [p for p in reference.parameters() if id(p) not in exempt]},
        {"params": [p for p in reference.parameters() if id(p) in exempt], "weight_decay": 0.0},
    ]
    theirs = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    start = [p.detach().clone() for p in model.parameters()]
    for step in range(30):  # warmup, then the cosine decay: a different lr every step
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
    for a, b, s in zip(model.parameters(), reference.parameters(), start, strict=True):
        # torch rounds the moments' updates as lerp/addcmul (FMAs on CPU), ours op by op: a few ulps over 30 steps
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)
        assert not torch.allclose(a, s, rtol=1e-3, atol=0)  # every parameter moved: the comparison means something


@pytest.mark.parametrize("chunk_numel", [None, 40])  # one pass per dtype; passes of a few parameters each (CPU)
def test_adamw_equals_the_old_per_parameter_loop_bitwise(monkeypatch, chunk_numel):
    """fp32 and bf16 (round to nearest) parameters, mixed decay, gradients sometimes missing, a changing lr."""
    if chunk_numel is not None:
        monkeypatch.setattr(adamw, "_CPU_CHUNK_NUMEL", chunk_numel)
    bf16, fp32 = torch.bfloat16, torch.float32
    params = make_params([bf16, bf16, fp32, fp32, bf16, bf16, fp32])
    no_decay = {id(p) for p in params if p.dim() < 2}
    ours = AdamW(params, LOUD, no_decay=no_decay)
    copies = clone(params)
    old = OldLoopAdamW(copies, LOUD, no_decay={id(c) for p, c in zip(params, copies, strict=True) if id(p) in no_decay})
    skip = {(1, 0), (1, 3), (4, 5), (5, 0), (5, 1), (5, 2), (5, 3), (5, 4), (5, 5), (5, 6)}  # step 5: no grads at all
    before = [p.detach().clone() for p in params]
    for opt in (ours, old):
        run(opt, range(12), skip)
    assert_bitwise_equal(ours.params, old.params)
    assert_bitwise_equal(ours.exp_avg + ours.exp_avg_sq, old.exp_avg + old.exp_avg_sq)
    assert ours.steps() == old.steps() == 12
    assert all(not torch.equal(a, b) for a, b in zip(ours.params, before, strict=True))


def test_a_parameter_without_a_gradient_is_left_alone():
    params = make_params([torch.bfloat16, torch.float32, torch.float32, torch.bfloat16, *[torch.float32] * 3])
    opt = AdamW(params, LOUD)
    run(opt, range(3))
    before = [t.clone() for t in [*params, *opt.exp_avg, *opt.exp_avg_sq]]
    run(opt, range(3, 5), skip={(s, i) for s in (3, 4) for i in (0, 2)})
    after = [*params, *opt.exp_avg, *opt.exp_avg_sq]
    n = len(params)
    for i in range(n):
        same = [torch.equal(after[k * n + i], before[k * n + i]) for k in range(3)]  # weight, m, v
        assert all(same) if i in (0, 2) else not any(same), (i, same)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero1_rows_of_two_ranks_updated_apart_equal_one_full_update(dtype):
    start_values = make_params([dtype] * len(SHAPES))  # (1, 5): the second rank owns none of its rows
    copies = [clone(start_values) for _ in range(3)]
    full = AdamW(copies[0], LOUD, no_decay={id(copies[0][1])})
    ranks = [
        AdamW(c, LOUD, no_decay={id(c[1])}, rows=[chunk_range(p.shape[0], 2, rank) for p in c])
        for rank, c in enumerate(copies[1:])
    ]
    for opt in (full, *ranks):
        run(opt, range(8))
    for i, p in enumerate(full.params):
        combined = torch.empty_like(p)
        for opt in ranks:
            start, stop = opt.rows[i]
            mine = opt.params[i].detach()
            combined[start:stop] = mine[start:stop]
            assert_bitwise_equal([mine[:start], mine[stop:]], [start_values[i][:start], start_values[i][stop:]])
            assert_bitwise_equal(
                [opt.exp_avg[i], opt.exp_avg_sq[i]], [full.exp_avg[i][start:stop], full.exp_avg_sq[i][start:stop]]
            )
        assert_bitwise_equal([combined], [p])
        assert not torch.equal(combined, start_values[i])


def test_stochastic_rounding_in_the_step_picks_a_neighbour_of_the_fp32_result():
    """One step on bf16 weights with stochastic rounding vs the same step on fp32 copies (its exact fp32 master):
    each weight is the fp32 result truncated or one bf16 ulp further from zero, and both happen."""
    params = make_params([torch.bfloat16] * len(SHAPES))
    sr = AdamW(params, LOUD, stochastic_rounding=True)
    nearest = AdamW(clone(params), LOUD)
    exact = AdamW([torch.nn.Parameter(p.detach().float()) for p in params], LOUD)
    for opt in (sr, nearest, exact):
        run(opt, range(50, 51))
    got, rtn = (
        torch.cat([p.float().view(-1) for p in sr.params]),
        torch.cat([p.float().view(-1) for p in nearest.params]),
    )
    master = torch.cat([p.detach().view(-1) for p in exact.params])
    bits = master.view(torch.int32) & -65536
    toward_zero, away = bits.view(torch.float32), (bits + 65536).view(torch.float32)
    assert torch.all((got == toward_zero) | (got == away))
    assert (got == toward_zero).sum() > 100 and (got == away).sum() > 100
    assert torch.equal(rtn, master.to(torch.bfloat16).float()) and not torch.equal(got, rtn)


def test_stochastic_rounding_is_reproducible_and_resumes_from_the_checkpointed_state_alone():
    """The noise is a hash of (seed, step, element): a new optimizer loaded from a state dict (weights, moments, step
    count: no generator state) rounds on exactly as the uninterrupted one; bf16 moments are rounded so too."""

    def make(seed: int, params=None, state_dtype: str = "fp32") -> AdamW:
        params = params or make_params([torch.bfloat16, torch.float32] * 3 + [torch.bfloat16])
        cfg = dataclasses.replace(LOUD, state_dtype=state_dtype)
        return AdamW(params, cfg, no_decay={id(params[1])}, stochastic_rounding=True, seed=seed)

    for state_dtype in ("fp32", "bf16"):
        a, b, other = make(0, state_dtype=state_dtype), make(0, state_dtype=state_dtype), make(1)
        for opt in (a, b, other):
            run(opt, range(10))
        assert_bitwise_equal(a.params, b.params)
        assert any(not torch.equal(x, y) for x, y in zip(a.params, other.params, strict=True))  # the seed matters
        first = make(0, state_dtype=state_dtype)
        run(first, range(4))
        saved = {k: [t.clone() for t in v] if isinstance(v, list) else v.clone() for k, v in first.state_dict().items()}
        resumed = make(0, params=clone(first.params), state_dtype=state_dtype)
        torch.manual_seed(99)  # the global RNG plays no part
        resumed.load_state_dict(saved)
        run(resumed, range(4, 10))
        assert_bitwise_equal(resumed.params, a.params)
        assert_bitwise_equal(resumed.exp_avg + resumed.exp_avg_sq, a.exp_avg + a.exp_avg_sq)


def test_stochastic_rounding_noise_does_not_depend_on_how_a_group_is_cut_into_passes(monkeypatch):
    """Eager steps cut a group into chunks (passes); the noise follows each element's place in its group, so one pass
    or many give the same bits."""
    results = []
    for chunk_numel in (1 << 16, 40):
        monkeypatch.setattr(adamw, "_CPU_CHUNK_NUMEL", chunk_numel)
        opt = AdamW(make_params([torch.bfloat16] * len(SHAPES)), LOUD, stochastic_rounding=True, seed=5)
        run(opt, range(3))
        results.append(opt.params)
    assert_bitwise_equal(*results)


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
    # values between bf16 neighbours, where round-to-nearest always goes the same way
    x = torch.tensor([1.0 + 2**-9, 0.3 + 1e-4, -2.7183, 1e-3 + 1e-7], dtype=torch.float32)
    n = 200_000
    key = stream_key(torch.tensor(7), stream_constant(3, 0, WEIGHTS))  # seed 3, step 7
    samples = round_flat_(x.repeat(n, 1).flatten(), 0, key).view(n, -1).to(torch.bfloat16).float()
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


def test_each_tp_rank_rounds_the_parameters_it_holds_whole_alike_so_their_copies_stay_equal():
    """Stochastic rounding under TP: a parameter every TP rank holds whole (a norm, a mixture of experts' router and
    experts) gets the same update on each; with noise seeded per TP rank its copies would round apart, each step, for
    good. Two TP ranks' optimizers built as the trainer builds them (plain tensors: replicated) keep them equal."""
    import types

    from trnrecipes.backends.torch import TorchBackend
    from trnrecipes.config.recipe import load_recipe
    from trnrecipes.models import build_model

    recipe = load_recipe("llama2-tiny", overrides="precision.dtype=bf16 precision.stochastic_rounding=true")
    backend = TorchBackend.create("cpu", 0)
    weights = []
    for tp_rank in (0, 1):
        model = build_model(recipe.model).to(torch.bfloat16)
        model.init_weights(seed=0)
        dims = types.SimpleNamespace(tp=2, tp_rank=tp_rank, pp_rank=0, dp_rank=0, zero1=False, shards_moments=False)
        optimizer = backend.make_optimizer(model, recipe, dims)
        optimizer.set_lr(1e-3)
        for step in range(3):
            gen = torch.Generator().manual_seed(step)
            for p in optimizer.params:
                p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
            optimizer.step()
        weights.append([p.detach().clone() for p in optimizer.params])
    assert all(torch.equal(a, b) for a, b in zip(*weights, strict=True))
    # the sharded ones keep noise of their own per TP rank: the same seed for both only where replicated
    assert optimizer.tp_replicated_seed != optimizer.seed
