"""KV heads replicated for TP wider than the KV heads (trnrecipes/parallel/kv_replication.py): the layout arithmetic,
the TP rule and what the recipe check still refuses, TP 2 and 4 over one KV head against TP 1 through the real
Trainer (losses, every gradient, 5 steps, fp32, gloo), and a TP 2 checkpoint, stored unreplicated, resumed at TP 1."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO, rank_launcher

from trnrecipes.checkpoint.format import CheckpointError, consolidate
from trnrecipes.config.recipe import load_recipe
from trnrecipes.config.sections import RecipeError
from trnrecipes.models import build_model
from trnrecipes.parallel.kv_replication import KVReplication

# llama3.1-tiny with 8 query heads over its one KV head (head_dim 8), short sequences: TP 2 and 4 replicate it.
EIGHT_HEADS = ["model.num_heads=8", "batch.seq_len=32", "batch.global_batch=4", "batch.micro_batch=2",
               "optim.clip_grad_norm=1.0", "optim.eps=1e-4", "train.val_every=1000"]  # fmt: skip


@pytest.mark.parametrize(("kv", "tp"), [(1, 2), (1, 4), (2, 4), (2, 8)])
def test_each_rank_holds_its_query_heads_and_its_groups_kv_and_the_stored_layout_comes_back(kv, tp):
    qpk, hd = 8 // kv, 3
    layout = KVReplication(kv_heads=kv, replicas=tp // kv, q_per_kv=qpk, head_dim=hd)
    # stored rows labelled (group, slot): slot < qpk a query head, qpk = k, qpk + 1 = v; each head hd rows
    stored = torch.tensor([[g, slot] for g in range(kv) for slot in range(qpk + 2) for _ in range(hd)])
    locals_ = []
    for rank in range(tp):
        pieces = layout.row_pieces(rank)
        local = torch.cat([stored[s : s + n] for _, s, n in pieces])
        assert [a for a, _, _ in pieces] == [0, layout.local_q_heads * hd] and len(local) == layout.local_rows
        group, j = divmod(rank, tp // kv)
        heads = local.reshape(-1, hd, 2)[:, 0].tolist()
        q = [[group, j * layout.local_q_heads + i] for i in range(layout.local_q_heads)]
        assert heads == [*q, [group, qpk], [group, qpk + 1]]  # its query heads, then its group's k and v
        locals_.append(local)
    assert torch.equal(layout.unreplicate(torch.cat(locals_)), stored)


def test_the_tp_rule_takes_multiples_of_the_kv_heads_and_the_check_says_what_is_not_built_yet():
    for tp in (2, 4):
        assert load_recipe("llama3.1-tiny", overrides=[f"layout.tp={tp}", "cluster.workers_per_node=4"]).layout.tp == tp
    with pytest.raises(RecipeError, match=re.escape("layout.tp 3 must divide model.num_heads 4")):
        load_recipe("llama3.1-tiny", overrides=["layout.tp=3", "cluster.workers_per_node=3"])
    base = "llama2-tiny"  # 4 heads over 2 KV heads: TP 4 replicates, TP 8 has no whole query head per rank
    assert load_recipe(base, overrides=["layout.tp=4", "cluster.workers_per_node=4"]).layout.tp == 4
    refused = {
        "layout.fsdp=true cluster.workers_per_node=4": "not built with layout.fsdp yet",
        "precision.dtype=bf16 precision.stochastic_rounding=true": "not built with precision.stochastic_rounding",
        "cluster.backend=xla": "not on plain torch-xla",
    }
    for extra, message in refused.items():
        with pytest.raises(RecipeError, match=message) as err:
            load_recipe("llama3.1-tiny", overrides=["layout.tp=2", "cluster.workers_per_node=2", *extra.split()])
        assert "layout.tp 2 over model.num_kv_heads 1 replicates each KV head on 2 ranks" in str(err.value)


def _torchrun(tmp_path: Path, tp: int, dp: int = 1, *extra: str) -> dict:
    out = tmp_path / f"tp{tp}-dp{dp}.pt"
    worker = [str(REPO / "tests/train_worker.py"), str(out), "llama3.1-tiny", *EIGHT_HEADS,
              f"cluster.workers_per_node={tp * dp}", f"layout.tp={tp}", *extra]  # fmt: skip
    cmd = [sys.executable, *worker] if tp * dp == 1 else [*rank_launcher(tp * dp), *worker]
    env = {**os.environ, "TRAIN_WORKER_STEPS": "5"}
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return torch.load(out, weights_only=True)


@pytest.mark.slow
def test_tp_2_and_4_over_one_kv_head_equal_tp_1(tmp_path: Path):
    """Losses of 5 steps, every gradient of the first (the replicated k/v rows summed over the ranks sharing them),
    the grad norms (each KV head counted once) and the weights after 5 steps: as TP 1, to fp32 reduction order; at
    TP 2 x DP 2 with ZeRO-1 too (each DP rank updates its rows of the replicated layout)."""
    one = _torchrun(tmp_path, 1)
    qkv = "layers.0.attn.qkv.weight"
    assert one["params"][qkv].shape == ((8 + 2) * 8, 64)
    for tp, dp, extra in ((2, 1, ()), (4, 1, ()), (2, 2, ("layout.zero1=true",))):
        other = _torchrun(tmp_path, tp, dp, *extra)
        if dp == 1:  # the worker records rank 0's loss: under DP its half of the batch's
            assert other["losses"] == pytest.approx(one["losses"], rel=1e-5), tp
        assert other["norms"] == pytest.approx(one["norms"], rel=1e-5), tp
        assert other["grads"].keys() == one["grads"].keys()
        for name, grad in one["grads"].items():
            assert other["grads"][name].shape == grad.shape, name  # the stored layout: no copy of k/v twice
            torch.testing.assert_close(other["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=f"tp {tp}: {name}")
        for name, p in one["params"].items():
            torch.testing.assert_close(other["params"][name], p, rtol=1e-4, atol=1e-5, msg=f"tp {tp}: {name}")
        # the replicas' own copies of the KV head stayed bitwise equal
        ranks = [torch.load(tmp_path / f"tp{tp}-dp{dp}.pt.rank{r}.local", weights_only=True)[qkv] for r in range(tp)]
        kv = [r[-2 * 8 :] for r in ranks]
        assert all(torch.equal(kv[0], k) for k in kv[1:])


def _config(tmp_path: Path, name: str, steps: int, *overrides: str) -> Path:
    recipe = load_recipe("llama3.1-tiny", overrides=[*EIGHT_HEADS, "checkpoint.every_steps=3", *overrides])
    data = recipe.to_dict()
    cfg = tmp_path / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump({**data, "train": {**data["train"], "max_steps": steps}}))
    return cfg


def _train(cfg: Path, nproc: int) -> str:
    launch = rank_launcher(nproc) if nproc > 1 else [sys.executable]
    cmd = [*launch, "-m", "trnrecipes", "train", "--config", str(cfg)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("first", "then"),
    [
        (("layout.tp=2", "cluster.workers_per_node=4", "layout.zero1=true"), ("cluster.workers_per_node=2",)),
        (("cluster.workers_per_node=1",), ("layout.tp=4", "cluster.workers_per_node=4")),
    ],
    ids=["tp2-dp2-zero1-then-tp1-dp2", "tp1-then-tp4"],
)
def test_a_checkpoint_holds_the_unreplicated_tensors_and_resumes_at_another_tp(tmp_path: Path, first, then):
    """3 steps under one layout, 3 more under another (KV heads replicated in one of them): steps 4-6 are the
    straight TP-1 run's with the same DP (each DP rank reads its own part of the data). The checkpoint's tensors have
    TP 1's shape, whatever wrote them."""
    run, straight = tmp_path / "run", tmp_path / "straight"
    allow = "checkpoint.allow_changes=[layout.zero1]"
    nproc = lambda over: int(next(o for o in over if o.startswith("cluster.workers_per_node=")).split("=")[1])  # noqa: E731
    _train(_config(tmp_path, "first", 3, *first, allow, f"run_dir={run}"), nproc(first))
    step_3 = run / "checkpoints/step_3"
    state = consolidate(step_3)
    assert state["layers.0.attn.qkv.weight"].shape == ((8 + 2) * 8, 64)  # one k and one v head, as TP 1 has
    shards = json.loads((step_3 / "shards.json").read_text())
    if "layout.tp=2" in first:  # each rank wrote its rows; shards.json says how they map (readers take k/v once)
        assert shards["kv_replication"]["layers.1.attn.qkv.weight"] == {
            "kv_heads": 1, "replicas": 2, "q_per_kv": 8, "head_dim": 8, "interleaved": False,
        }  # fmt: skip
    out = _train(_config(tmp_path, "then", 6, *then, allow, f"run_dir={run}"), nproc(then))
    assert "resuming from" in out and "(step 3)" in out
    dp = nproc(then) // (4 if "layout.tp=4" in then else 1)
    _train(_config(tmp_path, "straight", 6, f"cluster.workers_per_node={dp}", f"run_dir={straight}"), dp)
    resumed, want = _losses(run), _losses(straight)
    assert sorted(resumed) == list(range(1, 7))
    for step in (4, 5, 6):  # the continuation under the other layout is the TP 1 run
        assert resumed[step] == pytest.approx(want[step], rel=1e-4), step


