"""Layout math, plan numbers against FACTS.md, and the torch-free rendering path."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from trnrecipes.layout import compute_layout, plan, valid_node_counts
from trnrecipes.recipe import RecipeError, load_recipe


@pytest.mark.parametrize(
    ("name", "nodes", "world", "dp", "grad_accum"),
    [
        ("neox20b", 1, 32, 1, 256),
        ("neox20b", 4, 128, 4, 64),
        ("neox20b", 64, 2048, 64, 4),
        ("pythia6.9b", 1, 32, 4, 64),
        ("llama2-7b", 16, 512, 64, 16),
        ("neox-tiny", 2, 4, 4, 1),
    ],
)
def test_world_dp_and_grad_accum(name, nodes, world, dp, grad_accum):
    layout = compute_layout(load_recipe(name, nodes=nodes))
    assert (layout.world_size, layout.dp, layout.grad_accum) == (world, dp, grad_accum)
    assert layout.micro_batch * layout.grad_accum * layout.dp == layout.global_batch


def test_neox20b_on_3_nodes_fails_and_suggests_node_counts_and_batches():
    with pytest.raises(RecipeError) as err:
        compute_layout(load_recipe("neox20b", nodes=3))
    text = str(err.value)
    assert "global_batch 256 is not divisible by micro_batch 1 x data-parallel 3" in text
    assert "valid node counts for this batch: 1, 2, 4, 8, 16, 32, 64, 128" in text
    assert "valid global batches near 256 at 3 node(s): 255, 258" in text


def test_the_seed_table_batch_of_16384_runs_on_4_to_64_nodes():
    for nodes in (4, 8, 16, 32, 64):
        layout = compute_layout(load_recipe("neox20b", nodes=nodes, overrides="batch.global_batch=16384"))
        assert layout.grad_accum == 16384 // nodes


def test_tp_must_fit_inside_a_node():
    with pytest.raises(RecipeError, match=r"layout\.tp 4 must divide the 2 workers of one local-cpu node"):
        compute_layout(load_recipe("pythia-tiny", nodes=1, overrides="layout.tp=4"))


def test_worlds_not_divisible_by_tp_times_pp_list_valid_node_counts():
    r = load_recipe("neox-tiny", nodes=1, overrides="layout.pp=2 cluster.workers_per_node=1")
    with pytest.raises(RecipeError, match=r"1 node\(s\) x 1 workers = 1 workers is not divisible by tp 1 x pp 2"):
        compute_layout(r)
    assert valid_node_counts(r)[:3] == [2, 4, 8]


def test_seed_table_1_tokens_per_dollar():
    # 10.4 seq/s x 2048 x 3600 / $7.59 = 10,102,387 tokens/$ (seed 004, Table 1).
    p = plan(load_recipe("pythia6.9b", nodes=1), seq_per_s=10.4, price_per_hour=7.59)
    assert round(p["tokens_per_dollar"]) == 10_102_387
    assert p["tokens_per_s"] == pytest.approx(10.4 * 2048)


def test_llama2_7b_on_16_nodes_is_40_percent_mfu():
    # FACTS.md: 101.3 seq/s on 16 x trn1.32xlarge = 25.9k tokens/s/node ~ 40% MFU.
    p = plan(load_recipe("llama2-7b", nodes=16), seq_per_s=101.3)
    assert p["tokens_per_s_per_node"] == pytest.approx(25_900, rel=0.002)
    assert p["mfu"] == pytest.approx(0.40, abs=0.005)
    assert p["flops_per_token"] == 6 * 6_738_415_616 + 12 * 32 * 32 * 128 * 4096


def test_price_per_step_uses_every_node():
    p = plan(load_recipe("neox20b", nodes=4), seq_per_s=2.0)
    assert p["price_per_hour"] == 4 * 21.50
    assert p["dollars_per_step"] == pytest.approx(4 * 21.50 * (256 / 2.0) / 3600)


def test_plan_json_from_the_cli_has_the_documented_keys(cli):
    done = cli("plan", "--recipe", "pythia6.9b", "--nodes", "1", "--seq-per-s", "10.4", "--price", "7.59", "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    keys = "world_size tp pp dp micro_batch grad_accum global_batch seq_len params flops_per_token"
    assert set(keys.split()) | {"tokens_per_s", "mfu", "tokens_per_dollar"} <= set(data)
    assert (data["params"], round(data["tokens_per_dollar"])) == (6_857_302_016, 10_102_387)


@pytest.mark.parametrize("verb", ["plan", "sbatch"])
def test_rendering_path_never_imports_torch(verb, tmp_path):
    args = ["--recipe", "neox20b", "--nodes", "4"] + (["--out", str(tmp_path / "job")] if verb == "sbatch" else [])
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "trnrecipes", verb, *args], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    imported = {line.split("|")[-1].strip().split(".")[0] for line in done.stderr.splitlines() if "|" in line}
    assert "yaml" in imported and ("jinja2" in imported) is (verb == "sbatch")  # the probe sees real imports
    assert not imported & {"torch", "numpy", "transformers"}
