"""The model-family contract (recipes/<family>/spec.py), checked for every family in the registry: what a new
family must pass (recipes/README.md)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing

import pytest
from conftest import REPO

from trnrecipes.config.families import FAMILIES, family_of_hf_config
from trnrecipes.config.recipe import known_recipes, load_recipe, recipe_from_dict
from trnrecipes.config.sections import RecipeError

NAMES = sorted(FAMILIES)


def tiny(name: str):
    return load_recipe(f"{name}-tiny")


def field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


@pytest.mark.parametrize("name", NAMES)
def test_family_has_a_tiny_recipe_and_its_config_is_tagged_by_name(name):
    assert f"{name}-tiny" in known_recipes()
    spec = FAMILIES[name]
    assert spec.name == name and field_names(spec.config)[0] == "family"
    assert typing.get_type_hints(spec.config)["family"] == typing.Literal[name]
    assert type(tiny(name).model) is spec.config


@pytest.mark.parametrize("name", NAMES)
def test_spec_param_count_equals_the_model_built_on_the_meta_device(name):
    from trnrecipes.models import build_model

    for recipe in [r for r in known_recipes() if load_recipe(r).model.family == name]:
        cfg = load_recipe(recipe).model
        model = build_model(cfg, "meta")
        assert model.args is cfg  # the model section is the model's arguments: one definition of the fields
        assert model.num_params() == cfg.param_count(), recipe
        # At least 6 FLOPs per block parameter per token (the decoders also count their embedding; bert does not)
        assert cfg.flops_per_token(cfg.max_seq_len) > 6 * cfg.num_layers * cfg.layer_params()


@pytest.mark.parametrize("name", NAMES)
def test_spec_part_counts_equal_the_models_parts_on_the_meta_device(name):
    """What `plan` sums per pipeline stage: the embedding, each layer, the final norm and head."""
    from trnrecipes.models import build_model

    cfg = tiny(name).model
    model = build_model(cfg, "meta")
    parts = FAMILIES[name].parts

    def count(*modules) -> int:
        return sum(p.numel() for m in modules for p in m.parameters())

    assert count(getattr(model, parts.embedding)) == cfg.embedding_params()
    layers = getattr(model, parts.layers)
    assert len(layers) == cfg.num_layers and all(count(layer) == cfg.layer_params() for layer in layers)
    assert count(getattr(model, parts.norm), getattr(model, parts.head)) == cfg.norm_head_params()
    total = cfg.embedding_params() + cfg.num_layers * cfg.layer_params() + cfg.norm_head_params()
    assert total == cfg.param_count() == model.num_params()  # the parts are the whole model


@pytest.mark.parametrize("name", NAMES)
def test_every_numeric_field_has_a_bound(name):
    def numeric(cls, prefix: str = "") -> set[str]:
        found = set()
        for n, tp in typing.get_type_hints(cls).items():
            nested = [a for a in (tp, *typing.get_args(tp)) if dataclasses.is_dataclass(a)]
            if nested:  # a section of the model's (model.rope_scaling): its fields, dotted
                found |= numeric(nested[0], f"{prefix}{n}.")
            elif tp in (int, float) or set(typing.get_args(tp)) & {int, float}:
                found.add(prefix + n)
        return found

    assert sorted(FAMILIES[name].bounds) == sorted(numeric(FAMILIES[name].config))


@pytest.mark.parametrize("name", NAMES)
def test_tp_rule_accepts_a_good_tp_and_refuses_a_bad_one_in_rendering_and_training(name):
    cfg = tiny(name).model
    assert cfg.tp_problems(1) == [] and cfg.tp_problems(2) == []
    bad = cfg.num_heads + 1  # divides neither the heads nor, in the tiny recipes, the vocabulary
    message = f"layout.tp {bad} must divide model.num_heads {cfg.num_heads}"
    assert message in cfg.tp_problems(bad)
    with pytest.raises(RecipeError, match=message):  # `plan`, `sbatch`, check_recipe
        load_recipe(f"{name}-tiny", overrides=[f"layout.tp={bad}"])
    plan = FAMILIES[name].parallel_plan  # training's check before sharding: the same rule
    plan.check_tensor_parallel(cfg, 2)
    with pytest.raises(ValueError, match=message):
        plan.check_tensor_parallel(cfg, bad)


@pytest.mark.parametrize("name", NAMES)
def test_parallel_plan_names_linears_of_the_model(name):
    from torch import nn

    from trnrecipes.models import build_model

    layer = build_model(tiny(name).model, "meta").layers[0]
    plan = FAMILIES[name].parallel_plan
    for path in plan.COLUMN_PARALLEL + plan.ROW_PARALLEL:
        assert isinstance(layer.get_submodule(path), nn.Linear), path
    for path in plan.NORMS + plan.BRANCHES:
        layer.get_submodule(path)


@pytest.mark.parametrize("name", NAMES)
def test_unknown_model_keys_are_refused_by_name_with_the_valid_ones(name):
    valid = ", ".join(field_names(FAMILIES[name].config))
    with pytest.raises(RecipeError, match=f"model.no_such_key: unknown key; valid keys here: {valid}"):
        load_recipe(f"{name}-tiny", overrides=["model.no_such_key=1"])
    for other in NAMES:  # another family's field is no exception (rotary_pct on llama2 once was dropped silently)
        for key in set(field_names(FAMILIES[other].config)) - set(field_names(FAMILIES[name].config)):
            with pytest.raises(RecipeError, match=f"model.{key}: unknown key; valid keys here: {valid}"):
                load_recipe(f"{name}-tiny", overrides=[f"model.{key}=1"])


def test_unknown_family_is_refused_with_the_known_ones():
    known = ", ".join(repr(n) for n in FAMILIES)
    with pytest.raises(RecipeError, match=f"model.family: expected one of {known}, got 'gpt'"):
        load_recipe("neox-tiny", overrides=["model.family=gpt"])
    data = tiny("neox").to_dict()
    del data["model"]["family"]
    with pytest.raises(RecipeError, match=f"model.family: required key is missing \\(one of {known}\\)"):
        recipe_from_dict(data, "test")


@pytest.mark.parametrize("name", NAMES)
def test_model_section_round_trips_through_a_recipe_dict(name):
    recipe = tiny(name)
    again = recipe_from_dict(recipe.to_dict(), "round trip")
    assert again == recipe and again.model == recipe.model and type(again.model) is type(recipe.model)
    changed = load_recipe(f"{name}-tiny", overrides=["model.num_layers=3"])
    assert changed.model != recipe.model and changed.model.num_layers == 3


@pytest.mark.parametrize("name", NAMES)
def test_hf_adapter_round_trips_the_config_and_is_found_by_its_architecture(name):
    cfg = dataclasses.replace(tiny(name).model, activation_checkpointing="none")
    hf = FAMILIES[name].hf
    hf_config = hf.hf_config_from_args(cfg)
    assert family_of_hf_config(hf_config) is FAMILIES[name]
    assert hf_config["architectures"][0] in FAMILIES[name].hf_architectures
    assert hf.args_from_hf_config(hf_config) == cfg


def test_another_head_of_a_known_model_type_is_refused_naming_the_ones_built():
    # BertForTokenClassification's classifier is shaped as the sequence classifier's: it was read as one
    with pytest.raises(ValueError, match=r"a bert model with a head this family does not build; supported: Bert"):
        family_of_hf_config({"model_type": "bert", "architectures": ["BertForTokenClassification"]})
    assert family_of_hf_config({"model_type": "bert"}) is FAMILIES["bert"]  # no architectures named: by its type


@pytest.mark.parametrize("name", NAMES)
def test_compiler_flags_are_flags(name):
    for instance in ("trn1.32xlarge", "trn2.48xlarge"):
        flags = FAMILIES[name].compiler_flags(instance)
        assert isinstance(flags, tuple) and all(f.startswith("--") for f in flags)


def test_specs_and_the_registry_import_no_torch():
    code = (
        "import sys, trnrecipes.config.families, trnrecipes.config.recipe; assert 'torch' not in sys.modules, 'torch'"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