# -- checkpoint files that hold each rank's rows, read back as the stored tensor -------------------------------------


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dp", [1, 2])
def test_readers_assemble_the_stored_tensor_from_each_ranks_rows(tmp_path: Path, interleaved, dp):
    """Files as a TP-4 save writes them (each rank's [q slice | k | v] rows, under ZeRO-1 a DP slice of those) with
    shards.json's description: ShardReader reads any region of the stored tensor, consolidate the whole."""
    from safetensors.torch import save_file

    from trnrecipes.checkpoint.format import ShardReader, shard_file
    from trnrecipes.parallel.kv_replication import describe
    from trnrecipes.parallel.sharding import chunk_range

    layout = KVReplication(kv_heads=2, replicas=2, q_per_kv=4, head_dim=2, interleaved=interleaved)
    stored = torch.randn(layout.stored_rows, 3)
    for t in range(4):
        local = torch.cat([stored[s : s + n] for _, s, n in layout.row_pieces(t)])
        save_file({"w": local.clone()}, tmp_path / shard_file("model", t, 4))
        for d in range(dp):
            a, b = chunk_range(len(local), dp, d)
            save_file({"exp_avg.w": local[a:b].clone()}, tmp_path / shard_file("optim", t, 4, d, dp))
    shards = {"tp": 4, "pp": 1, "optim_dp": dp, "dims": {"w": 0}, "kv_replication": describe({"w": layout})}
    (tmp_path / "shards.json").write_text(json.dumps(shards))
    assert torch.equal(consolidate(tmp_path)["w"], stored)
    reader = ShardReader(tmp_path, "optim")
    whole, part = torch.empty_like(stored), torch.empty(7, 2)
    reader.read_into("exp_avg.w", whole, tuple(stored.shape), (0, 0))
    reader.read_into("exp_avg.w", part, tuple(stored.shape), (5, 1))  # across a group's q and k/v rows
    assert torch.equal(whole, stored) and torch.equal(part, stored[5:12, 1:3])
    shards["kv_replication"]["w"]["replicas"] = 3  # a description that does not fit is refused by name
    (tmp_path / "shards.json").write_text(json.dumps(shards))
    with pytest.raises(CheckpointError, match="kv_replication of w"):
        ShardReader(tmp_path, "optim")


