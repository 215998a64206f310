"""Qwen3-MoE (recipes/qwen3/model.py with recipes/qwen3/moe.py) against real transformers Qwen3MoeForCausalLM (fp32,
CPU, config-built models, dense and sparse blocks mixed): logits, hidden states, the loss with the load-balancing
term, gradients; the HF conversion both ways; training through the Trainer; what the family refuses."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import run_cli  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from test_convert import save_random  # noqa: E402
from test_qwen3_model import OFFLINE, hidden_states, randomized_norms  # noqa: E402

from recipes.qwen3.hf import args_from_hf_config, hf_config_from_args, state_dict_from_hf, state_dict_to_hf  # noqa: E402
from recipes.qwen3.model import MLP, Qwen3, SparseMLP  # noqa: E402
from trnrecipes.checkpoint import read_model_checkpoint  # noqa: E402
from trnrecipes.config.recipe import RecipeError, load_recipe  # noqa: E402
from trnrecipes.parallel.activation_checkpointing import apply_activation_checkpointing  # noqa: E402
from trnrecipes.train.loop import Trainer  # noqa: E402

VOCAB, SEQ, COEF = 256, 24, 0.5  # a large coefficient, so a wrong aux term shows in the loss


def hf_config(tied=False, norm_topk=True, vocab=VOCAB, coef=COEF, step=1, mlp_only=(1,)):
    return transformers.Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=64, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=tied,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=norm_topk,
        decoder_sparse_step=step, mlp_only_layers=list(mlp_only), router_aux_loss_coef=coef, initializer_range=0.1,
        attn_implementation="eager",
    )  # fmt: skip


def hf_model(seed=0, **kw):
    torch.manual_seed(seed)
    return randomized_norms(transformers.Qwen3MoeForCausalLM(hf_config(**kw)).eval())


def ours_from_hf(model) -> Qwen3:
    args = args_from_hf_config(model.config.to_dict())
    ours = Qwen3(args).train()  # train mode: the aux term is a training loss (no dropout: same values)
    ours.load_state_dict(state_dict_from_hf(model.state_dict(), args), strict=True)
    return ours


def batch(seed=1, vocab=VOCAB):
    tokens = torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(seed))
    return tokens, torch.cat([tokens[:, 1:], torch.full((2, 1), -100)], dim=1)  # ours takes labels shifted


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("norm_topk", [True, False], ids=["norm-topk", "raw-topk"])
@pytest.mark.parametrize(("step", "mlp_only"), [(1, (1,)), (2, ())], ids=["mlp-only-1", "sparse-step-2"])
def test_logits_hidden_states_and_loss_with_aux_match_hf(tied, norm_topk, step, mlp_only):
    hf = hf_model(tied=tied, norm_topk=norm_topk, step=step, mlp_only=mlp_only)
    ours = ours_from_hf(hf)
    sparse = [isinstance(layer.mlp, SparseMLP) for layer in ours.layers]
    assert sparse == [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in hf.model.layers]
    assert True in sparse and False in sparse  # dense and sparse blocks mixed
    assert ours.num_params() == sum(p.numel() for p in hf.parameters()) == ours.args.param_count()
    tokens, labels = batch()
    with torch.no_grad():
        ref = hf(tokens, labels=tokens, output_hidden_states=True, output_router_logits=True)
        logits, loss, states = ours(tokens), ours(tokens, labels), hidden_states(ours, tokens)
    torch.testing.assert_close(logits, ref.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, ref.loss, rtol=1e-6, atol=1e-6)  # cross-entropy + COEF * aux
    torch.testing.assert_close(ours.router_health()["router_aux_loss"], ref.aux_loss.item(), rtol=1e-6, atol=1e-6)
    for got, want in zip(states, ref.hidden_states, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _grads(model) -> dict:
    return {name: p.grad for name, p in model.named_parameters()}


def test_gradients_match_hf_and_the_aux_loss_reaches_the_router():
    hf = hf_model()
    ours = ours_from_hf(hf)
    without_aux = copy.deepcopy(ours)
    tokens, labels = batch()
    hf.train()(tokens, labels=tokens, output_router_logits=True).loss.backward()
    ours(tokens, labels).backward()
    want = state_dict_from_hf(_grads(hf), ours.args)  # HF's gradients in our layout (the conversion is a permutation)
    got = _grads(ours)
    for name in ("layers.0.mlp.router.weight", "layers.0.mlp.experts.gate_up", "layers.2.mlp.experts.down"):
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
    for name, grad in got.items():
        torch.testing.assert_close(grad, want[name], rtol=1e-4, atol=1e-6, msg=name)
    without_aux.args = dataclasses.replace(ours.args, router_aux_loss_coef=0.0)
    without_aux(tokens, labels).backward()
    router = "layers.0.mlp.router.weight"
    assert not torch.allclose(_grads(without_aux)[router], got[router], rtol=1e-3, atol=1e-6)


def _fused(per_expert: dict, args) -> dict:
    """Files' per-expert tensors -> Qwen3MoeForCausalLM's module state dict, as transformers' loading fuses them."""
    out = {k: v for k, v in per_expert.items() if ".mlp.experts." not in k}
    for i in (i for i in range(args.num_layers) if args.is_sparse(i)):
        p, experts = f"model.layers.{i}.mlp.experts.", range(args.num_experts)
        gate_up = [
            torch.cat([per_expert[f"{p}{j}.gate_proj.weight"], per_expert[f"{p}{j}.up_proj.weight"]]) for j in experts
        ]
        out[p + "gate_up_proj"] = torch.stack(gate_up)
        out[p + "down_proj"] = torch.stack([per_expert[f"{p}{j}.down_proj.weight"] for j in experts])
    return out


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_state_dicts_convert_bit_exact_both_ways(tied):
    hf = hf_model(tied=tied)
    ours = ours_from_hf(hf)
    back = state_dict_to_hf(ours.state_dict(), ours.args)
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in back  # the files' per-expert form
    expected = {k: v for k, v in hf.state_dict().items() if not (tied and k == "lm_head.weight")}
    fused = _fused(back, ours.args)
    assert fused.keys() == expected.keys() and all(torch.equal(fused[k], v) for k, v in expected.items())
    again = state_dict_from_hf(back, ours.args)  # and the per-expert form reads back to the same weights
    assert all(torch.equal(again[k], v) for k, v in ours.state_dict().items())
    config = hf_config_from_args(ours.args)
    assert config["model_type"] == "qwen3_moe" and config["mlp_only_layers"] == [1]
    assert args_from_hf_config(config) == ours.args


