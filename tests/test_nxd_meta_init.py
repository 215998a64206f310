"""NxD's layers built on the meta device: no rank allocates an unsharded weight on the host. NxD's host init
(_initialize_parameter_cpu; _initialize_affine_weight for GQA q/k/v) makes the whole fp32 weight and a downcast copy
per layer, on every local rank at once, to slice one shard out of it; the stand-in layers (tests/nxd_layers_standin.py)
run it under the same device rules as NxD 0.17 and record what it allocates."""

from __future__ import annotations

import math
import sys

import pytest
import torch
from test_neuron_parallel import install_fake_nxd, stand_in_dims

from trnrecipes.backends.neuron_xla import NeuronXlaBackend
from trnrecipes.config.recipe import load_recipe
from trnrecipes.models import build_model
from trnrecipes.parallel import nxd
from trnrecipes.parallel.kv_replication import ATTRIBUTE, OUT_ATTRIBUTE, layouts
from trnrecipes.train.build import build_model_shard

GQA = ["model.num_heads=8", "model.num_kv_heads=2"]  # at TP 4 each KV head on 2 ranks: NxD's GQA QKV layer
CASES = [("neox-tiny", 2, ["precision.dtype=bf16"]), ("llama3.1-tiny", 4, GQA), ("llama2-tiny", 4, [])]


def _host_masters():
    return sys.modules["neuronx_distributed.parallel_layers.layers"].host_masters


def _full_weight_shapes(recipe, tp: int) -> list[tuple[int, ...]]:
    """The unsharded weights of the layers the adapter replaces, in the order it builds them (q, k and v apart for
    NxD's GQA layer): what NxD's host init would allocate."""
    model = build_model(recipe.model, "meta")
    args, shapes = model.args, []
    for spec in nxd.linear_specs(model, recipe.model.family):
        kv = getattr(args, "num_kv_heads", None)
        if spec.name.endswith(".attn.qkv") and kv is not None and tp > kv:
            hd = args.head_dim
            shapes += [
                (args.num_heads * hd, spec.in_features),
                (kv * hd, spec.in_features),
                (kv * hd, spec.in_features),
            ]
        else:
            shapes.append((spec.out_features, spec.in_features))
    return [*shapes, tuple(model.embed.weight.shape), tuple(model.head.weight.shape)]


def _build(monkeypatch, recipe, tp: int, rank: int):
    built = install_fake_nxd(monkeypatch, tp=tp, rank=rank)
    dims = stand_in_dims(tp=tp, tp_rank=rank)
    model = build_model_shard(recipe, dims=dims, backend=NeuronXlaBackend("neuron", torch.device("cpu")))
    return model, built, _host_masters()


@pytest.mark.parametrize(("name", "tp", "overrides"), CASES)
def test_nxd_layers_allocate_no_unsharded_host_weight_and_keep_their_attributes(monkeypatch, name, tp, overrides):
    """Through the training build, TP rank 1: every NxD layer is built on meta, so none runs its host init (nothing
    full-size allocated, at any time); each shard is then allocated alone, with NxD's attributes, and filled. With the
    layers built on the host instead (the ambient device cpu, as before), every layer allocates its whole weight:
    the recorded fp32 masters are exactly the replaced weights' full shapes, and their bytes the sum over layers."""
    recipe = load_recipe(name, overrides=[f"layout.tp={tp}", f"cluster.workers_per_node={tp}", *overrides])
    model, built, host = _build(monkeypatch, recipe, tp, rank=1)
    assert (host.masters, host.master_bytes, host.peak_bytes) == ([], 0, 0)
    assert {b["weight_device"] for b in built} == {"meta"}
    params = dict(model.named_parameters())
    assert not any(p.is_meta for p in params.values())
    split = {n: p for n, p in params.items() if getattr(p, "tensor_model_parallel", False)}
    assert "embed.weight" in split and "head.weight" in split and "layers.0.attn.out.weight" in split
    full, replicated = build_model(recipe.model, "meta"), layouts(model)  # replicated qkv: more rows than stored
    for n, p in split.items():  # NxD's tags, set on the meta parameters, kept by the backend's materialize
        assert (p.partition_stride, p.num_partitions) == (1, tp), n
        assert n in replicated or p.shape[p.partition_dim] * tp == full.get_parameter(n).shape[p.partition_dim], n
    if overrides == GQA:
        attn = model.layers[0].attn
        assert getattr(attn.qkv, ATTRIBUTE).replicas == 2 and getattr(attn.out, OUT_ATTRIBUTE) is not None
        assert params["layers.0.attn.qkv.weight"].partition_dim == 0

    # The counterfactual: the same build with NxD's layers on the host.
    monkeypatch.setattr(nxd, "NXD_LAYER_DEVICE", torch.device("cpu"))
    on_host, built_on_host, host = _build(monkeypatch, recipe, tp, rank=1)
    assert {b["weight_device"] for b in built_on_host} == {"cpu"}
    expected = _full_weight_shapes(recipe, tp)
    assert host.masters == expected
    assert host.master_bytes == sum(4 * math.prod(s) for s in expected)
    assert host.peak_bytes >= 4 * max(math.prod(s) for s in expected)
    for (n, p), q in zip(model.named_parameters(), on_host.parameters(), strict=True):
        assert torch.equal(p, q), n  # the filled shards do not depend on where the layers were built


def test_only_an_ambient_meta_device_spares_the_embeddings_host_init(monkeypatch):
    """NxD's ParallelEmbedding allocates its weight with no device argument: device=meta alone still runs the host
    init, which Column/RowParallelLinear skip for device=meta; under `with torch.device("meta")` neither runs it."""
    install_fake_nxd(monkeypatch, tp=2)
    layers = sys.modules["neuronx_distributed.parallel_layers.layers"]
    meta = torch.device("meta")
    embedding = layers.ParallelEmbedding(64, 8, device=meta)
    assert embedding.weight.device.type == "cpu" and layers.host_masters.masters == [(64, 8)]
    linear = layers.ColumnParallelLinear(8, 16, device=meta)
    assert linear.weight.is_meta and linear.bias.is_meta and layers.host_masters.masters == [(64, 8)]
    with torch.device("meta"):
        assert layers.ParallelEmbedding(64, 8).weight.is_meta
        assert layers.RowParallelLinear(16, 8, input_is_parallel=True).weight.is_meta
    assert layers.host_masters.masters == [(64, 8)]
    layers.RowParallelLinear(16, 8, input_is_parallel=True)  # device None: the ambient cpu
    assert layers.host_masters.masters == [(64, 8), (8, 16)] and layers.host_masters.peak_bytes == 64 * 8 * 4
