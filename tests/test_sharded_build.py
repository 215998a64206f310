"""Sharded construction: the same seed gives the same full model whatever the layout, a rank materialises only its
shard (no op on it ever makes a full sharded parameter), and weights are read slice by slice from a checkpoint of any
TP layout. Real torch.distributed (gloo, 2 processes) for the DTensor path; the region math directly for TP 4."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import REPO, rank_launcher

import recipes.common.init as init_module
from recipes.common.init import fill_region, init_full
from trnrecipes.checkpoint import ShardReader, write_model_checkpoint
from trnrecipes.config.recipe import load_recipe
from trnrecipes.models import build_model
from trnrecipes.parallel.sharding import chunk_range, shard_region

TP2 = ["cluster.workers_per_node=2", "layout.tp=2"]


def _full_model(name: str, seed: int, *overrides: str) -> dict[str, torch.Tensor]:
    model = build_model(load_recipe(name, overrides=list(overrides)).model)
    model.init_weights(seed=seed)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_chunk_ranges_split_like_torch_chunk():
    for n in (0, 1, 5, 7, 8, 96):
        for parts in (1, 2, 3, 4, 8):
            pieces = torch.arange(n).chunk(parts) if n else ()
            got = [chunk_range(n, parts, i) for i in range(parts)]
            want = [(int(p[0]), int(p[-1]) + 1) for p in pieces if p.numel()]
            assert [r for r in got if r[1] > r[0]] == want, (n, parts)
            assert sum(b - a for a, b in got) == n
    with pytest.raises(ValueError, match="part 2 of 2"):
        chunk_range(4, 2, 2)


@pytest.mark.parametrize("name", ["pythia-tiny", "llama2-tiny"])
def test_init_gives_the_same_full_model_for_tp_1_2_4_along_any_dim(monkeypatch, name):
    """Each parameter filled shard by shard (rows or columns, TP 2 and 4, ZeRO-1 row slices under TP 2) equals the
    whole-model init bitwise; small blocks make shards start and end inside blocks."""
    monkeypatch.setattr(init_module, "BLOCK_ELEMENTS", 300)
    overrides = ["model.vocab_size=512"]  # keeps the loop over every split short
    model = build_model(load_recipe(name, overrides=overrides).model)
    init_full(model, model.init_rules(), seed=7)
    rules = model.init_rules()
    for pname, full in model.named_parameters():
        dims = [None, 0] + ([1] if full.dim() == 2 else [])
        for dim in dims:
            for tp, dp in ((2, 1), (4, 1), (2, 3)):
                out = torch.empty_like(full)
                for t in range(tp):
                    for d in range(dp):
                        region = shard_region(tuple(full.shape), dim, tp, t, dp, d)
                        if region.numel == 0:
                            continue
                        part = torch.empty(region.size)
                        fill_region(part, tuple(full.shape), region.start, rules[pname], 7, pname)
                        out[tuple(slice(a, a + s) for a, s in zip(region.start, region.size, strict=True))] = part
                assert torch.equal(out, full.detach()), (pname, dim, tp, dp)
    other = build_model(load_recipe(name, overrides=overrides).model)
    init_full(other, rules, seed=8)
    assert not torch.equal(other.embed.weight, model.embed.weight)  # the seed matters


def test_init_follows_the_family_rules():
    model = build_model(load_recipe("pythia-tiny").model)
    model.init_weights(seed=0)
    rules = model.init_rules()
    for name, p in model.named_parameters():
        rule = rules[name]
        if rule.kind == "normal":
            assert abs(p.std().item() - rule.std) < 0.1 * rule.std, name
        else:
            assert torch.all(p == (1.0 if rule.kind == "ones" else 0.0)), name
    assert {r.kind for r in rules.values()} == {"normal", "ones", "zeros"}


def _build(tmp_path: Path, name: str, weights: str, overrides: list[str]) -> tuple[dict, list[dict]]:
    out = tmp_path / f"{name}-{weights != '-'}.pt"
    cmd = [*rank_launcher(2), str(REPO / "tests/build_worker.py"), str(out), weights, name,
           *overrides]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    reports = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in (0, 1)]
    return torch.load(out, weights_only=True), reports


@pytest.mark.parametrize("name", ["pythia-tiny", "llama2-tiny"])
def test_a_tp2_rank_builds_and_loads_only_its_shard(monkeypatch, tmp_path: Path, name: str):
    """Under TP 2 (real DTensor, gloo): the gathered weights are the TP-1 init bitwise, and after that the weights of
    a checkpoint; on each rank no op made a full sharded parameter, and nothing larger than its largest shard."""
    monkeypatch.setattr(init_module, "BLOCK_ELEMENTS", 256)  # as the worker: the block size is part of the init
    built, reports = _build(tmp_path, name, "-", TP2)
    expected = _full_model(name, load_recipe(name).train.seed)
    assert built.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(built[key], value), key
    ckpt_weights = _full_model(name, 99)  # another seed: these values can only come from the checkpoint
    write_model_checkpoint(tmp_path / "ckpt", ckpt_weights, load_recipe(name))
    loaded, load_reports = _build(tmp_path, name, str(tmp_path / "ckpt"), TP2)
    for key, value in ckpt_weights.items():
        assert torch.equal(loaded[key], value), key
    for report in reports + load_reports:
        assert "embed.weight" in report["sharded"] and len(report["sharded"]) > 4
        assert report["full_shapes_made"] == [], report
        assert report["largest"] <= report["largest_local"], report


def test_the_shard_reader_refuses_weights_of_another_shape(tmp_path: Path):
    weights = _full_model("llama2-tiny", 0)
    write_model_checkpoint(tmp_path / "ckpt", weights, load_recipe("llama2-tiny"))
    reader = ShardReader(tmp_path / "ckpt", "model")
    full = tuple(weights["embed.weight"].shape)
    bigger = (full[0] * 2, full[1])
    with pytest.raises(Exception, match="do not fit this recipe's model"):
        reader.read_into("embed.weight", torch.empty(bigger), bigger, (0, 0))
    part = torch.empty(full[0] // 2, full[1])
    reader.read_into("embed.weight", part, full, (full[0] // 2, 0))
    assert torch.equal(part, weights["embed.weight"][full[0] // 2 :])
