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

    .venv/bin/python bench/bench_memory.py --loss [--seq 8192] [--mode gathered|vocab-parallel]
The loss phase alone at TP 2 (LOSS_MODEL: Llama 3.1's 128,256 vocabulary): the vocab-parallel loss TP training uses
against the gathered logits (logits_loss) it replaced; peak RSS of the loss's forward and backward, per rank. The
gathered path at 8192 tokens needs about 12.5 GiB a rank (25 for the two) at its peak.
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


# --loss: the loss phase alone, TP 2, the vocab-parallel loss vs the gathered logits (logits_loss, the path before it)
LOSS_MODES = ("gathered", "vocab-parallel")
# Llama 3.1's vocabulary on a small 2-layer body: the loss phase is the vocabulary's, the body only makes its input
LOSS_MODEL = dict(family="llama2", vocab_size=128_256, hidden_size=512, num_layers=2, num_heads=8, num_kv_heads=8,
                  ffn_hidden_size=1536)  # fmt: skip


def reset_peak() -> None:
    """Start VmHWM afresh from the current RSS (Linux: clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def loss_worker(out_dir: Path, mode: str, seq: int) -> None:
    """One TP rank (under torchrun, 2 ranks): a 2-layer Llama with a 128,256 vocabulary, fp32, one micro-batch of
    `seq` tokens through the layers, then the loss phase alone (the head's loss, forward and backward, on the final
    hidden states detached), with VmHWM reset just before it."""
    sys.path.insert(0, str(REPO))
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from recipes.common.loss import logits_loss
    from trnrecipes.config.sections import ModelConfig
    from trnrecipes.models import build_model
    from trnrecipes.parallel.tensor import apply_tensor_parallel, vocab_parallel_head_loss

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    model = build_model(ModelConfig(**LOSS_MODEL, max_seq_len=seq))
    model.init_weights(seed=0)
    model = apply_tensor_parallel(model, init_device_mesh("cpu", (dist.get_world_size(),)), "llama2", False)
    assert model.head_loss is vocab_parallel_head_loss  # what TP training uses; logits_loss is the reference
    head_loss = logits_loss if mode == "gathered" else vocab_parallel_head_loss
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, LOSS_MODEL["vocab_size"], (1, seq + 1), generator=g)
    labels = tokens[:, 1:].clone()
    labels[0, : seq // 8] = -100  # a prompt not trained on
    x = model.norm(model.layers[1](model.layers[0](model.embed(tokens[:, :-1]))))
    hidden = x.detach().requires_grad_()
    dist.barrier()
    reset_peak()
    before = rss_bytes()
    start = time.perf_counter()
    loss = head_loss(model.head, hidden, labels)
    loss.backward()
    elapsed = time.perf_counter() - start
    report = {"rank": dist.get_rank(), "before_bytes": before, "peak_bytes": vmhwm_bytes(), "loss": loss.item(),
              "seconds": elapsed}  # fmt: skip
    (out_dir / f"{mode}-rank{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def loss_main(seq: int, modes: tuple[str, ...]) -> int:
    print(
        f"loss phase, host memory per rank: TP 2 (cpu/gloo, 1 thread a rank), a 2-layer Llama (hidden"
        f" {LOSS_MODEL['hidden_size']}) with vocabulary {LOSS_MODEL['vocab_size']:,}, 1 x {seq} tokens, fp32; the"
        " loss's forward and backward on the final hidden states, VmHWM reset just before; one mode at a time",
        flush=True,
    )
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_memory-loss-") as tmp:
        for mode in modes:
            print(f"  {mode} ...", end="", flush=True)
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--rdzv-backend=c10d",
                   "--rdzv-endpoint=localhost:0", __file__, "--loss-worker", tmp, "--mode", mode,
                   "--seq", str(seq)]  # fmt: skip
            start = time.perf_counter()
            done = subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                                  text=True)  # fmt: skip
            if done.returncode != 0:
                sys.stderr.write(done.stdout[-4000:] + done.stderr[-8000:])
                raise SystemExit(f"{mode}: torchrun failed (exit {done.returncode}); its output is above")
            print(f" {time.perf_counter() - start:.0f} s", flush=True)
            results[mode] = [json.loads((Path(tmp) / f"{mode}-rank{r}.json").read_text()) for r in range(2)]
    full_logits = seq * LOSS_MODEL["vocab_size"] * 4
    print(
        f"the whole vocabulary's fp32 logits: {full_logits / MIB:.0f} MiB; a rank's shard {full_logits / 2 / MIB:.0f}"
    )
    print(f"{'mode':<15} {'RSS before':>11} {'peak in the loss':>17} {'growth':>10} {'loss':>9} {'seconds':>8}")
    for mode, reports in results.items():
        r = max(reports, key=lambda r: r["peak_bytes"])
        print(
            f"{mode:<15} {r['before_bytes'] / MIB:>7.0f} MiB {r['peak_bytes'] / MIB:>13.0f} MiB"
            f" {(r['peak_bytes'] - r['before_bytes']) / MIB:>6.0f} MiB {r['loss']:>9.4f} {r['seconds']:>8.1f}"
        )
    if len(results) < 2:
        return 0
    peak = {m: max(r["peak_bytes"] for r in reports) for m, reports in results.items()}
    growth = {m: max(r["peak_bytes"] - r["before_bytes"] for r in reports) for m, reports in results.items()}
    print(
        f"vocab-parallel / gathered: peak {peak['vocab-parallel'] / peak['gathered']:.2f},"
        f" growth {growth['vocab-parallel'] / growth['gathered']:.2f} (largest rank; goal: peak <= 0.60)"
    )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="320m", help="320m: 322.5M params; tiny: a smoke run")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per configuration")
    parser.add_argument("--seq", type=int, help="tokens per micro-batch (micro-batch 1); default 64, --loss 8192")
    parser.add_argument("--loss", action="store_true", help="the loss phase at TP 2: vocab-parallel vs gathered")
    parser.add_argument("--worker", metavar="OUT_DIR", help=argparse.SUPPRESS)
    parser.add_argument("--loss-worker", metavar="OUT_DIR", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=LOSS_MODES, help="with --loss: only this one (default: both)")
    parser.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.seq is None:
        args.seq = 8192 if args.loss or args.loss_worker else 64
    for name in ("steps", "seq"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, not {getattr(args, name)}")
    if args.overrides and not args.worker:
        parser.error(f"unexpected arguments: {' '.join(args.overrides)}")
    if args.worker:
        worker(Path(args.worker), args.steps, args.overrides)
        return 0
    if args.loss_worker:
        loss_worker(Path(args.loss_worker), args.mode, args.seq)
        return 0
    if args.loss:
        return loss_main(args.seq, (args.mode,) if args.mode else LOSS_MODES)

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
