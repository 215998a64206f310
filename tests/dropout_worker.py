"""Run under tests/ranks.py by tests/test_dropout_seed.py: one optimizer step of a bert recipe through
Trainer.train_step on the same fixed micro-batches on every rank, saving each rank's dropout masks (where a dropout's
output is zero and its input was not) of the embedding and of layer 0's MLP output to OUT.rankN.

    python tests/dropout_worker.py OUT RECIPE [k=v ...]
"""

from __future__ import annotations

import sys

import torch

from trnrecipes.config.recipe import load_recipe
from trnrecipes.plan.layout import compute_layout
from trnrecipes.train.loop import Trainer

WATCHED = ("embed.dropout", "layers.0.mlp.dropout")


def main() -> None:
    out, name, *overrides = sys.argv[1:]
    trainer = Trainer(load_recipe(name, overrides=overrides))
    masks: dict[str, list[torch.Tensor]] = {n: [] for n in WATCHED}
    for n in WATCHED:
        trainer.model.get_submodule(n).register_forward_hook(
            lambda _m, inputs, output, n=n: masks[n].append((output == 0) & (inputs[0] != 0))
        )
    b, accum = trainer.recipe.batch, compute_layout(trainer.recipe).grad_accum
    tokens = torch.randint(
        1000, 2000, (accum, b.micro_batch, b.seq_len + 1), generator=torch.Generator().manual_seed(0)
    )
    tokens[..., -1] %= 2  # the label column: class 0 or 1
    trainer.train_step(0, iter(tokens), accum)
    torch.save({n: torch.stack(m) for n, m in masks.items()}, f"{out}.rank{trainer.dims.rank}")
    trainer.close()


if __name__ == "__main__":
    main()
