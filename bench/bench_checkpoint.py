"""Benchmark: how long an async checkpoint save stalls the training loop, divided by a synchronous save's time
(goal <= 0.10). The real Trainer on pythia-70m (fp32, CPU, one process, micro-batch 1 x 128 tokens), the real
checkpoint files (weights + AdamW moments: ~0.85 GB, fsync'ed). One compute thread, as torchrun gives each worker
(OMP_NUM_THREADS=1): the writer needs a core the step does not use, as on a real training host.

    .venv/bin/python bench/bench_checkpoint.py [--steps 12] [--threads 1]
stall = (time of `steps` training steps with an async save at the first of them, waiting for the writer at the
end) - (time of `steps` steps without a save). A synchronous save blocks the loop for all of its time.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1, help="torch compute threads (torchrun's default: 1)")
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
        plain = min(steps(args.steps, 3), steps(args.steps, 3))

        trainer.checkpointer.async_save = False
        start = time.perf_counter()
        trainer.save(100, None)
        sync = time.perf_counter() - start

        trainer.checkpointer.async_save = True
        start = time.perf_counter()
        trainer.save(200, None)
        handoff = time.perf_counter() - start
        steps(args.steps - 1, 3)
        trainer.checkpointer.wait()
        with_async = time.perf_counter() - start
        size = sum(f.stat().st_size for f in (Path(tmp) / "checkpoints/step_100").rglob("*") if f.is_file())
        trainer._prefetch.close()
        trainer.close()
    stall = with_async - plain * (args.steps - 1) / args.steps
    print(
        f"pythia-70m checkpoint, {size / 1e9:.2f} GB, {args.steps} steps of {plain / args.steps * 1e3:.0f} ms,"
        f" {args.threads} compute thread(s)"
    )
    print(f"  synchronous save:            {sync:6.2f} s (the loop waits for all of it)")
    print(f"  async save, hand-off:        {handoff:6.2f} s (copy to host memory)")
    print(f"  async save, loop stall:      {stall:6.2f} s over {args.steps} steps (hand-off + slower steps + wait)")
    print(f"ratio stall / synchronous: {stall / sync:.3f} (goal <= 0.10)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
