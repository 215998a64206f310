"""Benchmark: a training step (forward + loss + backward) of our model vs transformers' on the same config, CPU.

Each side runs as a user would train it, in a fresh process of its own (so peak RSS is its own):
  ours: loss = model(tokens, labels=labels), labels = tokens shifted left with the last position -100 (ignored);
        the loss comes from the fused chunked head + cross-entropy (recipes/common/loss.py), no full logits.
  HF:   loss = model(input_ids=tokens, labels=tokens).loss, which shifts internally the same way.
Both use SDPA attention, fp32, the same weights and batch, and average over the same b * (s - 1) targets. HF's side
checks its first loss against ours (rel 1e-4) before it times anything, so both provably compute the same function.
Step time is the median over the timed steps (the machine may be shared; the median ignores a step slowed by a
neighbour), and a warning is printed when other programs took a share of the CPUs meanwhile. Prints ours/HF
throughput ratios (goal >= 1.25x) and peak RSS.

    .venv/bin/python bench/bench_model.py [--steps 5] [--seq 512] [--batch 4]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

CONFIGS = {  # pythia-70m and a Llama of similar size
    "neox": dict(vocab_size=50304, hidden_size=512, num_layers=6, num_heads=8, ffn_hidden_size=2048, rotary_pct=0.25),
    "llama2": dict(vocab_size=32000, hidden_size=512, num_layers=6, num_heads=8, num_kv_heads=8, ffn_hidden_size=1376),
}


def foreign_cpu_s() -> float:
    """CPU seconds the whole machine spent busy minus this process's own: what other programs took (Linux)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return 0.0
    busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
    own = os.times()
    return busy - own.user - own.system


def measure(family: str, side: str, steps: int, seq: int, batch: int, expect_loss: float | None) -> dict:
    import torch
    import transformers

    from trnrecipes.models import FAMILIES, build_model, model_args
    from trnrecipes.recipe import ModelConfig

    torch.manual_seed(0)
    cfg = ModelConfig(family=family, max_seq_len=seq, **CONFIGS[family])
    ours = build_model(cfg)
    ours.init_weights()
    # Own generator: building the HF model draws from the global one, the batch must not depend on that.
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
    hf_mod = FAMILIES[family].hf
    args = model_args(cfg)
    if side == "hf":
        hf_cfg = transformers.AutoConfig.for_model(**hf_mod.hf_config_from_args(args), attn_implementation="sdpa")
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
        sd = hf_mod.state_dict_to_hf(ours.state_dict(), args)
        model.load_state_dict({("lm_head.weight" if k == "embed_out.weight" else k): v for k, v in sd.items()})
        del ours

        def loss_of(t):
            return model(input_ids=t, labels=t).loss  # HF shifts the labels itself and ignores the last position
    else:
        model = ours
        # Next-token targets, the last position has none: the same b * (s - 1) targets HF averages over.
        labels = torch.cat([tokens[:, 1:], torch.full_like(tokens[:, :1], -100)], dim=1)

        def loss_of(t):
            return model(t, labels=labels)

    model.train()
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    foreign = 0.0
    for step in range(steps + 1):
        if step == 1:
            foreign = foreign_cpu_s()
        start = time.perf_counter()
        loss = loss_of(tokens)
        loss.backward()
        model.zero_grad(set_to_none=True)
        if step:  # the first step warms up allocators and kernels
            times.append(time.perf_counter() - start)
        else:
            first_loss = loss.item()
            if expect_loss is not None and abs(first_loss - expect_loss) > 1e-4 * abs(expect_loss):
                raise SystemExit(f"{family} {side}: loss {first_loss} differs from the other side's {expect_loss}")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "foreign_load": (foreign_cpu_s() - foreign) / sum(times) / (os.cpu_count() or 1),
        "tokens_per_s": batch * seq / statistics.median(times),
        "loss": first_loss,
        "peak_mib": peak / 1024,
        "base_mib": base_rss / 1024,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--one", nargs=2, metavar=("FAMILY", "SIDE"), help=argparse.SUPPRESS)
    parser.add_argument("--expect-loss", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(*args.one, args.steps, args.seq, args.batch, args.expect_loss)))
        return 0
    print(
        f"training step (loss + backward), fp32, CPU, batch {args.batch} x seq {args.seq},"
        f" median of {args.steps} timed steps after 1 warm-up"
    )
    for family in CONFIGS:
        result: dict = {}
        for side in ("ours", "hf"):
            cmd = [sys.executable, __file__, "--one", family, side, *sys.argv[1:]]
            if side == "hf":  # HF checks its first loss against ours before it times anything
                cmd += ["--expect-loss", repr(result["ours"]["loss"])]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"{family} {side} failed:\n{done.stderr.strip()}")
            result[side] = json.loads(done.stdout.strip().splitlines()[-1])
        o, h = result["ours"], result["hf"]
        print(
            f"{family:7s} loss {o['loss']:.6f} = HF {h['loss']:.6f}"
            f"  ours {o['tokens_per_s']:6.0f} tok/s  HF {h['tokens_per_s']:6.0f} tok/s"
            f"  ratio {o['tokens_per_s'] / h['tokens_per_s']:.2f}x (goal >= 1.25x)"
            f"  | peak RSS ours {o['peak_mib']:.0f} MiB, HF {h['peak_mib']:.0f} MiB"
        )
        for side, r in result.items():
            # Timings taken next to other work (a parallel build, test run) are not worth comparing.
            if r["foreign_load"] > 0.05:
                print(f"        warning: other programs took {r['foreign_load']:.0%} of the CPUs while {side} ran")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
