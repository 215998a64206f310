"""Activation checkpointing applied from outside (trnrecipes/parallel/activation_checkpointing.py): it really
recomputes (and saves less), changes no number, no parameter name and no state dict key, survives hooks on submodules,
a second application and copy.deepcopy, and refuses an unknown mode."""

from __future__ import annotations

import collections
import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from recipes.common.attention import CoreAttention
from recipes.common.loss import IGNORE_INDEX
from trnrecipes.config.recipe import load_recipe
from trnrecipes.models import build_model
from trnrecipes.parallel.activation_checkpointing import MODES, apply_activation_checkpointing, is_checkpointed

torch.set_num_threads(2)

FAMILIES = ["llama2", "neox"]
SEQ = 32


def tiny_model(family: str, mode: str = "none") -> torch.nn.Module:
    """The family's tiny recipe model (the one training tests use), same weights for every mode."""
    model = build_model(load_recipe(f"{family}-tiny").model)
    model.init_weights(seed=0)
    apply_activation_checkpointing(model, mode)
    return model.train()


def batch(model):
    tokens = torch.randint(0, model.args.vocab_size, (2, SEQ + 1), generator=torch.Generator().manual_seed(1))
    labels = tokens[:, 1:].clone()
    labels[0, :5] = IGNORE_INDEX
    return tokens[:, :-1], labels


def loss_and_grads(model):
    model.zero_grad(set_to_none=True)
    tokens, labels = batch(model)
    loss = model(tokens, labels=labels)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", FAMILIES)
def test_loss_and_grads_are_bitwise_those_without_checkpointing(family):
    want_loss, want_grads = loss_and_grads(tiny_model(family))
    for mode in ("selective", "elementwise", "full"):
        loss, grads = loss_and_grads(tiny_model(family, mode))
        assert torch.equal(loss, want_loss), mode
        assert grads.keys() == want_grads.keys()
        for name, grad in grads.items():
            assert torch.equal(grad, want_grads[name]), f"{mode}: {name}"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", MODES)
def test_parameter_names_state_dict_keys_and_module_tree_are_unchanged(family, mode):
    plain, other = tiny_model(family), tiny_model(family, mode)
    assert [n for n, _ in other.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert [n for n, _ in other.named_modules()] == [n for n, _ in plain.named_modules()]
    assert list(other.state_dict()) == list(plain.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), plain.state_dict().values(), strict=True))
    other.load_state_dict(plain.state_dict())  # strict: the checkpoint format is the same


def count_calls(monkeypatch, model) -> dict[str, int]:
    """Counts core attention (SDPA) calls and MLP calls. The MLP count comes from a forward pre-hook on a submodule,
    as tensor-parallel styles register them: it must run again when its block is recomputed."""
    counts = {"sdpa": 0, "mlp": 0}
    sdpa = F.scaled_dot_product_attention

    def sdpa_spy(*args, **kwargs):
        counts["sdpa"] += 1
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa_spy)
    for layer in model.layers:
        layer.mlp.register_forward_pre_hook(lambda _m, _a: counts.__setitem__("mlp", counts["mlp"] + 1))
    return counts


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "mode, sdpa_in_backward, mlp_in_backward", [("none", 0, 0), ("selective", 1, 0), ("full", 1, 1)]
)
def test_backward_recomputes_what_the_mode_says(monkeypatch, family, mode, sdpa_in_backward, mlp_in_backward):
    model = tiny_model(family, mode)
    n = len(model.layers)
    counts = count_calls(monkeypatch, model)
    tokens, labels = batch(model)
    loss = model(tokens, labels=labels)
    assert counts == {"sdpa": n, "mlp": n}  # forward: once per layer
    loss.backward()
    assert counts == {"sdpa": n * (1 + sdpa_in_backward), "mlp": n * (1 + mlp_in_backward)}


