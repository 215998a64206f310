"""The Neuron tensor-parallel adapter: what it replaces (pure, checked here) and its import guard. The NxD layers
themselves only exist on Trainium hosts."""

from __future__ import annotations

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
from trnrecipes.sharding import shard_region
from trnrecipes.train import build as build_module
from trnrecipes.train.build import build_model_shard


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


def install_fake_nxd(monkeypatch, tp: int = 1, rank: int = 0) -> list[dict]:
    """At tp > 1 the layers allocate NxD's shard shapes and tag them as NxD does (tensor_model_parallel,
    partition_dim): column-parallel weights and biases split rows, row-parallel weights split columns (their bias is
    whole), the embedding splits the vocabulary. Their forward is then not meaningful (no collectives)."""
    built: list[dict] = []

    def tag(param: nn.Parameter, dim: int) -> None:
        param.tensor_model_parallel, param.partition_dim = True, dim

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
            column = type(self).__name__ == "ColumnParallelLinear"
            shape = (input_size, output_size // tp) if column else (input_size // tp, output_size)
            super().__init__(*shape, bias=bias, dtype=dtype)
            tag(self.weight, 0 if column else 1)
            if bias and column:
                tag(self.bias, 0)
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
            super().__init__(num_embeddings // tp, embedding_dim, dtype=dtype)
            tag(self.weight, 0)
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
            get_tensor_model_parallel_size=lambda: tp, get_tensor_model_parallel_rank=lambda: rank
        ),
        "neuronx_distributed.utils": {},
        "neuronx_distributed.utils.model_utils": dict(move_model_to_device=lambda model, device: model.to(device)),
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


def _neuron_build(recipe, tp: int, rank: int) -> nn.Module:
    dims = types.SimpleNamespace(tp=tp, tp_rank=rank, neuron=True, mesh=None)
    return build_model_shard(recipe, dims=dims, device=torch.device("cpu"))


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize(("recipe", "family"), [("neox-tiny", "neox"), ("llama2-tiny", "llama2")])
def test_adapter_builds_nxd_layers_that_keep_the_function(monkeypatch, recipe, family, dtype, sequence_parallel):
    """Through the training build (meta model -> NxD layers -> each shard filled): at TP 1 the stand-in is the
    whole model, so the result must compute what the plain model with the same seed computes."""
    built = install_fake_nxd(monkeypatch)
    layout = ["layout.tp=2", "cluster.workers_per_node=2", f"layout.sequence_parallel={sequence_parallel}"]
    r = load_recipe(recipe, overrides=[f"precision.dtype={dtype}", *layout])
    model = build_model(r.model)
    model.init_weights(seed=r.train.seed)
    model.to(torch.bfloat16 if dtype == "bf16" else torch.float32)
    tokens = torch.randint(0, model.args.vocab_size, (2, 16))
    with torch.no_grad():
        expected = model(tokens)
    monkeypatch.setattr(build_module, "shard_region", lambda shape, dim, tp, rank: shard_region(shape, dim, 1, 0))
    parallel = _neuron_build(r, 2, 0)  # tp 2 routes through NxD; the TP-1 stand-in makes whole layers
    with torch.no_grad():
        assert torch.equal(parallel(tokens), expected)  # weights filled into the right layers, hooks harmless

    linears = [b for b in built if b["layer"] != "ParallelEmbedding"]
    assert len(linears) == len(linear_specs(model, family)) + 1  # + the head
    for b in built:
        assert b["dtype"] == expected.dtype and b["init_method"].__name__ == "_keep_uninitialized"
    for b in linears:
        # NxD reduces the input gradient in reduce_dtype; any other dtype than the weights' loses the reduction.
        assert b["reduce_dtype"] == expected.dtype
        row = b["layer"] == "RowParallelLinear"
        assert b["sp"] == ((True, 1) if row and sequence_parallel else (False, None))
        assert b.get("input_is_parallel", True) and b.get("gather_output", False) is (b is linears[-1])


@pytest.mark.parametrize("recipe", ["neox-tiny", "llama2-tiny"])
def test_each_neuron_tp_rank_allocates_and_fills_only_its_shard_of_the_same_model(monkeypatch, recipe):
    """TP 2 stand-in with NxD's shard shapes: each rank's parameters are its shard (half of every split one) of the
    TP-1 init, found by partition_dim; joined they are that model bitwise."""
    r = load_recipe(recipe)
    reference = build_model(r.model)
    reference.init_weights(seed=r.train.seed)
    shards = []
    for rank in (0, 1):
        install_fake_nxd(monkeypatch, tp=2, rank=rank)
        shards.append(dict(_neuron_build(r, 2, rank).named_parameters()))
    split = 0
    for name, full in reference.named_parameters():
        a, b = shards[0][name], shards[1][name]
        if getattr(a, "tensor_model_parallel", False):
            split += 1
            assert a.numel() * 2 == full.numel()
            assert torch.equal(torch.cat([a, b], dim=a.partition_dim), full.detach()), name
        else:
            assert torch.equal(a, full) and torch.equal(b, full), name
    assert split == 2 * len(linear_specs(reference, r.model.family)) + 2 - sum(
        not s.bias or s.kind == "row" for s in linear_specs(reference, r.model.family)
    )


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
