"""Run under tests/ranks.py (or alone) by tests/test_pipeline.py: optimizer steps of a tiny recipe on FIXED
micro-batches through the real Trainer (pipeline stages or not), then one validation pass. Every rank saves what it
holds to OUT.rankN: per step the loss (the mean over the ranks that hold it), the grad norm and every gradient after
averaging and clipping (TP shards gathered), then the validation loss and the final weights. The test takes the union
over ranks (pipeline stages hold different parameters; DP replicas must agree).

    python tests/pp_worker.py OUT RECIPE [k=v ...]      (TRAIN_WORKER_STEPS optimizer steps, default 5)
The step batches are train_worker.fixed_steps': the same for every layout.
"""

from __future__ import annotations

import sys

import torch
from train_worker import fixed_steps, trainer_for

from trnrecipes.parallel.dims import full_tensor
from trnrecipes.plan.layout import compute_layout


def main() -> None:
    out, name, *overrides = sys.argv[1:]
    trainer = trainer_for(out, name, overrides)
    grad_accum = compute_layout(trainer.recipe).grad_accum
    record: dict[str, object] = {"losses": [], "norms": [], "grads": []}
    for step, mine in enumerate(fixed_steps(trainer, 5)):
        loss = trainer.accumulate(iter(mine), grad_accum)
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
