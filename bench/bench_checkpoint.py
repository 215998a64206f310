"""Benchmark: how long an async checkpoint save stalls the training loop, divided by a synchronous save's time
(goal <= 0.10). The real Trainer on pythia-70m (fp32, CPU, one process, micro-batch 1 x 128 tokens), the real
checkpoint files (weights + AdamW moments: ~0.85 GB, fsync'ed). One compute thread, as torchrun gives each worker
(OMP_NUM_THREADS=1): the writer needs a core the step does not use, as on a real training host.

    .venv/bin/python bench/bench_checkpoint.py [--steps 12] [--threads 1] [--repeats 5]
stall = (time of `steps` training steps with an async save at the first of them, waiting for the writer at the
end) - (time of `steps` steps without a save), median of interleaved pairs. A synchronous save blocks the loop for
all of its time. One pair's stall is the difference of two ~14 s timings, so on a shared 2-core machine single
pairs scatter by a few tenths of a second; the median of interleaved pairs is what is reported.
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
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1, help="torch compute threads (torchrun's default: 1)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved (plain, async) pairs; median reported")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    import torch

    torch.set_num_threads(args.threads)
    from trnrecipes.recipe import load_recipe
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

        def steps(n: int, first: int) -> float:
            start = time.perf_counter()
            for i in range(n):
                trainer.train_step(first + i, loader, 1)
            return time.perf_counter() - start

        steps(3, 0)  # warm-up

        trainer.checkpointer.async_save = False
        syncs = []
        for r in range(3):  # the page cache makes single saves vary by a second
            start = time.perf_counter()
            trainer.save(100 + r, None)
            syncs.append(time.perf_counter() - start)
        sync = statistics.median(syncs)

        # Pairs of (steps without a save, the same steps with an async save at the first), interleaved so that
        # drift of this shared machine cancels within a pair; the median pair is reported.
        trainer.checkpointer.async_save = True
        stalls, handoffs, plains = [], [], []
        for r in range(args.repeats):
            plain = steps(args.steps, 3)
            start = time.perf_counter()
            trainer.save(200 + r, None)
            handoffs.append(time.perf_counter() - start)
            steps(args.steps - 1, 3)
            trainer.checkpointer.wait()
            stalls.append(time.perf_counter() - start - plain * (args.steps - 1) / args.steps)
            plains.append(plain)
        stall, handoff, plain = (statistics.median(x) for x in (stalls, handoffs, plains))
        size = sum(f.stat().st_size for f in (Path(tmp) / "checkpoints/step_100").rglob("*") if f.is_file())
        trainer._prefetch.close()
        trainer.close()
    print(
        f"pythia-70m checkpoint, {size / 1e9:.2f} GB, {args.steps} steps of {plain / args.steps * 1e3:.0f} ms,"
        f" {args.threads} compute thread(s)"
    )
    print(f"  synchronous save:            {sync:6.2f} s (the loop waits for all of it; median of 3)")
    print(f"  async save, hand-off:        {handoff:6.2f} s (copy to host memory)")
    print(
        f"  async save, loop stall:      {stall:6.2f} s over {args.steps} steps (hand-off + slower steps + wait;"
        f" median of {', '.join(f'{x:.2f}' for x in stalls)})"
    )
    print(f"ratio stall / synchronous: {stall / sync:.3f} (goal <= 0.10)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