def test_a_directory_converts_bit_exact_both_ways_through_the_cli(tmp_path):
    torch.manual_seed(0)
    original = transformers.Qwen3MoeForCausalLM(hf_config(vocab=4096))
    save_random(original, tmp_path / "hf")
    done = run_cli("convert", "from-hf", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt"), env=OFFLINE)
    assert done.returncode == 0, done.stderr
    recipe, state, _ = read_model_checkpoint(tmp_path / "ckpt")
    assert recipe.model.num_experts == 8 and recipe.model.mlp_only_layers == (1,)
    assert state["layers.0.mlp.experts.gate_up"].shape == (8, 64, 64)

    done = run_cli("convert", "to-hf", "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"), env=OFFLINE)
    assert done.returncode == 0, done.stderr
    before, after = load_file(tmp_path / "hf/model.safetensors"), load_file(tmp_path / "out/model.safetensors")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert json.loads((tmp_path / "out/config.json").read_text())["model_type"] == "qwen3_moe"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    tokens = torch.randint(0, 4096, (2, 20))
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, original.eval()(tokens).logits)


@pytest.mark.parametrize("mode", ["selective", "elementwise", "full"])
def test_activation_checkpointing_gives_the_same_loss_and_grads(mode):
    reference = ours_from_hf(hf_model())
    model = copy.deepcopy(reference)
    apply_activation_checkpointing(model, mode)
    tokens, labels = batch(2)
    losses = []
    for m in (reference, model):
        loss = m(tokens, labels)
        loss.backward()
        losses.append(loss)
    assert torch.equal(losses[0], losses[1])
    for (name, p), q in zip(reference.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=name)
    # the recompute in backward stores no routing: its graph would keep the block's activations until the next step
    assert all(r.prob_sum.grad_fn is None for r in model.routings())


def test_compiled_sparse_blocks_do_not_recompile_when_the_routing_changes():
    import torch._dynamo

    from trnrecipes.parallel.compile import compile_blocks

    torch._dynamo.reset()
    model = ours_from_hf(hf_model())
    compile_blocks(model, "eager")  # the experts' split sizes are data: they run outside the graph
    model(*batch(2)).backward()
    with torch.compiler.set_stance("fail_on_recompile"):
        for seed in (3, 4):  # other tokens, other experts' loads
            model(*batch(seed)).backward()


