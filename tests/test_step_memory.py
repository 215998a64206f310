"""What the training step keeps, made lean for the GPU (docs/benchmarks.md, "Memory against transformers +
torch.compile"): RoPE tables made once per shape (recipes/common/rope.py) and gradients that hold no more memory than
their own elements (trnrecipes.train.loop.compact_grads)."""

from __future__ import annotations

import pytest
import torch

import recipes.common.rope as rope
from recipes.common.loss import IGNORE_INDEX
from recipes.llama2.model import rotary_cos_sin
from trnrecipes.config.recipe import load_recipe
from trnrecipes.models import build_model
from trnrecipes.train.loop import compact_grads

torch.set_num_threads(2)


def tiny(family: str) -> torch.nn.Module:
    model = build_model(load_recipe(f"{family}-tiny").model)
    model.init_weights(seed=0)
    return model.train()


def loss_and_grads(model, seq: int = 24):
    tokens = torch.randint(0, model.args.vocab_size, (2, seq + 1), generator=torch.Generator().manual_seed(3))
    labels = tokens[:, 1:].clone()
    labels[0, :3] = IGNORE_INDEX
    model.zero_grad(set_to_none=True)
    loss = model(tokens[:, :-1], labels=labels)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_the_model_makes_its_rope_tables_once_and_they_are_the_computed_ones(monkeypatch):
    monkeypatch.setattr(rope, "_TABLES", {})
    model = tiny("llama2")
    made = []
    real = rotary_cos_sin
    monkeypatch.setattr("recipes.llama2.model.rotary_cos_sin", lambda *a, **k: made.append(a) or real(*a, **k))
    loss_and_grads(model)
    loss_and_grads(model)
    assert len(made) == 1  # not once per block and forward, as before
    (cos, sin), a = next(iter(rope._TABLES.values())), model.args
    want = rotary_cos_sin(24, a.head_dim, a.rotary_base, torch.device("cpu"), torch.float32, a.rope_scaling)
    assert torch.equal(cos, want[0]) and torch.equal(sin, want[1])


def test_the_rope_cache_keeps_at_most_max_tables_the_newest_ones(monkeypatch):
    monkeypatch.setattr(rope, "_TABLES", {})
    made = lambda n: (torch.full((n,), float(n)), torch.zeros(n))  # noqa: E731
    for n in range(1, rope.MAX_TABLES + 5):  # a caller varying the length
        cos, _ = rope.cached_tables(("len", n), lambda n=n: made(n))
        assert cos[0] == n
    assert list(rope._TABLES) == [("len", n) for n in range(5, rope.MAX_TABLES + 5)]


@pytest.mark.parametrize("family", ["llama2", "neox"])
def test_tables_made_in_inference_mode_serve_a_later_training_step(monkeypatch, family):
    monkeypatch.setattr(rope, "_TABLES", {})
    want = loss_and_grads(tiny(family))
    monkeypatch.setattr(rope, "_TABLES", {})
    model = tiny(family)
    with torch.inference_mode():  # evaluation first: its tables are then saved for a training backward
        model(torch.zeros(2, 24, dtype=torch.long))
    loss, grads = loss_and_grads(model)
    assert torch.equal(loss, want[0])
    assert all(torch.equal(grads[n], want[1][n]) for n in grads)


def test_compact_grads_gives_a_gradient_viewing_a_larger_buffer_its_own_storage():
    model = torch.nn.Linear(4, 3, bias=True)
    big = torch.arange(100, dtype=torch.float32)  # as an inductor buffer reused for the weight's gradient
    model.weight.grad = big[:12].view(3, 4)
    model.bias.grad = torch.ones(3)
    bias_grad = model.bias.grad
    compact_grads(model)
    g = model.weight.grad
    assert g.untyped_storage().nbytes() == 12 * 4 and torch.equal(g, torch.arange(12.0).view(3, 4))
    assert model.bias.grad is bias_grad  # a gradient of its own size is left as it is


def test_plan_counts_elementwise_between_full_and_none_and_xla_refuses_it():
    from trnrecipes.config.sections import RecipeError
    from trnrecipes.plan.memory import memory_plan

    over = ["cluster.backend=cuda", "cluster.instance=p5.48xlarge", "batch.seq_len=4096", "model.max_seq_len=4096"]
    acts = {
        mode: memory_plan(load_recipe("llama2-7b", overrides=[*over, f"model.activation_checkpointing={mode}"]), 1, 1)
        for mode in ("none", "elementwise", "full")
    }
    act = {mode: p.activations for mode, p in acts.items()}
    assert act["full"] < act["elementwise"] < act["none"], act
    # Llama-2-7B: 6h + 2f = 46,592 elements a token a layer against 9h + 4f = 80,896
    assert act["elementwise"] / act["none"] == pytest.approx((6 * 4096 + 2 * 11008) / (9 * 4096 + 4 * 11008))
    # the first 8 of 32 layers whole: a quarter of the layers keep their input only (h a token), and the one being
    # recomputed holds what a layer without checkpointing holds (9h + 4f)
    lean = load_recipe(
        "llama2-7b",
        overrides=[*over, "model.activation_checkpointing=elementwise", "model.activation_checkpointing_full_layers=8"],
    )
    per_token = 6 * 4096 + 2 * 11008
    want = (8 * 4096 + 24 * per_token + 9 * 4096 + 4 * 11008) / (32 * per_token)
    assert memory_plan(lean, 1, 1).activations / act["elementwise"] == pytest.approx(want)
    with pytest.raises(RecipeError, match=r"activation_checkpointing_full_layers 33 is more than model\.num_layers 32"):
        load_recipe("llama2-7b", overrides=["model.activation_checkpointing_full_layers=33"])
    with pytest.raises(RecipeError, match="activation_checkpointing elementwise: backend xla is not built with it"):
        load_recipe("llama2-tiny", overrides=["cluster.backend=xla", "model.activation_checkpointing=elementwise"])


@pytest.mark.parametrize("family", ["llama2", "neox"])
def test_compiled_blocks_take_the_tables_as_inputs_and_compute_no_angle(monkeypatch, family):
    # Inside a block's graph, inductor fused the tables' cos/sin into the rotation of every head (recomputing them
    # per element); made by the model's forward, they reach the graph as inputs and no angle op is left in it.
    import torch._dynamo

    from trnrecipes.parallel.compile import compile_blocks

    monkeypatch.setattr(rope, "_TABLES", {})
    torch._dynamo.reset()
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model = tiny(family)
    compile_blocks(model, capture)
    loss_and_grads(model)
    ops = {str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"}
    assert graphs and not any(name in op for op in ops for name in ("cos", "sin", "arange", "pow")), ops
    torch._dynamo.reset()
