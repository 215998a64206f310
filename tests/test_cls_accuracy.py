"""The tiny classification recipe on the shipped data (Rotten Tomatoes sentences, prepared at `make setup`): trained
from scratch on CPU for its 300 steps (~40 s here), its validation accuracy beats the majority class.

Measured (docs/classification.md): validation accuracy 0.74-0.82 over train.seed 1-5, 0.738 at the recipe's seed
1234 against a majority class of 0.543 there; the test asks for a margin of 0.1 over the majority class of the
very examples validated, inside what every measured seed reached (the smallest margin was 0.195, at seed 1234).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from trnrecipes.config.recipe import load_recipe
from trnrecipes.train.loop import Trainer

pytestmark = pytest.mark.slow


def test_bert_tiny_beats_the_majority_class_on_rotten_tomatoes(tmp_path: Path):
    recipe = load_recipe("bert-tiny", overrides=["cluster.workers_per_node=1", f"run_dir={tmp_path}"])
    trainer = Trainer(recipe)
    try:
        labels = torch.cat([batch[:, -1] for batch in trainer.val_batches])
        majority = float(torch.bincount(labels).max()) / len(labels)
        trainer.run()
    finally:
        trainer.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    final = records[-1]
    print(f"val accuracy {final['val_accuracy']:.3f} on {len(labels)} sentences; majority class {majority:.3f}")
    assert len(labels) == 256 and 0.4 < majority < 0.6  # balanced data, shuffled validation
    assert final["step"] == 300 and final["val_accuracy"] > majority + 0.1