def _train(tmp_path, *extra):
    overrides = [
        "cluster.workers_per_node=1", "batch.seq_len=64", "batch.global_batch=2", "batch.micro_batch=2",
        "optim.warmup_steps=2", "train.log_every=1", "train.val_every=100", "checkpoint.every_steps=100",
        f"run_dir={tmp_path}", *extra,
    ]  # fmt: skip
    trainer = Trainer(load_recipe("qwen3-moe-tiny", overrides=overrides))
    try:
        result = trainer.run()
    finally:
        trainer.close()
    return result, [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_the_tiny_recipe_trains_through_the_trainer(tmp_path):
    result, metrics = _train(tmp_path, "train.max_steps=8")
    assert len(result.losses) == 8 and result.losses[-1] < result.losses[0] - 0.5, result.losses
    steps = [m for m in metrics if "loss" in m]  # the router's health beside each step's loss
    assert len(steps) == 8 and all(m["router_aux_loss"] > 0 and m["expert_load_max"] >= 1.0 for m in steps)


def test_the_trainers_loss_adds_the_aux_term_times_its_coefficient(tmp_path):
    with_aux, metrics = _train(tmp_path / "a", "train.max_steps=1", "model.router_aux_loss_coef=0.5")
    without, _ = _train(tmp_path / "b", "train.max_steps=1", "model.router_aux_loss_coef=0")
    difference = with_aux.losses[0] - without.losses[0]  # one micro-batch: its loss, its aux loss
    assert difference == pytest.approx(0.5 * metrics[0]["router_aux_loss"], rel=1e-4) and difference > 0.4


@pytest.mark.parametrize(
    ("recipe", "overrides", "message"),
    [
        ("qwen3-moe-tiny", ["model.num_experts_per_tok=9"], "num_experts_per_tok 9 must be 1 to model.num_experts 8"),
        ("qwen3-moe-tiny", ["model.mlp_only_layers=[4]"], r"mlp_only_layers \[4\] names layer\(s\) \[4\]; valid: 0"),
        ("qwen3-moe-tiny", ["model.moe_intermediate_size=0"], "model.moe_intermediate_size 0 must be > 0"),
        ("qwen3-moe-tiny", ["model.router_aux_loss_coef=-1"], "router_aux_loss_coef"),
        ("qwen3-moe-tiny", ["layout.pp=2"], "layout.pp 2 with model.num_experts 8: the load-balancing loss"),
        ("qwen3-moe-tiny", ["model.decoder_sparse_step=5"], "model.num_experts 8 but no block is sparse"),
        ("qwen3-tiny", ["model.num_experts_per_tok=2"], "model.num_experts_per_tok 2 is set with model.num_experts 0"),
        ("qwen3-tiny", ["model.mlp_only_layers=[0]"], r"model.mlp_only_layers \[0\] is set with model.num_experts 0"),
    ],
)  # fmt: skip
def test_bad_expert_fields_are_refused_naming_the_value(recipe, overrides, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe(recipe, overrides=overrides)


def test_the_dense_recipe_builds_no_sparse_block_and_counts_active_parameters():
    dense, moe = load_recipe("qwen3-tiny").model, load_recipe("qwen3-moe-tiny").model
    assert all(isinstance(layer.mlp, MLP) for layer in Qwen3(dense).layers) and Qwen3(dense).router_health() == {}
    assert dense.active_params() == dense.param_count()
    idle = 3 * (8 - 2) * 3 * 64 * 64  # 3 sparse blocks, 6 idle experts of 3 * hidden * 64 each
    assert moe.param_count() - moe.active_params() == idle and Qwen3(moe).num_params() == moe.param_count()


def test_plan_counts_qwen3_30b_a3b_total_and_active_parameters_and_flops_from_the_active():
    from trnrecipes.config.recipe import load_recipe
    from trnrecipes.plan.layout import plan
    from trnrecipes.plan.report import format_plan

    recipe = load_recipe("qwen3-30b-a3b-trn2", 16)
    p = plan(recipe)
    # the Qwen3 report's Qwen3-30B-A3B: 30.5B parameters, 3.3B activated (its figures cut to one decimal)
    assert 30.5e9 <= p["params"] < 30.6e9 and 3.3e9 <= p["active_params"] < 3.4e9
    m = recipe.model
    assert p["flops_per_token"] == 6 * p["active_params"] + 12 * m.num_layers * m.num_heads * m.head_dim * 4096
    assert p["memory"]["verdict"] != "does not fit"
    # a sparse block keeps its top-8 gathered rows, their outputs and the experts' SwiGLU: 76k elements a token
    # against the 43k of a dense block of ffn_hidden_size; so the recipe checkpoints whole blocks
    from trnrecipes.plan.memory import act_elements, moe_extra_elements

    assert act_elements(2048, 6144) + moe_extra_elements(m, False) == 9 * 2048 + 2 * 8 * 2048 + 4 * 8 * 768 + 128
    selective = plan(load_recipe("qwen3-30b-a3b-trn2", 16, ["model.activation_checkpointing=selective"]))
    assert selective["memory"]["verdict"] == "does not fit"
    assert selective["memory"]["activations"] > 1.7 * 48 * 4096 * 2 * act_elements(2048, 6144)
    assert "3,353,032,704 (3.35G) active per token" in format_plan(p, recipe)
    dense = plan(load_recipe("qwen3-8b-trn2", 1))
    assert "active_params" not in dense and "active per token" not in format_plan(dense)


@pytest.mark.slow
def test_make_eval_scores_a_qwen3_moe_checkpoint_through_its_hf_export(tmp_path):
    from test_train import run

    run("qwen3-moe-tiny", tmp_path / "run", steps=2)
    done = run_cli("eval", "run", "--ckpt", str(tmp_path / "run"), "--out", str(tmp_path / "eval"),
                   "--tasks", "arc_easy", "--limit", "2")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    config = json.loads((tmp_path / "eval/hf/config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["num_experts"] == 8
    results = json.loads((tmp_path / "eval/results.json").read_text())["results"]
    assert {(r["task"], r["metric"]) for r in results} == {("arc_easy", "acc"), ("arc_easy", "acc_norm")}
    assert all(0 <= r["value"] <= 1 for r in results)
    assert "| · arc_easy | 0 | acc |" in done.stdout
