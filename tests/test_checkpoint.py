"""The checkpoint writer's protocol in one process: each rank fsyncs and hashes its own files and passes the digests
in its marker, rank 0 hashes only what it adds, and every file is read back exactly once per save."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

import trnrecipes.checkpoint.format as checkpoint
from trnrecipes.backends.neuron_xla import NeuronXlaBackend
from trnrecipes.checkpoint import CheckpointError, verify
from trnrecipes.checkpoint.writer import Checkpointer, shard_dims
from trnrecipes.config.recipe import load_recipe


def rank_files(rank: int) -> dict[str, object]:
    return {
        f"model-tp{rank:02d}-of-02.safetensors": {"w": torch.full((8,), float(rank))},
        f"optim-tp{rank:02d}-of-02.safetensors": {"m": torch.full((64,), float(rank))},
        f"rng-rank{rank:04d}.json": {"seed": rank},
    }


def writers(root: Path) -> list[Checkpointer]:
    recipe = load_recipe("llama2-tiny")
    return [
        Checkpointer(root, recipe, None, rank, 2, keep_last=2, async_save=False, log=lambda _: None) for rank in (0, 1)
    ]


def test_each_rank_hashes_its_own_files_and_rank0_never_reads_the_others(tmp_path: Path, monkeypatch):
    reads: Counter[str] = Counter()
    real = checkpoint._sha256

    def counting(path: Path) -> str:
        reads[path.name] += 1
        return real(path)

    monkeypatch.setattr(checkpoint, "_sha256", counting)
    rank0, rank1 = writers(tmp_path)
    files0 = {**rank_files(0), "shards.json": {"tp": 2, "dims": {}}}
    rank1.save(7, rank_files(1))  # rank 1 first: rank 0 waits for every marker before it finalizes
    assert reads == Counter(dict.fromkeys(rank_files(1), 1))  # rank 1 read back its own files, once
    reads.clear()
    rank0.save(7, files0)
    # Rank 0 read back its own files and the recipe it added, never rank 1's shards.
    assert reads == Counter(dict.fromkeys([*files0, "recipe.yaml"], 1))
    out = tmp_path / "step_7"
    manifest = json.loads((out / "manifest.json").read_text())
    assert sorted(manifest["files"]) == sorted([*files0, *rank_files(1), "recipe.yaml"])
    assert not [p.name for p in out.iterdir() if p.name.startswith(".rank-")]  # markers are not part of it
    verify(out)  # the digests the ranks computed are those of the files on disk


def test_a_rank_reporting_a_file_that_is_not_there_fails_the_save(tmp_path: Path):
    rank0, rank1 = writers(tmp_path)
    rank1.save(3, rank_files(1))
    (tmp_path / ".step_3.tmp" / "rng-rank0001.json").unlink()  # lost after rank 1 vouched for it
    with pytest.raises(CheckpointError, match=r"rng-rank0001\.json was reported written but is not there"):
        rank0.save(3, {**rank_files(0), "shards.json": {"tp": 2, "dims": {}}})
    assert not (tmp_path / "step_3").exists()  # nothing half-made is published


def test_shard_dims_come_from_the_parameters_where_nxd_tags_them():
    """NxD marks a sharded parameter with tensor_model_parallel / partition_dim; state_dict() detaches and the copy
    has no such attributes, so reading dims from it recorded every NxD shard as replicated."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
    for p, dim in ((model[0].weight, 0), (model[0].bias, 0), (model[1].weight, 1)):
        p.tensor_model_parallel, p.partition_dim = True, dim
    assert shard_dims(model, NeuronXlaBackend.shard_dim) == {"0.weight": 0, "0.bias": 0, "1.weight": 1, "1.bias": None}


def test_a_recipe_saved_by_the_merged_model_schema_reads_as_todays(tmp_path: Path):
    """Checkpoints written before each family had its own model section list the other family's keys at their
    defaults and num_kv_heads: null; they must still compare equal to the same recipe today (or resume is refused)."""
    import yaml

    from trnrecipes.checkpoint import saved_recipe

    today = load_recipe("llama2-tiny", overrides=["model.num_kv_heads=4"]).to_dict()
    old = {**today, "model": {**today["model"], "num_kv_heads": None, "rotary_pct": 1.0, "parallel_residual": True}}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(old, sort_keys=False))
    assert saved_recipe(tmp_path)["model"] == today["model"]
