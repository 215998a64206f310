"""Run in .venv-xla by tests/test_xla.py: train a tiny recipe on one backend and report losses and XLA compiles.

    python tests/xla_worker.py OUT.json BACKEND RUN_DIR [k=v ...]
After the run, one extra forward+backward with a different sequence length shows what a dynamic shape costs.
"""

from __future__ import annotations

import json
import sys

import torch

from trnrecipes.recipe import load_recipe
from trnrecipes.train.loop import Trainer


def main() -> None:
    out, backend, run_dir, *overrides = sys.argv[1:]
    recipe = load_recipe("llama2-tiny", overrides=[f"cluster.backend={backend}", f"run_dir={run_dir}", *overrides])
    trainer = Trainer(recipe)
    result = trainer.run()
    report = {
        "losses": result.losses,
        "val_losses": {str(k): v for k, v in result.val_losses.items()},
        "compilations": result.compilations,
        "checkpoints": [str(p) for p in result.checkpoints],
    }
    if backend == "xla":
        before = trainer.backend.compilations()
        seq = recipe.batch.seq_len + 1 - 8  # a shorter batch, as a ragged last batch would be
        odd = torch.randint(0, 100, (1, recipe.batch.micro_batch, seq)).to(trainer.backend.device)
        trainer.accumulate(iter(odd), 1)
        report["dynamic_shape_compiles"] = trainer.backend.compilations() - before
    trainer.close()
    with open(out, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
