"""Run in .venv-xla by tests/test_xla.py: train a tiny recipe on one backend and report losses and XLA compiles.

    python tests/xla_worker.py OUT.json BACKEND RUN_DIR [k=v ...]
After the run, one extra forward+backward with a different sequence length shows what a dynamic shape costs.
The recipe is llama2-tiny, or XLA_WORKER_RECIPE's (bert-tiny: classification).
"""

from __future__ import annotations

import json
import os
import sys

import torch

from trnrecipes.config.recipe import load_recipe
from trnrecipes.train.loop import Trainer


def main() -> None:
    out, backend, run_dir, *overrides = sys.argv[1:]
    name = os.environ.get("XLA_WORKER_RECIPE", "llama2-tiny")
    recipe = load_recipe(name, overrides=[f"cluster.backend={backend}", f"run_dir={run_dir}", *overrides])
    trainer = Trainer(recipe)
    init_equal = None
    if recipe.train.init_from:  # does the run start from the checkpoint's weights, bitwise?
        from trnrecipes.checkpoint import read_model_checkpoint

        _, saved, _ = read_model_checkpoint(trainer._init_from())
        start = trainer.full_state_dict()
        init_equal = start.keys() == saved.keys() and all(torch.equal(start[k], saved[k]) for k in saved)
    result = trainer.run()
    report = {
        "init_equal": init_equal,
        "losses": result.losses,
        "val_losses": {str(k): v for k, v in result.val_losses.items()},
        "compilations": result.compilations,
        "checkpoints": [str(p) for p in result.checkpoints],
    }
    if backend == "xla":
        before = trainer.backend.compilations()
        seq = recipe.batch.seq_len + 1 - 8  # a shorter batch, as a ragged last batch would be
        odd = torch.randint(1, 2, (1, recipe.batch.micro_batch, seq)).to(trainer.backend.device)  # label 1 fits
        trainer.accumulate(iter(odd), 1)
        report["dynamic_shape_compiles"] = trainer.backend.compilations() - before
    trainer.close()
    with open(out, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
