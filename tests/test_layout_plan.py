"""Layout math, plan numbers against FACTS.md, and the torch-free rendering path."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from trnrecipes.config.recipe import check_recipe, load_recipe
from trnrecipes.config.sections import RecipeError
from trnrecipes.config.stages import BUBBLE_WARNING
from trnrecipes.plan.layout import compute_layout, plan, valid_node_counts


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
    assert "valid node counts for this batch: 1, 2, 4, 8, 16, 32, 64" in text  # 128: 2 micro-batches, 4 stages
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
    assert valid_node_counts(r) == [2, 4]  # 8 nodes: DP 4 leaves 1 micro-batch for 2 stages of 1F1B
    # not cut at 128 nodes: Llama-2-7B's 1024 sequences of one run on 256 (DP 1024 x micro-batch 1)
    big = load_recipe("llama2-7b", nodes=1000)
    with pytest.raises(RecipeError, match=r"valid node counts for this batch: 1, 2, 4, .*, 128, 256; valid global"):
        compute_layout(big)


def test_seed_table_1_tokens_per_dollar():
    # 10.4 seq/s x 2048 x 3600 / $7.59 = 10,102,387 tokens/$ (the NeoX/Pythia on Trainium post, Table 1).
    p = plan(load_recipe("pythia6.9b", nodes=1), seq_per_s=10.4, price_per_hour=7.59)
    assert round(p["tokens_per_dollar"]) == 10_102_387
    assert p["tokens_per_s"] == pytest.approx(10.4 * 2048)


def test_llama2_7b_on_16_nodes_is_40_percent_mfu():
    # FACTS.md: 101.3 seq/s on 16 x trn1.32xlarge = 25.9k tokens/s/node ~ 40% MFU.
    p = plan(load_recipe("llama2-7b", nodes=16), seq_per_s=101.3)
    assert p["tokens_per_s_per_node"] == pytest.approx(25_900, rel=0.002)
    assert p["mfu"] == pytest.approx(0.40, abs=0.005)
    assert p["flops_per_token"] == 6 * 6_738_415_616 + 12 * 32 * 32 * 128 * 4096


def test_mfu_counts_only_the_devices_the_workers_use():
    # FACTS.md: one worker on a p5.48xlarge (1 of 8 H100s) at 23.6% MFU showed 2.95% against the whole node's peak.
    over = ["cluster.instance=p5.48xlarge", "cluster.backend=cuda", "layout.tp=1", "batch.global_batch=32"]
    one = plan(load_recipe("llama2-tiny", nodes=2, overrides=[*over, "cluster.workers_per_node=1"]), seq_per_s=4.0)
    full = plan(load_recipe("llama2-tiny", nodes=2, overrides=over), seq_per_s=4.0)
    assert one["peak_tflops"] == pytest.approx(2 * 989.0) and full["peak_tflops"] == pytest.approx(2 * 8 * 989.0)
    assert one["mfu"] == pytest.approx(8 * full["mfu"])
    assert one["mfu"] == pytest.approx(one["flops_per_token"] * 4.0 * one["seq_len"] / (2 * 989e12))
    assert one["price_per_hour"] == full["price_per_hour"]  # the whole node is paid for either way


def test_the_peak_line_says_a_cpu_figure_as_it_is_and_an_accelerators_in_bf16():
    from trnrecipes.plan.report import format_plan

    cpu = format_plan(plan(load_recipe("pythia-tiny", nodes=1)))
    assert "peak         0.19 TFLOPS (a nominal figure for these CPU cores" in cpu  # was '0 BF16 TFLOPS'
    assert "peak         12,160 BF16 TFLOPS;" in format_plan(plan(load_recipe("llama2-7b", nodes=4)))


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
    args = ["--recipe", "neox20b", "--nodes", "4", "--no-data-check"]
    args += ["--out", str(tmp_path / "job"), "--overrides", "run_dir=/fsx/runs/n20"] if verb == "sbatch" else []
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "trnrecipes", verb, *args], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    imported = {line.split("|")[-1].strip().split(".")[0] for line in done.stderr.splitlines() if "|" in line}
    assert "yaml" in imported and ("jinja2" in imported) is (verb == "sbatch")  # the probe sees real imports
    assert not imported & {"torch", "numpy", "transformers"}


def test_node_counts_that_starve_the_pipeline_schedule_are_refused_and_not_listed():
    r = load_recipe("neox20b")
    assert 128 not in valid_node_counts(r)  # DP 128 leaves 2 micro-batches for 4 stages of 1F1B
    with pytest.raises(RecipeError, match=r"1f1b needs at least as many micro-batches.*valid node counts: 1, 2, 4"):
        compute_layout(load_recipe("neox20b", nodes=128))
    # neox-tiny at PP 2 (2 workers a node, GBS 8 of micro-batch 2): 4 nodes = DP 4 leave 1 micro-batch per step
    tiny = load_recipe("neox-tiny", overrides="layout.pp=2")
    assert 4 not in valid_node_counts(tiny)
    gpipe = load_recipe("neox-tiny", nodes=4, overrides="layout.pp=2 layout.pp_schedule=gpipe")
    assert 4 in valid_node_counts(gpipe) and compute_layout(gpipe).grad_accum == 1


def test_neuron_pipelines_need_nxds_manual_partition_sdk_and_its_1f1b_schedule():
    with pytest.raises(RecipeError, match=r"layout.pp_schedule 'gpipe': neuronx-distributed's manual pipeline"):
        load_recipe("neox20b", overrides="layout.pp_schedule=gpipe")
    with pytest.raises(RecipeError, match=r"needs Neuron SDK 2.22 or newer; cluster.neuron_sdk is '2.21'"):
        load_recipe("neox20b", overrides="cluster.neuron_sdk=2.21")


@pytest.mark.parametrize(("name", "nodes"), [("neox20b", 4), ("llama2-70b", 8), ("neox20b", 8)])
def test_pipeline_stages_hold_every_parameter_once(name, nodes):
    p = plan(load_recipe(name, nodes=nodes))
    stages = p["pp_stages"]
    assert len(stages) == p["pp"] and [s["pp_rank"] for s in stages] == list(range(p["pp"]))
    assert sum(s["params"] for s in stages) == p["params"]
    assert [s["embedding"] for s in stages].count(True) == 1 and stages[0]["embedding"]
    assert [s["norm_head"] for s in stages].count(True) == 1 and stages[-1]["norm_head"]
    layers = [i for s in stages for i in range(s["first_layer"], s["last_layer"] + 1)]
    assert layers == list(range(load_recipe(name).model.num_layers))
    assert all(s["params_per_core_approx"] == s["params"] // p["tp"] for s in stages)
    assert p["pp_micro_batches"] == p["grad_accum"] and p["pp_schedule"] == "1f1b" and p["pp_virtual_stages"] == 1


def test_neox20b_pipeline_on_4_nodes_and_with_the_seed_batch_of_16384():
    p = plan(load_recipe("neox20b", nodes=4))
    assert [(s["first_layer"], s["last_layer"]) for s in p["pp_stages"]] == [(0, 10), (11, 21), (22, 32), (33, 43)]
    m = load_recipe("neox20b").model
    assert p["pp_stages"][1]["params"] == 11 * m.layer_params()
    assert p["pp_stages"][0]["params"] == 11 * m.layer_params() + m.embedding_params()
    assert p["pp_stages"][3]["params"] == 11 * m.layer_params() + m.norm_head_params()
    assert p["pp_bubble_fraction"] == 3 / 64 and p["pp_bubble_warning"] is None
    big = plan(load_recipe("neox20b", nodes=4, overrides="batch.global_batch=16384"))
    assert big["pp_micro_batches"] == 4096 and big["pp_bubble_fraction"] == 3 / 4096


def test_a_bubble_over_10_percent_is_warned_about():
    p = plan(load_recipe("neox20b", nodes=16))  # 256 / DP 16 = 16 micro-batches: 3/16
    assert p["pp_bubble_fraction"] == 3 / 16 > BUBBLE_WARNING
    assert "pipeline bubble 18.75% is over 10%: 16 micro-batches per pipeline for PP 4" in p["pp_bubble_warning"]
    assert plan(load_recipe("neox20b", nodes=8))["pp_bubble_warning"] is None  # 3/32 = 9.4%
    # NxD (neuron) has no interleaved schedule: the same layout on 32-worker cpu nodes
    cpu = "cluster.instance=local-cpu cluster.backend=cpu cluster.workers_per_node=32"
    interleaved = f"layout.pp_schedule=interleaved_1f1b layout.pp_virtual_stages=2 {cpu}"
    p = plan(load_recipe("neox20b", nodes=16, overrides=interleaved))
    assert p["pp_bubble_fraction"] == 3 / 32 and p["pp_bubble_warning"] is None
    assert len(p["pp_stages"]) == 8 and [s["pp_rank"] for s in p["pp_stages"]] == [0, 1, 2, 3] * 2
    assert sum(s["params"] for s in p["pp_stages"]) == p["params"]


def test_plan_without_a_pipeline_has_no_pipeline_keys():
    assert not any(k.startswith("pp_") for k in plan(load_recipe("llama2-7b", nodes=16)))


def test_plan_and_sbatch_print_the_same_pipeline_summary(cli, tmp_path):
    done = cli(
        "plan", "--recipe", "neox20b", "--nodes", "16", "--no-data-check", "--overrides", "run_dir=/fsx/runs/n20"
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert (
        "pipeline     1f1b, 4 stages on PP 4 (1 per rank), 16 micro-batches per pipeline per step (grad-accum)" in lines
    )
    assert "bubble       18.75% of the ideal step time: (PP - 1) / (v x m) = 3/(1 x 16)" in lines
    assert any(line.startswith("warning      pipeline bubble 18.75% is over 10%") for line in lines)
    assert any(line.split()[:5] == ["0", "0", "0-10", "(11)", "embedding"] for line in lines)
    assert any(line.split()[:6] == ["3", "3", "33-43", "(11)", "norm,", "head"] for line in lines)
    rendered = cli("sbatch", "--recipe", "neox20b", "--nodes", "16", "--no-data-check", "--out", str(tmp_path / "job"),
                   "--overrides", "run_dir=/fsx/runs/n20")  # fmt: skip
    assert rendered.returncode == 0, rendered.stderr
    assert rendered.stdout.startswith(done.stdout)  # the same lines, then what it wrote
    plain = cli("plan", "--recipe", "llama2-7b", "--nodes", "16")
    assert "pipeline" not in plain.stdout and "bubble" not in plain.stdout


def _with_stage_layers(layers: tuple[int, ...], pp: int = 2):
    r = load_recipe("neox-tiny")
    return dataclasses.replace(r, layout=dataclasses.replace(r.layout, pp=pp, pp_stage_layers=layers))


def test_stage_layer_lists_of_the_wrong_length_or_sum_are_refused_naming_the_field():
    layers = load_recipe("neox-tiny").model.num_layers
    assert check_recipe(_with_stage_layers((1, layers - 1))) == []
    (problem,) = check_recipe(_with_stage_layers((1, 1, layers - 2)))
    assert problem == "layout.pp_stage_layers lists 3 stage(s), but layout.pp x layout.pp_virtual_stages = 2"
    (problem,) = check_recipe(_with_stage_layers((1, layers)))
    assert problem == f"layout.pp_stage_layers [1, {layers}] sums to {layers + 1}, not model.num_layers {layers}"


def test_a_stage_layer_list_splits_the_plan_as_given():
    r = _with_stage_layers((0, 2))  # neox-tiny: 2 layers; stage 0 holds only the embedding
    p = plan(r)
    first, last = p["pp_stages"]
    assert (first["first_layer"], first["num_layers"], first["params"]) == (None, 0, r.model.embedding_params())
    assert (last["first_layer"], last["last_layer"]) == (0, 1)
    assert sum(s["params"] for s in p["pp_stages"]) == p["params"]


def test_stage_layer_lists_load_from_a_recipe_and_a_wrong_one_is_refused_naming_the_field():
    r = load_recipe("neox-tiny", nodes=2, overrides="layout.pp=2 layout.pp_stage_layers=[0,2]")
    assert r.layout.pp_stage_layers == (0, 2)
    with pytest.raises(RecipeError, match=r"layout.pp_stage_layers \[1, 2\] sums to 3, not model.num_layers 2"):
        load_recipe("neox-tiny", nodes=2, overrides="layout.pp=2 layout.pp_stage_layers=[1,2]")
