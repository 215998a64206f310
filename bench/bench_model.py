"""Benchmark: forward+backward tokens/s and peak memory of our model vs transformers' on the same config, CPU.

Each measurement runs in a fresh process (so peak RSS is its own); both sides use SDPA attention, fp32, the same
weights and batch. Prints ours/HF throughput ratios (goal >= 1.25x) and peak memory.

    .venv/bin/python bench/bench_model.py [--steps 5] [--seq 512] [--batch 4]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

CONFIGS = {  # pythia-70m and a Llama of similar size
    "neox": dict(vocab_size=50304, hidden_size=512, num_layers=6, num_heads=8, ffn_hidden_size=2048, rotary_pct=0.25),
    "llama2": dict(vocab_size=32000, hidden_size=512, num_layers=6, num_heads=8, num_kv_heads=8, ffn_hidden_size=1376),
}


def measure(family: str, side: str, steps: int, seq: int, batch: int) -> dict:
    import torch
    import transformers

    from trnrecipes.models import FAMILIES, build_model, model_args
    from trnrecipes.recipe import ModelConfig

    torch.manual_seed(0)
    cfg = ModelConfig(family=family, max_seq_len=seq, **CONFIGS[family])
    ours = build_model(cfg)
    ours.init_weights()
    hf_mod = FAMILIES[family].hf
    args = model_args(cfg)
    if side == "hf":
        hf_cfg = transformers.AutoConfig.for_model(**hf_mod.hf_config_from_args(args), attn_implementation="sdpa")
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
        sd = hf_mod.state_dict_to_hf(ours.state_dict(), args)
        model.load_state_dict({("lm_head.weight" if k == "embed_out.weight" else k): v for k, v in sd.items()})
        del ours

        def forward(t):
            return model(t).logits
    else:
        model = ours
        forward = model
    model.train()
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq))
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for step in range(steps + 1):
        start = time.perf_counter()
        logits = forward(tokens)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())
        loss.backward()
        model.zero_grad(set_to_none=True)
        if step:  # the first step warms up allocators and kernels
            times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"tokens_per_s": batch * seq * len(times) / sum(times), "peak_mib": peak / 1024, "base_mib": base_rss / 1024}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--one", nargs=2, metavar=("FAMILY", "SIDE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(*args.one, args.steps, args.seq, args.batch)))
        return 0
    print(f"fwd+bwd, fp32, CPU, batch {args.batch} x seq {args.seq}, {args.steps} timed steps after 1 warm-up")
    for family in CONFIGS:
        result = {}
        for side in ("ours", "hf"):
            cmd = [sys.executable, __file__, "--one", family, side, *sys.argv[1:]]
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            result[side] = json.loads(done.stdout.strip().splitlines()[-1])
        o, h = result["ours"], result["hf"]
        print(
            f"{family:7s} ours {o['tokens_per_s']:8.0f} tok/s  HF {h['tokens_per_s']:8.0f} tok/s"
            f"  ratio {o['tokens_per_s'] / h['tokens_per_s']:.2f}x (goal >= 1.25x)"
            f"  | peak RSS ours {o['peak_mib']:.0f} MiB, HF {h['peak_mib']:.0f} MiB"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
