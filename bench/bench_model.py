"""Benchmark: a training step (forward + loss + backward) of our model vs transformers' on the same config, CPU.

Each side runs as a user would train it, in a process of its own (so its peak RSS is its own):
  ours: loss = model(tokens, labels=labels), labels = tokens shifted left with the last position -100 (ignored);
        the loss comes from the fused chunked head + cross-entropy (recipes/common/loss.py), no full logits.
  HF:   loss = model(input_ids=tokens, labels=tokens).loss, which shifts internally the same way.
Both use SDPA attention, fp32, the same weights and batch, and average over the same b * (s - 1) targets; their
first losses must agree (rel 1e-4) before anything is timed, so both provably compute the same function.

The two processes run in lockstep: one step of ours, one of HF's (alternating which goes first), never at the same
time. A step pair shares whatever the machine was doing then, so the ratio is the median of the per-pair ratios;
timing each side in its own stretch let a slow minute on a shared VM swing the ratio by 0.15. Both processes do
the same setup (build our model, build HF's from its weights, keep one) so glibc's allocator, whose mmap threshold
adapts to what was freed before, starts from the same history on both sides. Peak RSS is counted from the end of
setup: weights, gradients and activations of the timed steps. Prints ours/HF throughput ratios (goal >= 1.25x).

A third process samples the kernel floor in the same lockstep, once per step pair: the step's GEMMs (for every
linear: y = x W^T, dx = dy W, dW = dy^T x, into preallocated outputs) and its attention (SDPA forward + backward per
layer), timed alone at the step's shapes. A step of this function built from these kernels would in practice take
no less, so HF's step over its neighbouring floor sample (the median over pairs) estimates the best ratio any
fusion of the rest (norms, activations, rotary, softmax, copies) could reach. An estimate, not a proof: other GEMM
splits are possible, and it moves by a few hundredths between runs.

    .venv/bin/python bench/bench_model.py [--config pythia-70m ...] [--steps 8] [--seq 512] [--batch 4]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time


def pythia(hidden: int, heads: int) -> tuple[str, dict]:
    return "neox", dict(
        vocab_size=50304, hidden_size=hidden, num_layers=6, num_heads=heads, ffn_hidden_size=4 * hidden, rotary_pct=0.25
    )


def llama2(hidden: int, heads: int, ffn: int) -> tuple[str, dict]:
    return "llama2", dict(
        vocab_size=32000, hidden_size=hidden, num_layers=6, num_heads=heads, num_kv_heads=heads, ffn_hidden_size=ffn
    )


# Real Pythia sizes (EleutherAI's config.json: 6 layers, hidden 128 / 256 / 512, vocab padded to 50304) and Llamas
# of the smallest and the 70m width. Across them the LM head's share of the GEMM FLOPs falls from 84% (pythia-14m)
# to 46% (llama2-6x512), and with it what fusing the head and loss can save: the ratio is a property of the
# config, so the benchmark reports the whole ladder, not one point of it.
CONFIGS = {
    "pythia-14m": pythia(128, 4),
    "pythia-31m": pythia(256, 8),
    "pythia-70m": pythia(512, 8),
    "llama2-6x128": llama2(128, 4, 344),
    "llama2-6x512": llama2(512, 8, 1376),
}
SIDES = ("ours", "hf")
WARMUP_STEPS = 2  # allocator and kernel warm-up; the first also gives the loss both sides must agree on


def machine_busy_s() -> float:
    """CPU seconds the whole machine has spent busy since boot (Linux; 0 elsewhere)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return 0.0
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


