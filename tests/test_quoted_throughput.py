"""A quoted throughput stands for the configuration it was measured with: every recipe quoting one records that
configuration (cluster.throughput_config) and plan names each field the recipe trains otherwise; a test fails for
any difference the recipe does not declare (cluster.throughput_differs). Where AWS publishes no throughput for an
instance (trn2/trn3), plan estimates one, labelled as such: the MFU of the closest model's published trn1 run
(cluster.estimate_from) applied to the instance's peak; a measured cluster.tokens_per_s_per_node or --seq-per-s
replaces it."""

from __future__ import annotations

from dataclasses import fields

import pytest
from conftest import run_cli

from trnrecipes.config.recipe import known_recipes, load_recipe
from trnrecipes.config.sections import PublishedConfig, RecipeError
from trnrecipes.plan.layout import plan
from trnrecipes.plan.published import differences

QUOTING = [name for name in known_recipes() if load_recipe(name).cluster.tokens_per_s_per_node is not None]


def test_the_quoting_recipes_are_the_three_with_published_numbers():
    assert sorted(QUOTING) == ["llama2-7b", "llama3.1-70b", "llama3.1-8b"]


@pytest.mark.parametrize("name", QUOTING)
def test_every_quoted_number_records_its_configuration_and_declares_each_difference(name):
    recipe = load_recipe(name)
    published = recipe.cluster.throughput_config
    assert published is not None, f"{name} quotes a throughput without the configuration behind it"
    unrecorded = [f.name for f in fields(PublishedConfig) if getattr(published, f.name) is None]
    assert not unrecorded, f"{name}: record {unrecorded} (or 'not published')"
    assert sorted(k for k, _, _ in differences(recipe)) == sorted(recipe.cluster.throughput_differs)


def test_plan_names_each_difference_and_an_override_adds_one():
    done = run_cli("plan", "--recipe", "llama3.1-8b", "--nodes", "32", "--overrides",
                   "compile.optlevel=1 model.attention=sdpa")  # fmt: skip
    assert done.returncode == 0, done.stderr
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("differs")]
    assert line.endswith(
        "from the source in: sdk 2.26 (source 2.24); attention sdpa (source nki_flash); optlevel 1 (source 2)"
    )
    as_quoted = run_cli("plan", "--recipe", "llama3.1-8b", "--nodes", "32")
    assert "differs      from the source in: sdk 2.26 (source 2.24)\n" in as_quoted.stdout
    same = run_cli("plan", "--recipe", "llama2-7b", "--nodes", "16", "--overrides", "cluster.neuron_sdk=2.21")
    assert "differs      from the source in: sdk 2.21 (source 2.20)" in same.stdout


@pytest.mark.parametrize(
    ("recipe", "nodes", "source"),
    [("llama2-7b-trn2", 16, "llama2-7b"), ("llama3.1-8b-trn2", 16, "llama3.1-8b"),
     ("llama3.1-70b-trn2", 16, "llama3.1-70b"), ("llama2-70b-trn2", 16, "llama3.1-70b")],
)  # fmt: skip
def test_trn2_recipes_get_a_labelled_estimate_at_their_sources_mfu(recipe, nodes, source):
    ours, theirs = plan(load_recipe(recipe, nodes)), plan(load_recipe(source, 32))  # the source at AWS's 32 nodes
    assert ours["throughput_from"] == "an estimate" and ours["throughput_source"].startswith("ESTIMATE")
    assert theirs["throughput_from"] == "cluster.tokens_per_s_per_node"
    assert ours["mfu"] == pytest.approx(theirs["mfu"], rel=1e-9)  # the same share of a bigger peak
    assert ours["run_hours"] > 0 and ours["dollars_per_step"] > 0 and ours["checkpoint_best_every_steps"] > 0


def test_plan_prints_the_estimate_with_time_and_cost_and_a_measurement_replaces_it():
    done = run_cli("plan", "--recipe", "llama2-7b-trn2", "--nodes", "16")
    assert done.returncode == 0, done.stderr
    rows = dict(line.split(None, 1) for line in done.stdout.splitlines() if line and not line.startswith(" "))
    assert "(85,606/node, from an estimate)" in rows["throughput"]
    assert rows["source"].startswith("ESTIMATE, nothing published for trn2.48xlarge: the MFU of llama2-7b's published")
    assert rows["run"].startswith("500,000 steps = ") and "$" in rows["run"] and "$" in rows["cost"]
    measured = run_cli("plan", "--recipe", "llama2-7b-trn2", "--nodes", "16", "--overrides",
                       "cluster.tokens_per_s_per_node=50000")  # fmt: skip
    assert "from cluster.tokens_per_s_per_node" in measured.stdout and "ESTIMATE" not in measured.stdout
    given = run_cli("plan", "--recipe", "llama2-7b-trn2", "--nodes", "16", "--seq-per-s", "100")
    assert "from --seq-per-s" in given.stdout and "ESTIMATE" not in given.stdout


def test_an_estimate_from_a_recipe_with_nothing_published_is_refused():
    with pytest.raises(RecipeError, match=r"cluster\.estimate_from llama2-70b: that recipe states no"):
        plan(load_recipe("llama2-70b-trn2", 16, "cluster.estimate_from=llama2-70b"))