class OpCounter(TorchDispatchMode):
    """Counts the aten ops that run (a cached op of selective checkpointing returns without running)."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def ops_in_backward(model) -> collections.Counter:
    tokens, labels = batch(model)
    loss = model(tokens, labels=labels)
    with OpCounter() as counter:
        loss.backward()
    return counter.counts


@pytest.mark.parametrize("family", FAMILIES)
def test_elementwise_recomputes_elementwise_ops_and_no_matmul_or_attention(family):
    plain, lean, full = (ops_in_backward(tiny_model(family, mode)) for mode in ("none", "elementwise", "full"))
    sdpa = [op for op in full if "scaled_dot_product" in op and "backward" not in op]  # the forward kernel(s)
    matmuls = ("mm", "addmm", "bmm")
    # whole blocks again: their matmuls and attention rerun in backward
    assert sum(full[op] for op in matmuls) > sum(plain[op] for op in matmuls)
    assert sdpa and sum(plain[op] for op in sdpa) == 0
    # elementwise: the same matmuls and attention as without checkpointing, and the norms and the rest once more
    assert {op: lean[op] for op in matmuls} == {op: plain[op] for op in matmuls}
    assert sum(lean[op] for op in sdpa) == 0
    assert lean["mul"] > plain["mul"] and lean["cat"] > plain["cat"], (lean, plain)  # RoPE, norms, SwiGLU/GeLU


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_elementwise_keeps_less_than_no_checkpointing_and_more_than_full(family):
    # Under torch.compile the checkpointing policy goes to the partitioner, which decides what the forward keeps:
    # aot_eager_decomp_partition runs inductor's partitioner without its code generation.
    import torch._dynamo

    from trnrecipes.parallel.compile import compile_blocks

    held = {}
    for mode in ("none", "elementwise", "full"):
        torch._dynamo.reset()
        model = tiny_model(family, mode)
        compile_blocks(model, "aot_eager_decomp_partition")
        held[mode] = saved_bytes(model)
    assert held["full"] < held["elementwise"] < held["none"], held


def test_compiled_elementwise_blocks_and_whole_blocks_each_run_their_own_graph():
    # The blocks share one compiled code object: a block checkpointed whole must not run the graph traced for an
    # elementwise one, nor the reverse (torch.compile did not guard the policy function: with any whole block first,
    # every block ran its graph; measured on an H200 as 8 and 12 whole blocks of 32 giving the same peak and time).
    import torch._dynamo

    from trnrecipes.parallel.compile import compile_blocks

    held = {}
    for full in (0, 1, 2):
        torch._dynamo.reset()
        model = build_model(load_recipe("llama2-tiny", overrides=["model.num_layers=4"]).model)
        model.init_weights(seed=0)
        apply_activation_checkpointing(model, "elementwise", full_layers=full)
        compile_blocks(model.train(), "aot_eager")
        saved_bytes(model)  # the first call compiles
        held[full] = saved_bytes(model)
    assert held[0] > held[1] > held[2] and held[0] - held[1] == held[1] - held[2], held  # each whole block the same


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["none", "selective"])
def test_the_first_full_layers_blocks_are_recomputed_whole(monkeypatch, family, mode):
    model = build_model(load_recipe(f"{family}-tiny").model)
    model.init_weights(seed=0)
    apply_activation_checkpointing(model, mode, full_layers=1)
    n = len(model.layers)
    assert [is_checkpointed(b) for b in model.layers] == [True] + [False] * (n - 1)
    counts = count_calls(monkeypatch, model.train())
    tokens, labels = batch(model)
    model(tokens, labels=labels).backward()
    # the first block whole (attention and MLP again); the others per the mode (selective: their attention)
    assert counts == {"sdpa": n + 1 + (n - 1 if mode == "selective" else 0), "mlp": n + 1}


@pytest.mark.parametrize("family", FAMILIES)
def test_nothing_is_checkpointed_in_eval_or_without_grad(monkeypatch, family):
    model = tiny_model(family, "full")
    apply_activation_checkpointing(model, "selective")
    n = len(model.layers)
    counts = count_calls(monkeypatch, model)
    tokens, labels = batch(model)
    with torch.no_grad():
        model(tokens, labels=labels)
    model.eval()
    loss = model(tokens, labels=labels)
    loss.backward()  # eval mode with grad: plain autograd, nothing recomputed
    assert counts == {"sdpa": 2 * n, "mlp": 2 * n}


def saved_bytes(model) -> int:
    """Bytes autograd saves for backward outside checkpointed regions (each storage counted once; the parameters,
    which compiled graphs also save, not counted)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    tokens, labels = batch(model)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, labels=labels)
    return sum(n for ptr, n in storages.items() if ptr not in params)


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpointing_saves_fewer_activations(family):
    saved = {mode: saved_bytes(tiny_model(family, mode)) for mode in MODES}
    assert saved["full"] < saved["selective"] < saved["none"], saved


@pytest.mark.parametrize("family", FAMILIES)
def test_applying_twice_wraps_once(monkeypatch, family):
    model = tiny_model(family, "full")
    forwards = [layer.forward for layer in model.layers]
    apply_activation_checkpointing(model, "full")
    assert [layer.forward for layer in model.layers] == forwards
    n = len(model.layers)
    counts = count_calls(monkeypatch, model)
    model(*batch(model)[:1]).sum().backward()
    assert counts == {"sdpa": 2 * n, "mlp": 2 * n}  # one recomputation per layer, not two


