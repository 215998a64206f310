"""The Neuron tensor-parallel adapter: what it replaces (pure, checked here) and its import guard. The NxD layers
themselves only exist on Trainium hosts."""

from __future__ import annotations

import copy
import importlib.util
import sys
import types

import pytest
import torch
from torch import nn

from trnrecipes.models import build_model
from trnrecipes.neuron_parallel import (
    apply_neuron_tensor_parallel,
    linear_specs,
    param_norm,
    sequence_parallel_params,
)
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


# -- the adapter's wiring, against a stand-in for NxD at TP 1 -------------------------------------------------------
# The stand-in has NxD 2.29's constructor and mapping signatures (keyword names included, so a misspelt or missing
# argument fails here) and TP-1 behaviour: each parallel linear is the whole linear and the mappings are identities.
# It checks what can be checked off Trainium: every layer is built with the arguments the adapter means to pass, the
# weights land in the right layers, and the hooks keep the model's function; not NxD's collectives.


def install_fake_nxd(monkeypatch) -> list[dict]:
    built: list[dict] = []

    class _Linear(nn.Linear):
        def __init__(
            self,
            input_size,
            output_size,
            bias=True,
            *,
            dtype=torch.float32,
            init_method=None,
            reduce_dtype=torch.float32,
            sequence_parallel_enabled=False,
            sequence_dimension=None,
            **kind,
        ):
            super().__init__(input_size, output_size, bias=bias, dtype=dtype)
            sp = (sequence_parallel_enabled, sequence_dimension)
            layer = {"layer": type(self).__name__, "dtype": dtype, "reduce_dtype": reduce_dtype, "sp": sp}
            built.append({**layer, "init_method": init_method, **kind})
            if init_method is not None:
                init_method(self.weight)

    class ColumnParallelLinear(_Linear):
        def __init__(self, *args, gather_output=True, **kwargs):
            super().__init__(*args, gather_output=gather_output, **kwargs)

    class RowParallelLinear(_Linear):
        def __init__(self, *args, input_is_parallel=False, **kwargs):
            super().__init__(*args, input_is_parallel=input_is_parallel, **kwargs)

    class ParallelEmbedding(nn.Embedding):
        def __init__(self, num_embeddings, embedding_dim, *, init_method=None, dtype=torch.float32):
            super().__init__(num_embeddings, embedding_dim, dtype=dtype)
            built.append({"layer": "ParallelEmbedding", "dtype": dtype, "init_method": init_method})

    def scatter_to_sequence_parallel_region(input_, sequence_dimension=0, process_group=None):
        assert sequence_dimension == 1  # our activations are [batch, seq, hidden], not NxD's default [seq, ...]
        return input_

    def gather_from_sequence_parallel_region(input_, sequence_dimension=0, to_model_parallel=True, process_group=None):
        assert sequence_dimension == 1 and not to_model_parallel
        return input_

    modules = {
        "neuronx_distributed": {},
        "neuronx_distributed.parallel_layers.layers": dict(
            ColumnParallelLinear=ColumnParallelLinear,
            RowParallelLinear=RowParallelLinear,
            ParallelEmbedding=ParallelEmbedding,
        ),
        "neuronx_distributed.parallel_layers.mappings": dict(
            scatter_to_sequence_parallel_region=scatter_to_sequence_parallel_region,
            gather_from_sequence_parallel_region=gather_from_sequence_parallel_region,
            reduce_from_tensor_model_parallel_region=lambda input_, process_group=None: input_,
        ),
        "neuronx_distributed.parallel_layers.parallel_state": dict(
            get_tensor_model_parallel_size=lambda: 1, get_tensor_model_parallel_rank=lambda: 0
        ),
    }
    package = types.ModuleType("neuronx_distributed.parallel_layers")
    monkeypatch.setitem(sys.modules, package.__name__, package)
    for name, attrs in modules.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)
        if name.startswith(package.__name__ + "."):
            setattr(package, name.rsplit(".", 1)[1], module)
    return built


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("recipe", "family"), [("neox-tiny", "neox"), ("llama2-tiny", "llama2")])
def test_adapter_builds_nxd_layers_that_keep_the_function(monkeypatch, recipe, family, dtype, sequence_parallel):
    built = install_fake_nxd(monkeypatch)
    torch.manual_seed(0)
    model = build_model(load_recipe(recipe).model)
    model.init_weights()
    model.to(dtype)
    tokens = torch.randint(0, model.args.vocab_size, (2, 16))
    with torch.no_grad():
        expected = model(tokens)
    parallel = apply_neuron_tensor_parallel(copy.deepcopy(model), family, sequence_parallel)
    with torch.no_grad():
        assert torch.equal(parallel(tokens), expected)  # weights copied into the right layers, hooks harmless

    linears = [b for b in built if b["layer"] != "ParallelEmbedding"]
    assert len(linears) == len(linear_specs(model, family)) + 1  # + the head
    for b in built:
        assert b["dtype"] == dtype and b["init_method"].__name__ == "_keep_uninitialized"
    for b in linears:
        # NxD reduces the input gradient in reduce_dtype; any other dtype than the weights' loses the reduction.
        assert b["reduce_dtype"] == dtype
        row = b["layer"] == "RowParallelLinear"
        assert b["sp"] == ((True, 1) if row and sequence_parallel else (False, None))
        assert b.get("input_is_parallel", True) and b.get("gather_output", False) is (b is linears[-1])


def test_param_norm_counts_sharded_and_replicated_parameters(monkeypatch):
    """At TP 1 the TP sum is the identity, so the split into NxD-sharded and replicated parameters must add up to
    the plain norm (a parameter dropped or counted twice would not)."""
    install_fake_nxd(monkeypatch)
    model = build_model(load_recipe("neox-tiny").model)
    model.init_weights()
    params = list(model.parameters())
    for p in params[::2]:
        p.tensor_model_parallel = True
    expected = torch.cat([p.detach().double().flatten() for p in params]).norm().float()
    assert torch.allclose(param_norm(params), expected, rtol=1e-5)
