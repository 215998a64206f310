"""Benchmark: how long an async checkpoint save stalls the training loop, divided by a synchronous save's time
(goal <= 0.10). The real Trainer on pythia-70m (fp32, CPU, one process, micro-batch 1 x 128 tokens), the real
checkpoint files (weights + AdamW moments: ~0.85 GB, fsync'ed). One compute thread, as torchrun gives each worker
(OMP_NUM_THREADS=1): the writer needs a core the step does not use, as on a real training host.

    .venv/bin/python bench/bench_checkpoint.py [--steps 12] [--threads 1] [--repeats 5]
stall = the async save's hand-off + how much longer than a plain step (median of the interleaved blocks of `steps`
plain steps) the steps beside the writer took + the wait for the writer to finish; median of `repeats`. A
synchronous save blocks the loop for all of its time (median of 3).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12, help="plain steps per repeat (the baseline)")
    parser.add_argument("--threads", type=int, default=1, help="torch compute threads (torchrun's default: 1)")
    parser.add_argument("--repeats", type=int, default=5, help="(plain block, async save) repeats; median reported")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    import torch

    torch.set_num_threads(args.threads)
    from trnrecipes.config.recipe import load_recipe
    from trnrecipes.train.loop import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        overrides = [
            "cluster.instance=local-cpu", "cluster.backend=cpu", "cluster.workers_per_node=1", "layout.tp=1",
            "layout.sequence_parallel=false", "precision.dtype=fp32", "precision.stochastic_rounding=false",
            "batch.global_batch=1", "batch.micro_batch=1", "batch.seq_len=128", "data.format=arrow",
            "data.path=data/demo/pythondocs.arrow", "checkpoint.keep_last=10", f"run_dir={tmp}",
            "slurm.time_limit=null",
        ]  # fmt: skip
        recipe = load_recipe("pythia-70m", overrides=overrides)
        trainer = Trainer(recipe, log=lambda *a, **k: None)
        loader, _ = trainer._train_loader(None)

        def step_times(n: int) -> list[float]:
            times = []
            for i in range(n):
                start = time.perf_counter()
                trainer.train_step(3 + i, loader, 1)
                times.append(time.perf_counter() - start)
            return times

        step_times(3)  # warm-up

        trainer.checkpointer.async_save = False
        syncs = []
        for r in range(3):  # the page cache makes single saves vary by a second
            start = time.perf_counter()
            trainer.save(100 + r, None)
            syncs.append(time.perf_counter() - start)
        sync = statistics.median(syncs)

        # Each repeat: a block of plain steps (the baseline: median over all blocks so far), then an async save and
        # the steps that run beside the writer until it is done. Stall = hand-off + those steps' excess over the
        # baseline + the final wait. Counting only the steps beside the writer keeps the noise of the other steps
        # out; the median repeat is reported.
        trainer.checkpointer.async_save = True
        plain_steps: list[float] = []
        stalls, handoffs, beside = [], [], []
        for r in range(args.repeats):
            plain_steps += step_times(args.steps)
            base = statistics.median(plain_steps)
            start = time.perf_counter()
            trainer.save(200 + r, None)
            handoffs.append(time.perf_counter() - start)
            during: list[float] = []
            while trainer.checkpointer.busy():
                during += step_times(1)
            start = time.perf_counter()
            trainer.checkpointer.wait()
            waited = time.perf_counter() - start
            stalls.append(handoffs[-1] + sum(t - base for t in during) + waited)
            beside.append(len(during))
        stall, handoff = statistics.median(stalls), statistics.median(handoffs)
        size = sum(f.stat().st_size for f in (Path(tmp) / "checkpoints/step_100").rglob("*") if f.is_file())
        trainer._prefetch.close()
        trainer.close()
    print(
        f"pythia-70m checkpoint, {size / 1e9:.2f} GB, steps of {base * 1e3:.0f} ms (median),"
        f" {args.threads} compute thread(s)"
    )
    print(f"  synchronous save:            {sync:6.2f} s (the loop waits for all of it; median of 3)")
    print(f"  async save, hand-off:        {handoff:6.2f} s (copy to host memory)")
    print(
        f"  async save, loop stall:      {stall:6.2f} s (hand-off + slower steps + wait; median of"
        f" {', '.join(f'{x:.2f}' for x in stalls)}; {statistics.median(beside):.0f} steps ran beside the writer)"
    )
    print(f"ratio stall / synchronous: {stall / sync:.3f} (goal <= 0.10)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
