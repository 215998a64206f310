"""Benchmark: host memory per rank when training, sharded vs not. Peak RSS of the largest rank at TP=2 and at DP=2
with ZeRO-1, each divided by the peak RSS at TP=1 DP=1 (goal: both well under 1; issue 16). The real Trainer on
llama2-tiny's recipe widened to a >= 300M-parameter Llama (1024 hidden x 20 layers, ffn 2816, vocab 32000: 322.5M
parameters), fp32, AdamW, CPU/gloo, micro-batch 1 x 64 tokens, one compute thread per rank (as torchrun gives each
worker).

    .venv/bin/python bench/bench_memory.py [--shape 320m|tiny] [--steps 2] [--seq 64]
The three layouts run one after the other (never at the same time, so the machine holds one of them at a time),
each under torchrun, each rank in a process of its own: its peak RSS (getrusage ru_maxrss) is its own. Each rank
also reports VmHWM right after the Trainer is built (model + optimizer, before the first step) and how many
parameter elements it holds. Training steps only: no checkpoint is saved (a save adds the host copies of the
writer, a property of the checkpoint package, not of the layout). The theory column is weights + grads + AdamW's
two moments at 4 bytes each: 16 bytes/param at TP 1, 8 per rank at TP 2, 4 + 4 + 8/2 = 12 at DP 2 with ZeRO-1;
activations, the data pipeline and torch itself come on top.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RECIPE = "llama2-tiny"
MIB = 1 << 20

# model.* overrides on top of the recipe; "tiny" keeps llama2-tiny's own shape (a fast smoke run for the test).
SHAPES = {
    "320m": {"hidden_size": 1024, "num_layers": 20, "num_heads": 16, "num_kv_heads": 16, "ffn_hidden_size": 2816,
             "vocab_size": 32000},
    "tiny": {},
}  # fmt: skip
MIN_PARAMS = {"320m": 300_000_000, "tiny": 0}

# name, ranks, layout overrides, bytes per parameter per rank of weights + grads + 2 moments (fp32) in theory
CONFIGS = [
    ("TP1 DP1", 1, ["cluster.workers_per_node=1"], 16),
    ("TP2", 2, ["cluster.workers_per_node=2", "layout.tp=2"], 8),
    ("DP2 ZeRO-1", 2, ["cluster.workers_per_node=2", "layout.zero1=true"], 12),
]


def vmhwm_bytes() -> int:
    """Peak RSS of this process so far, from /proc/self/status (Linux); ru_maxrss where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def overrides(shape: str, steps: int, seq: int) -> list[str]:
    """Everything but the layout: the same model, data and batch for every configuration. Global batch 2 at
    micro-batch 1: accumulation 1 at DP 2, 2 at DP 1 (the same memory: one micro-batch's activations at a time)."""
    return [
        *(f"model.{k}={v}" for k, v in SHAPES[shape].items()),
        "cluster.instance=local-cpu", "cluster.backend=cpu", "layout.sequence_parallel=false",
        "precision.dtype=fp32", "precision.stochastic_rounding=false", f"batch.seq_len={seq}",
        f"model.max_seq_len={max(seq, 128)}", "batch.micro_batch=1", "batch.global_batch=2",
        f"train.max_steps={steps}", "slurm.time_limit=null",
    ]  # fmt: skip


def worker(out_dir: Path, steps: int, recipe_overrides: list[str]) -> None:
    """One rank (under torchrun): build the Trainer, train `steps` steps, write this rank's memory as JSON."""
    sys.path.insert(0, str(REPO))
    from trnrecipes.config.recipe import load_recipe
    from trnrecipes.train.loop import Trainer

    recipe = load_recipe(RECIPE, overrides=recipe_overrides)
    trainer = Trainer(recipe, log=lambda *a, **k: None)  # the run dir: TRNRECIPES_RUN_DIR, a temporary one
    built = vmhwm_bytes()
    params = list(trainer.model.parameters())
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in params)
    loader, _ = trainer._train_loader(None)
    start = time.perf_counter()
    for step in range(steps):
        trainer.train_step(step, loader, trainer.layout.grad_accum)
    elapsed = time.perf_counter() - start
    trainer._prefetch.close()
    rank = int(os.environ.get("RANK", "0"))
    report = {
        "rank": rank,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "after_build_hwm_bytes": built,
        "model_params": sum(p.numel() for p in params),  # a DTensor's numel is the full parameter's
        "local_params": local,
        "step_s": elapsed / steps,
    }
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report))
    trainer.close()


