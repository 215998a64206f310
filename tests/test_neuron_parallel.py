"""The Neuron tensor-parallel adapter: what it replaces (pure, checked here) and its import guard. The NxD layers
themselves only exist on Trainium hosts."""

from __future__ import annotations

import importlib.util

import pytest

from trnrecipes.models import build_model
from trnrecipes.neuron_parallel import apply_neuron_tensor_parallel, linear_specs
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