def test_selective_wraps_exactly_the_core_attention_modules():
    model = tiny_model("llama2", "selective")
    wrapped = [name for name, m in model.named_modules() if is_checkpointed(m)]
    assert wrapped == [f"layers.{i}.attn.core" for i in range(len(model.layers))]
    assert all(isinstance(model.get_submodule(name), CoreAttention) for name in wrapped)
    assert not list(CoreAttention().parameters()) and not CoreAttention().state_dict()


@pytest.mark.parametrize("mode", ["selective", "elementwise", "full"])
def test_a_deep_copy_runs_its_own_weights(mode):
    model = tiny_model("neox", mode)
    clone = copy.deepcopy(model)
    assert all(is_checkpointed(layer) for layer in clone.layers) == (mode in ("full", "elementwise"))
    with torch.no_grad():
        for p in clone.layers.parameters():
            p.mul_(1.5)
    tokens, labels = batch(model)
    fresh = tiny_model("neox")
    fresh.load_state_dict(clone.state_dict())
    torch.testing.assert_close(clone(tokens, labels=labels), fresh(tokens, labels=labels), rtol=0, atol=0)
    assert not torch.equal(clone(tokens, labels=labels), model(tokens, labels=labels))


@pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")
@pytest.mark.parametrize("family", FAMILIES)
def test_tensor_parallel_hooks_on_submodules_still_work(family):
    # DTensor styles hook the linears and (PrepareModuleInput) the attention/MLP branches, inside each block: those
    # hooks run again in recomputation. One gloo rank is enough to put them in place.
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        parallelize_module,
    )

    from trnrecipes.parallel.tensor import family_plan

    if dist.is_initialized():
        pytest.skip("a process group is already up")
    plan = family_plan(family)
    styles = {}
    for i in range(load_recipe(f"{family}-tiny").model.num_layers):
        styles |= {f"layers.{i}.{name}": ColwiseParallel() for name in plan.COLUMN_PARALLEL}
        styles |= {f"layers.{i}.{name}": RowwiseParallel() for name in plan.ROW_PARALLEL}
        styles |= {
            f"layers.{i}.{name}": PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=True
            )
            for name in plan.BRANCHES
        }
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        mesh = init_device_mesh("cpu", (1,))
        results = {}
        for mode in MODES:
            model = parallelize_module(tiny_model(family), mesh, styles)
            apply_activation_checkpointing(model, mode)  # after the styles, as the parallelize step orders them
            loss, grads = loss_and_grads(model)
            results[mode] = loss, {n: g.full_tensor() if hasattr(g, "full_tensor") else g for n, g in grads.items()}
    finally:
        dist.destroy_process_group()
    for mode in ("selective", "elementwise", "full"):
        torch.testing.assert_close(results[mode][0], results["none"][0], rtol=0, atol=0)
        for name, grad in results["none"][1].items():
            torch.testing.assert_close(results[mode][1][name], grad, rtol=0, atol=0, msg=f"{mode}: {name}")


@pytest.mark.parametrize("mode", ["some", "Full", "", None])
def test_an_unknown_mode_is_refused_with_the_valid_ones(mode):
    model = tiny_model("llama2")
    with pytest.raises(ValueError, match=rf"one of \('none', 'selective', 'elementwise', 'full'\), not {mode!r}"):
        apply_activation_checkpointing(model, mode)


def test_selective_needs_core_attention_modules():
    with pytest.raises(ValueError, match="no CoreAttention in Linear"):
        apply_activation_checkpointing(torch.nn.Linear(2, 2), "selective")


def test_full_layers_counts_within_each_pipeline_stage():
    # A pipeline rank holding stages 0 and 2 of 4 (interleaved), two blocks each: the first block of each stage.
    from trnrecipes.config.families import family_spec
    from trnrecipes.config.stages import rank_stages, split_stages
    from trnrecipes.parallel.pipeline import StagedModel

    recipe = load_recipe("llama2-tiny", overrides=["model.num_layers=8"])
    stages = rank_stages(split_stages(8, 2, 2, None, "interleaved_1f1b"), 0)
    model = StagedModel(build_model(recipe.model, "meta"), family_spec("llama2").parts, stages)
    apply_activation_checkpointing(model, "none", full_layers=1)
    whole = sorted(int(name) for name, block in model.layers.named_children() if is_checkpointed(block))
    assert whole == [s.layers[0] for s in stages] and len(whole) == 2