# -- NxD (trn1): its GQA QKV layer, against the stand-in of tests/test_neuron_parallel.py -----------------------------

GQA = ["model.num_heads=8", "model.num_kv_heads=2"]  # TP 4: each KV head on 2 ranks, 2 query heads per rank


def _nxd_rank(monkeypatch, recipe, rank: int, weights=None):
    from test_neuron_parallel import install_fake_nxd, stand_in_dims

    from trnrecipes.backends.neuron_xla import NeuronXlaBackend
    from trnrecipes.train.build import build_model_shard

    built = install_fake_nxd(monkeypatch, tp=4, rank=rank)
    backend = NeuronXlaBackend("neuron", torch.device("cpu"))
    model = build_model_shard(recipe, dims=stand_in_dims(tp=4, tp_rank=rank), backend=backend, weights=weights)
    return model, built


def test_nxd_ranks_hold_the_heads_aws_converter_gives_them_and_together_compute_the_full_attention(monkeypatch):
    """Rank t holds KV head t % kv, query heads block (t % kv) * r + t // kv and the o_proj columns of that block
    (neuronx-distributed 2.29's checkpoint_converter.py for trn1), drawn from the TP-1 init, under the plain parameter
    names, the fused weight tagged as NxD's split weights are; the ranks' attention outputs (each its o_proj's
    partial sum) add up to the full model's."""
    from recipes.llama2.hf import state_dict_to_hf

    recipe = load_recipe("llama3.1-tiny", overrides=GQA)
    full = build_model(recipe.model)
    full.init_weights(seed=recipe.train.seed)
    hf = state_dict_to_hf(full.state_dict(), recipe.model)
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(0))
    hd, n, kv, r = 8, 2, 2, 2
    total = torch.zeros(2, 16, 64)
    for rank in range(4):
        model, built = _nxd_rank(monkeypatch, recipe, rank)
        (gqa, *_) = [b for b in built if b["layer"] == "GQAQKVColumnParallelLinear"]
        assert (gqa["output_sizes"], gqa["kv_size_multiplier"], gqa["fuse_qkv"]) == ([64, 16], 2, True)
        assert gqa["bias"] is False and gqa["gather_output"] is False
        assert gqa["init_method"].__name__ == "_keep_uninitialized"
        names = dict(model.named_parameters())
        assert not any("weight_qkv" in name for name in names)
        qkv, out = names["layers.0.attn.qkv.weight"], names["layers.0.attn.out.weight"]
        assert qkv.tensor_model_parallel and qkv.partition_dim == 0  # the adapter tags what NxD left untagged
        block, group = (rank % kv) * r + rank // kv, rank % kv
        q = hf["model.layers.0.self_attn.q_proj.weight"][block * n * hd : (block + 1) * n * hd]
        k = hf["model.layers.0.self_attn.k_proj.weight"][group * hd : (group + 1) * hd]
        v = hf["model.layers.0.self_attn.v_proj.weight"][group * hd : (group + 1) * hd]
        assert torch.equal(qkv.detach(), torch.cat([q, k, v]))
        o = hf["model.layers.0.self_attn.o_proj.weight"][:, block * n * hd : (block + 1) * n * hd]
        assert torch.equal(out.detach(), o)
        with torch.no_grad():
            total += model.layers[0].attn(x)  # this rank's partial sum (the stand-in's row-parallel linear)
    with torch.no_grad():
        torch.testing.assert_close(total, full.layers[0].attn(x), rtol=1e-5, atol=1e-6)


