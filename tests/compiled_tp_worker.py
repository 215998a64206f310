"""Run under tests/ranks.py by tests/test_compiled_tp.py: three runs of a tiny recipe through the real Trainer in each
process, saving to OUT (rank 0) what the test compares.

    python tests/compiled_tp_worker.py OUT RUN_DIR RECIPE [k=v ...]

- eager: train.compile false, 4 steps, validation at 2 and 4, checkpoints at 2 and 4;
- compiled: train.compile true, the same (its first step and validation are the warm-up);
- resumed: train.compile true, 2 steps, then a new Trainer resumes from its step_2 and trains to 4, all of it under
  torch.compiler.set_stance("fail_on_recompile"): nothing may compile again after the compiled run's warm-up.
COMPILE_BACKEND names torch.compile's backend (unset: the backend's own, inductor on cpu).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from trnrecipes.backends.torch import TorchBackend
from trnrecipes.config.recipe import load_recipe
from trnrecipes.parallel.compile import is_compiled
from trnrecipes.parallel.dims import ParallelDims
from trnrecipes.train.loop import Trainer

RUN = ["train.max_steps=4", "train.val_every=2", "train.val_batches=1", "checkpoint.every_steps=2"]


def train(name: str, overrides: list[str], run_dir: Path, steps: int) -> tuple[list[float], dict, dict, bool]:
    """(losses, validation losses, the full weights, whether the blocks were compiled) of a run to `steps`."""
    recipe = load_recipe(name, overrides=[*overrides, *RUN, f"run_dir={run_dir}"])
    trainer = Trainer(recipe, log=lambda *a, **k: None)
    try:
        result = trainer.run(steps)
        weights = trainer.full_state_dict()  # a collective under TP and FSDP: every rank takes part
        compiled = all(is_compiled(block) for block in trainer.model.layers)
        sharded = any(isinstance(p, DTensor) for p in trainer.model.parameters())
        assert sharded, "the layout left every parameter whole"
        return result.losses, result.val_losses, weights, compiled
    finally:
        trainer.close()


def main() -> None:
    out, run_dir, name, *overrides = sys.argv[1:]
    if os.environ.get("COMPILE_BACKEND"):
        TorchBackend.compile_backend = os.environ["COMPILE_BACKEND"]
    root = Path(run_dir)
    ParallelDims.close = lambda self: None  # one process group for the four runs (gloo hangs on a second one)
    runs = {
        "eager": train(name, [*overrides, "train.compile=false"], root / "eager", 4),
        "compiled": train(name, [*overrides, "train.compile=true"], root / "compiled", 4),
        "first_half": train(name, [*overrides, "train.compile=true"], root / "resumed", 2),
    }
    with torch.compiler.set_stance("fail_on_recompile"):  # raises on any new compile
        runs["resumed"] = train(name, [*overrides, "train.compile=true"], root / "resumed", 4)
    if torch.distributed.get_rank() == 0:
        torch.save(runs, out)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
