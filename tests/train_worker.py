"""Run under tests/ranks.py (or alone) by tests/test_train.py: a few optimizer steps of a tiny recipe on FIXED
micro-batches through the real Trainer, saving the averaged full gradients of the first step, the losses, the grad
norms and the final weights (and, per rank, that rank's own weights in OUT.rankN, as plain local tensors in
OUT.rankN.local).

    python tests/train_worker.py OUT.pt RECIPE [k=v ...]      (TRAIN_WORKER_STEPS optimizer steps, default 3)
Micro-batch i of a step is the same for every layout: a DP rank takes its contiguous share of the step's batches.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from trnrecipes.config.recipe import load_recipe
from trnrecipes.parallel.dims import local_tensor
from trnrecipes.parallel.kv_replication import layouts, stored_full
from trnrecipes.plan.layout import compute_layout
from trnrecipes.train.loop import Trainer


def fixed_steps(trainer: Trainer, default_steps: int) -> list[torch.Tensor]:
    """This DP rank's micro-batches [grad_accum, micro_batch, seq_len + 1] of each of TRAIN_WORKER_STEPS steps: the
    same step batches for every layout (seed 42), a DP rank taking its contiguous share."""
    layout = compute_layout(trainer.recipe)
    micro, seq = trainer.recipe.batch.micro_batch, trainer.recipe.batch.seq_len
    steps = int(os.environ.get("TRAIN_WORKER_STEPS", str(default_steps)))
    per_step = layout.grad_accum * layout.dp
    all_batches = torch.randint(0, 4000, (steps, per_step, micro, seq + 1), generator=torch.Generator().manual_seed(42))
    first = trainer.dims.dp_rank * layout.grad_accum
    return [batches[first : first + layout.grad_accum] for batches in all_batches]


def trainer_for(out: str, name: str, overrides: list[str]) -> Trainer:
    """The world's Trainer of recipe `name`, training into a run dir beside `out`: not runs/<job> of the checkout,
    which another test's world of the same recipe may hold (make test runs two at once)."""
    return Trainer(load_recipe(name, overrides=overrides), run_dir=Path(f"{out}.run"))


def main() -> None:
    out, name, *overrides = sys.argv[1:]
    trainer = trainer_for(out, name, overrides)
    grad_accum = compute_layout(trainer.recipe).grad_accum
    first_grads, norms, losses = {}, [], []
    for step, mine in enumerate(fixed_steps(trainer, 3)):
        losses.append(float(trainer.accumulate(iter(mine), grad_accum)))  # this rank's (DP 1: the step's) mean loss
        norms.append(float(trainer.reduce_and_clip()))
        if step == 0:  # in the stored layout: replicated KV heads once (trnrecipes/parallel/kv_replication.py)
            replicated = layouts(trainer.model)
            first_grads = {
                n: stored_full(p.grad, replicated.get(n)).detach().clone() for n, p in trainer.model.named_parameters()
            }
        trainer.optimizer_step(step)
    params = trainer.full_state_dict()  # a collective under TP: every rank takes part
    if trainer.dims.rank == 0:
        torch.save({"grads": first_grads, "norms": norms, "losses": losses, "params": params}, out)
    # Every rank's own weights too: DP replicas must end up bitwise equal.
    local = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    torch.save(local, f"{out}.rank{trainer.dims.rank}")
    own = {n: local_tensor(p).detach().clone() for n, p in trainer.model.named_parameters()}  # plain: TP shards
    torch.save(own, f"{out}.rank{trainer.dims.rank}.local")
    moments = sum(m.numel() for m in trainer.optimizer.exp_avg + trainer.optimizer.exp_avg_sq)
    params_numel = sum(p.numel() for p in local.values())
    json.dump({"moments": moments, "params": params_numel}, open(f"{out}.rank{trainer.dims.rank}.json", "w"))
    trainer.close()


if __name__ == "__main__":
    main()