def own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def rss_mib(field: str) -> float:
    """A memory field of this process (VmHWM: peak RSS) in MiB (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def model_config(config: str, seq: int):
    from trnrecipes.config.sections import ModelConfig

    family, sizes = CONFIGS[config]
    return ModelConfig(family=family, max_seq_len=seq, **sizes)


def build(config: str, side: str, seq: int, batch: int):
    """The model of one side and a closure running one training step; the same setup work on both sides."""
    import torch
    import transformers

    from trnrecipes.models import FAMILIES, build_model, model_args

    torch.manual_seed(0)
    cfg = model_config(config, seq)
    ours = build_model(cfg)
    ours.init_weights()
    # Own generator: building the HF model draws from the global one, the batch must not depend on that.
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
    hf_mod = FAMILIES[cfg.family].hf
    args = model_args(cfg)
    hf_cfg = transformers.AutoConfig.for_model(**hf_mod.hf_config_from_args(args), attn_implementation="sdpa")
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    sd = hf_mod.state_dict_to_hf(ours.state_dict(), args)
    hf.load_state_dict({("lm_head.weight" if k == "embed_out.weight" else k): v for k, v in sd.items()})
    del sd
    if side == "hf":
        model, ours = hf, None

        def loss_of():
            return model(input_ids=tokens, labels=tokens).loss  # HF shifts the labels itself, ignores the last
    else:
        model, hf = ours, None
        # Next-token targets, the last position has none: the same b * (s - 1) targets HF averages over.
        labels = torch.cat([tokens[:, 1:], torch.full_like(tokens[:, :1], -100)], dim=1)

        def loss_of():
            return model(tokens, labels=labels)

    model.train()

    def step() -> float:
        loss = loss_of()
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss.item()

    return step


def timed_s(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def linear_shapes(model) -> dict[tuple[int, int], int]:
    """(in_features, out_features) of every nn.Linear in the model, the LM head included -> how many there are."""
    from torch import nn

    shapes: dict[tuple[int, int], int] = {}
    for mod in model.modules():
        if isinstance(mod, nn.Linear):
            key = (mod.in_features, mod.out_features)
            shapes[key] = shapes.get(key, 0) + 1
    return shapes


def floor_sampler(model, batch: int, seq: int):
    """A function timing, once, every GEMM and the attention of one training step at the model's shapes (see the
    docstring): returns seconds {"gemm_s", "attention_s"}. Its buffers are made here, once, not in the timing."""
    import torch
    import torch.nn.functional as F

    tokens = batch * seq
    gemm_sets = []
    for (n_in, n_out), count in linear_shapes(model).items():
        x, w, dy = torch.randn(tokens, n_in), torch.randn(n_out, n_in), torch.randn(tokens, n_out)
        y, dx, dw = torch.empty(tokens, n_out), torch.empty(tokens, n_in), torch.empty(n_out, n_in)

        def gemms(x=x, w=w, dy=dy, y=y, dx=dx, dw=dw):
            torch.mm(x, w.t(), out=y)
            torch.mm(dy, w, out=dx)
            torch.mm(dy.t(), x, out=dw)

        gemm_sets.append((count, gemms))
    args = model.args
    kv_heads = getattr(args, "num_kv_heads", None) or args.num_heads  # fewer under Llama's grouped-query attention
    q = torch.randn(batch, args.num_heads, seq, args.head_dim, requires_grad=True)
    k, v = (torch.randn(batch, kv_heads, seq, args.head_dim, requires_grad=True) for _ in range(2))
    grad = torch.randn_like(q)

    def attention():
        gqa = kv_heads != args.num_heads
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa).backward(grad)
        q.grad = k.grad = v.grad = None

    def sample() -> dict[str, float]:
        with torch.no_grad():
            gemm_s = sum(count * timed_s(gemms) for count, gemms in gemm_sets)
        return {"gemm_s": gemm_s, "attention_s": args.num_layers * timed_s(attention)}

    return sample


def build_floor(config: str, seq: int, batch: int):
    from trnrecipes.models import build_model

    model = build_model(model_config(config, seq), device="meta")  # shapes only
    return floor_sampler(model, batch, seq)


def worker(config: str, side: str, seq: int, batch: int) -> None:
    """One side, driven over stdin/stdout: 'step' times one step (the floor side: one floor sample), 'peak' reports
    peak RSS so far. The floor runs in a process of its own so its buffers never count in a model's peak RSS."""
    if side == "floor":
        run = build_floor(config, seq, batch)  # one floor sample; its timings go into the reply
        run()  # warm-up: first-touch page faults, kernel selection
        print(json.dumps({"ready": True}), flush=True)
    else:
        step = build(config, side, seq, batch)

        def run() -> dict:
            step()
            return {}

        gc.collect()
        try:  # count the peak from here: what training needs, not the other side's model built during setup
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
        loss = step()
        for _ in range(WARMUP_STEPS - 1):
            step()
        print(json.dumps({"loss": loss}), flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "step":
            cpu, start = own_cpu_s(), time.perf_counter()
            timing = run()
            print(json.dumps({"s": time.perf_counter() - start, "cpu": own_cpu_s() - cpu, **timing}), flush=True)
        elif command == "peak":
            print(json.dumps({"peak_mib": rss_mib("VmHWM")}), flush=True)
        else:
            raise SystemExit(f"worker: unknown command {line!r}")


def ask(proc: subprocess.Popen, command: str, what: str) -> dict:
    proc.stdin.write(command + "\n")
    proc.stdin.flush()
    return reply(proc, what)


def reply(proc: subprocess.Popen, what: str) -> dict:
    line = proc.stdout.readline()
    if not line:
        proc.wait()
        raise SystemExit(f"{what}: the worker died (exit {proc.returncode}); its stderr is above")
    return json.loads(line)


def compare(config: str, steps: int, seq: int, batch: int) -> None:
    procs = {
        side: subprocess.Popen(
            [sys.executable, __file__, "--worker", config, side, "--seq", str(seq), "--batch", str(batch)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for side in (*SIDES, "floor")
    }
    setup = {side: reply(p, f"{config} {side} setup") for side, p in procs.items()}
    losses = {side: setup[side]["loss"] for side in SIDES}
    if abs(losses["ours"] - losses["hf"]) > 1e-4 * abs(losses["hf"]):
        raise SystemExit(f"{config}: our loss {losses['ours']} differs from HF's {losses['hf']}: not the same model")
    times: dict[str, list[float]] = {side: [] for side in SIDES}
    parts: dict[str, list[float]] = {"gemm_s": [], "attention_s": []}  # the floor samples
    worker_cpu = 0.0
    busy, wall, main_cpu = machine_busy_s(), time.perf_counter(), own_cpu_s()
    for i in range(steps):
        # A floor sample sits between or beside each pair, so HF/floor, like HF/ours, compares neighbours in time.
        for side in ("ours", "hf", "floor") if i % 2 == 0 else ("floor", "hf", "ours"):
            r = ask(procs[side], "step", f"{config} {side} step {i}")
            worker_cpu += r["cpu"]
            if side == "floor":
                for name in parts:
                    parts[name].append(r[name])
            else:
                times[side].append(r["s"])
    wall = time.perf_counter() - wall
    foreign = (machine_busy_s() - busy - worker_cpu - (own_cpu_s() - main_cpu)) / wall / (os.cpu_count() or 1)
    peaks = {side: ask(procs[side], "peak", f"{config} {side} peak")["peak_mib"] for side in SIDES}
    for p in procs.values():
        p.stdin.close()
        p.wait()
    ratios = sorted(h / o for o, h in zip(times["ours"], times["hf"], strict=True))
    floors = [g + a for g, a in zip(parts["gemm_s"], parts["attention_s"], strict=True)]
    bounds = sorted(h / f for f, h in zip(floors, times["hf"], strict=True))
    tok_s = {side: batch * seq / statistics.median(times[side]) for side in SIDES}
    print(
        f"{config:12s} loss {losses['ours']:.6f} = HF {losses['hf']:.6f}"
        f"  ours {tok_s['ours']:6.0f} tok/s  HF {tok_s['hf']:6.0f} tok/s"
        f"  ratio {statistics.median(ratios):.2f}x (pairs {ratios[0]:.2f}-{ratios[-1]:.2f}, goal >= 1.25x)"
        f"  | peak RSS ours {peaks['ours']:.0f} MiB, HF {peaks['hf']:.0f} MiB"
    )
    floor_s = statistics.median(floors)
    print(
        f"        kernel floor {floor_s:.4f} s per step (GEMMs {statistics.median(parts['gemm_s']):.4f} s, attention"
        f" {statistics.median(parts['attention_s']):.4f} s) = {batch * seq / floor_s:.0f} tok/s at most;"
        f" HF/floor {statistics.median(bounds):.2f}x (pairs {bounds[0]:.2f}-{bounds[-1]:.2f}),"
        " the ratio if a step did nothing else"
    )
    if foreign > 0.05:  # timings taken next to other work (a parallel build, a test run) are not worth comparing
        print(f"        warning: other programs took {foreign:.0%} of the CPUs during the timed steps")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="timed step pairs per config")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--config", choices=list(CONFIGS), action="append", help="default: all, in this order")
    parser.add_argument("--worker", nargs=2, metavar=("CONFIG", "SIDE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    for name in ("steps", "seq", "batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, not {getattr(args, name)}")
    if args.worker:
        worker(*args.worker, args.seq, args.batch)
        return 0
    print(
        f"training step (loss + backward), fp32, CPU, batch {args.batch} x seq {args.seq}, {args.steps} step pairs"
        f" in lockstep after {WARMUP_STEPS} warm-up steps; ratio = median of HF/ours step time over the pairs"
    )
    for config in args.config or list(CONFIGS):
        compare(config, args.steps, args.seq, args.batch)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
