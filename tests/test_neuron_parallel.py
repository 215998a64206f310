"""The Neuron tensor-parallel adapter: what it replaces (pure, checked here) and its import guard. The NxD layers
themselves only exist on Trainium hosts."""

from __future__ import annotations

import importlib.util

import pytest

from trnrecipes.models import build_model
from trnrecipes.neuron_parallel import apply_neuron_tensor_parallel, linear_specs, sequence_parallel_params
from trnrecipes.recipe import load_recipe


def test_specs_follow_the_family_plans_on_the_real_shapes():
    neox = load_recipe("neox20b").model
    specs = linear_specs(build_model(neox, "meta"), "neox")
    assert len(specs) == 4 * 44
    assert specs[0].name == "layers.0.attn.qkv" and (specs[0].kind, specs[0].out_features, specs[0].bias) == (
        "column", 3 * 6144, True,
    )  # fmt: skip
    llama = build_model(load_recipe("llama2-7b").model, "meta")
    by_name = {s.name: s for s in linear_specs(llama, "llama2")}
    assert by_name["layers.31.mlp.gate_up"].out_features == 2 * 11008 and by_name["layers.31.mlp.down"].kind == "row"
    assert not any(s.bias for s in by_name.values())


@pytest.mark.skipif(importlib.util.find_spec("neuronx_distributed") is not None, reason="a real Neuron host")
def test_without_the_neuron_sdk_the_adapter_says_what_is_missing():
    model = build_model(load_recipe("neox-tiny").model, "meta")
    with pytest.raises(RuntimeError, match="needs neuronx-distributed from the Neuron SDK"):
        apply_neuron_tensor_parallel(model, "neox")


@pytest.mark.parametrize(("recipe", "family"), [("neox-tiny", "neox"), ("llama2-tiny", "llama2")])
def test_sequence_parallel_tags_exactly_the_norm_parameters(recipe, family):
    """Under SP the norms see a sequence shard: their gradients must be summed over TP. Cross-checked against the
    module types, so a norm added to a model but not to its family plan fails here."""
    model = build_model(load_recipe(recipe).model, "meta")
    tagged = sequence_parallel_params(model, family)
    norm_types = ("LayerNorm", "RMSNorm")
    expected = [f"{m}.{p}" for m, mod in model.named_modules() if type(mod).__name__ in norm_types
                for p, _ in mod.named_parameters(recurse=False)]  # fmt: skip
    assert sorted(tagged) == sorted(expected) and len(tagged) == len(set(tagged))
    assert "norm.weight" in tagged and any(name.startswith("layers.1.") for name in tagged)