def launch(name: str, nproc: int, layout: list[str], shape: str, steps: int, seq: int, tmp: Path) -> list[dict]:
    """One configuration under torchrun; every rank's report, rank order."""
    out_dir, run_dir = tmp / f"{name.replace(' ', '_')}-out", tmp / f"{name.replace(' ', '_')}-run"
    out_dir.mkdir()
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
        "--rdzv-endpoint=localhost:0", __file__, "--worker", str(out_dir), "--steps", str(steps), "--",
        *overrides(shape, steps, seq), *layout,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRNRECIPES_RUN_DIR": str(run_dir)}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        print(flush=True)
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-8000:])
        raise SystemExit(f"{name}: torchrun failed (exit {done.returncode}); its output is above")
    reports = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(nproc)]
    return reports


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="320m", help="320m: 322.5M params; tiny: a smoke run")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per configuration")
    parser.add_argument("--seq", type=int, default=64, help="tokens per micro-batch (micro-batch 1)")
    parser.add_argument("--worker", metavar="OUT_DIR", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    for name in ("steps", "seq"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, not {getattr(args, name)}")
    if args.overrides and not args.worker:
        parser.error(f"unexpected arguments: {' '.join(args.overrides)}")
    if args.worker:
        worker(Path(args.worker), args.steps, args.overrides)
        return 0

    size = SHAPES[args.shape]
    shape = f"{size['hidden_size']} hidden x {size['num_layers']} layers" if size else "llama2-tiny's shape"
    print(
        f"host memory per rank: {RECIPE} at {shape}, fp32, AdamW, cpu/gloo, micro-batch 1 x {args.seq} tokens,"
        f" {args.steps} step(s) per layout, 1 compute thread per rank; the layouts run one after the other",
        flush=True,
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_memory-") as tmp:
        for name, nproc, layout, bytes_per_param in CONFIGS:
            print(f"  {name}: {nproc} rank(s) ...", end="", flush=True)
            start = time.perf_counter()
            reports = launch(name, nproc, layout, args.shape, args.steps, args.seq, Path(tmp))
            largest = max(reports, key=lambda r: r["peak_rss_bytes"])
            print(f" {time.perf_counter() - start:.0f} s (a step {largest['step_s']:.1f} s)", flush=True)
            params = largest["model_params"]
            if params < MIN_PARAMS[args.shape]:
                raise SystemExit(f"the model has {params:,} parameters, fewer than {MIN_PARAMS[args.shape]:,}")
            rows.append((name, nproc, largest, bytes_per_param * params))
    params = rows[0][2]["model_params"]
    base = rows[0][2]["peak_rss_bytes"]
    print(f"model: {params / 1e6:.1f}M parameters ({params:,}); weights alone {4 * params / MIB:.0f} MiB in fp32")
    print(
        f"{'config':<12} {'ranks':>5} {'peak RSS, largest rank':>23} {'after build (VmHWM)':>20}"
        f" {'params on rank':>15} {'theory (W+G+2M)':>16} {'ratio vs TP1 DP1':>17}"
    )
    for name, nproc, r, theory in rows:
        peak, built = r["peak_rss_bytes"] / MIB, r["after_build_hwm_bytes"] / MIB
        print(
            f"{name:<12} {nproc:>5} {peak:>19.0f} MiB {built:>16.0f} MiB {r['local_params'] / 1e6:>14.1f}M"
            f" {theory / MIB:>12.0f} MiB {r['peak_rss_bytes'] / base:>17.2f}"
        )
    ratios = {name: r["peak_rss_bytes"] / base for name, _, r, _ in rows}
    print(f"TP=2 / TP=1: {ratios['TP2']:.2f} (peak RSS of the largest rank; goal: well under 1, theory 0.50)")
    print(f"DP=2 ZeRO-1 / TP=1 DP=1: {ratios['DP2 ZeRO-1']:.2f} (goal: well under 1, theory 0.75)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