def test_nxd_refuses_kv_groups_other_than_the_tiled_order(monkeypatch):
    import sys

    recipe = load_recipe("llama3.1-tiny", overrides=GQA)
    from test_neuron_parallel import install_fake_nxd, stand_in_dims

    from trnrecipes.backends.neuron_xla import NeuronXlaBackend
    from trnrecipes.train.build import build_model_shard

    install_fake_nxd(monkeypatch, tp=4, rank=0)
    state = sys.modules["neuronx_distributed.parallel_layers.parallel_state"]
    monkeypatch.setattr(state, "get_kv_shared_group", lambda as_list=False: [[0, 1], [2, 3]])  # consecutive: trn2's
    with pytest.raises(RuntimeError, match=re.escape("shares KV heads among TP ranks [[0, 1], [2, 3]]")):
        build_model_shard(recipe, dims=stand_in_dims(tp=4), backend=NeuronXlaBackend("neuron", torch.device("cpu")))


def test_nxd_ranks_read_their_rows_from_a_tp1_checkpoint_and_their_files_read_back(monkeypatch, tmp_path: Path):
    """A TP-1 checkpoint read by the four NxD ranks; their own tensors, written as each rank's file with shards.json
    as the writer describes them (kv_replication, tp_blocks), consolidate back into the TP-1 tensors."""
    from safetensors.torch import save_file

    from trnrecipes.checkpoint import write_model_checkpoint
    from trnrecipes.checkpoint.format import shard_file
    from trnrecipes.parallel.kv_replication import describe, layouts, tp_block

    recipe = load_recipe("llama3.1-tiny", overrides=GQA)
    saved = build_model(recipe.model)
    saved.init_weights(seed=recipe.train.seed + 1)
    ckpt = write_model_checkpoint(tmp_path / "ckpt", saved.state_dict(), recipe)
    names = ("layers.1.attn.qkv.weight", "layers.1.attn.out.weight")
    out = tmp_path / "nxd"
    out.mkdir()
    for rank in range(4):
        model, _ = _nxd_rank(monkeypatch, recipe, rank, weights=ckpt)
        save_file({k: model.get_parameter(k).detach().clone() for k in names}, out / shard_file("model", rank, 4))
    shards = {"tp": 4, "pp": 1, "dims": {names[0]: 0, names[1]: 1}, "kv_replication": describe(layouts(model))}
    shards |= {"tp_blocks": tp_block(model)}
    assert shards["tp_blocks"]["layers.1.attn.out.weight"] == [0, 2, 1, 3]
    shards["kv_replication"] = {k: v for k, v in shards["kv_replication"].items() if k in names}
    shards["tp_blocks"] = {k: v for k, v in shards["tp_blocks"].items() if k in names}
    (out / "shards.json").write_text(json.dumps(shards))
    back = consolidate(out)
    for name in names:
        assert torch.equal(back[name], saved.get_parameter(name).detach()), name
