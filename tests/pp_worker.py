"""Run under torchrun (or alone) by tests/test_pipeline.py: optimizer steps of a tiny recipe on FIXED micro-batches
through the real Trainer (pipeline stages or not), then one validation pass. Every rank saves what it holds to
OUT.rankN: per step the loss (the mean over the ranks that hold it), the grad norm and every gradient after
averaging and clipping (TP shards gathered), then the validation loss and the final weights. The test takes the
union over ranks (pipeline stages hold different parameters; DP replicas must agree).

    python tests/pp_worker.py OUT RECIPE [k=v ...]      (TRAIN_WORKER_STEPS optimizer steps, default 5)
Micro-batch i of a step is the same for every layout: a DP rank takes its contiguous share of the step's batches.
"""

from __future__ import annotations

import os
import sys

import torch

from trnrecipes.layout import compute_layout
from trnrecipes.recipe import load_recipe
from trnrecipes.train.loop import Trainer
from trnrecipes.train.parallel_dims import full_tensor


def main() -> None:
    out, name, *overrides = sys.argv[1:]
    recipe = load_recipe(name, overrides=overrides)
    trainer = Trainer(recipe, run_dir=None)
    layout = compute_layout(recipe)
    micro, seq = recipe.batch.micro_batch, recipe.batch.seq_len
    per_step = layout.grad_accum * layout.dp
    steps = int(os.environ.get("TRAIN_WORKER_STEPS", "5"))
    all_batches = torch.randint(0, 4000, (steps, per_step, micro, seq + 1), generator=torch.Generator().manual_seed(42))
    record: dict[str, object] = {"losses": [], "norms": [], "grads": []}
    for step in range(steps):
        first = trainer.dims.dp_rank * layout.grad_accum
        loss = trainer.accumulate(iter(all_batches[step, first : first + layout.grad_accum]), layout.grad_accum)
        record["losses"].append(trainer._dp_mean(loss))
        record["norms"].append(float(trainer.reduce_and_clip()))
        record["grads"].append({n: full_tensor(p.grad).detach().clone() for n, p in trainer.model.named_parameters()})
        trainer.optimizer_step(step)
    record["val_loss"] = trainer.validate()
    record["param_norm"] = float(trainer.backend.param_norm(trainer.model, trainer.dims))
    record["params"] = {n: full_tensor(p).detach().clone() for n, p in trainer.model.named_parameters()}
    torch.save(record, f"{out}.rank{trainer.dims.rank}")
    trainer.close()


if __name__ == "__main__":
    main()
