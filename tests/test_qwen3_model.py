"""Qwen3 (recipes/qwen3/model.py) against real transformers Qwen3ForCausalLM (fp32, CPU, config-built models), its
HF conversion through the CLI, training through the Trainer, and what the family refuses."""

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

from recipes.qwen3.hf import args_from_hf_config, hf_config_from_args, state_dict_from_hf, state_dict_to_hf  # noqa: E402
from recipes.qwen3.model import Qwen3  # noqa: E402
from trnrecipes.checkpoint import read_model_checkpoint  # noqa: E402
from trnrecipes.config.recipe import RecipeError, load_recipe  # noqa: E402
from trnrecipes.parallel.activation_checkpointing import apply_activation_checkpointing  # noqa: E402
from trnrecipes.train.loop import Trainer  # noqa: E402

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
VOCAB, LAYERS, SEQ = 256, 2, 24
# (hidden, heads, kv_heads, head_dim, ffn): head_dim above and below hidden / heads, GQA 4/2 and 8/2, MHA
SHAPES = [
    pytest.param(64, 4, 2, 32, 96, id="gqa4/2-hd32-of-64"),
    pytest.param(64, 8, 2, 8, 120, id="gqa8/2-hd8-of-64"),
    pytest.param(48, 4, 4, 12, 64, id="mha-hd12"),
]


def hf_config(hidden=64, heads=4, kv=2, head_dim=32, ffn=96, tied=False, vocab=VOCAB):
    return transformers.Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=LAYERS,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim, max_position_embeddings=64,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=tied, initializer_range=0.1, attn_implementation="eager",
    )  # fmt: skip


def randomized_norms(model):
    """HF inits norms to 1; random ones catch a misplaced norm (q/k too)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def hf_model(seed=0, **shape):
    torch.manual_seed(seed)
    return randomized_norms(transformers.Qwen3ForCausalLM(hf_config(**shape)).eval())


def ours_from_hf(model) -> Qwen3:
    args = args_from_hf_config(model.config.to_dict())
    ours = Qwen3(args).eval()
    ours.load_state_dict(state_dict_from_hf(model.state_dict(), args), strict=True)
    return ours


def hidden_states(model: Qwen3, tokens) -> list:
    """As transformers' output_hidden_states: the embedding, each block's output but the last, the final norm's."""
    x, states = model.embed(tokens), []
    for layer in model.layers:
        states.append(x)
        x = layer(x)
    return [*states, model.norm(x)]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize(("hidden", "heads", "kv", "head_dim", "ffn"), SHAPES)
def test_logits_loss_and_hidden_states_match_hf(hidden, heads, kv, head_dim, ffn, tied):
    hf = hf_model(hidden=hidden, heads=heads, kv=kv, head_dim=head_dim, ffn=ffn, tied=tied)
    ours = ours_from_hf(hf)
    assert (ours.args.head_dim, ours.args.num_kv_heads, ours.args.tie_embeddings) == (head_dim, kv, tied)
    assert ours.num_params() == sum(p.numel() for p in hf.parameters()) == ours.args.param_count()
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    labels = torch.cat([tokens[:, 1:], torch.full((2, 1), -100)], dim=1)  # ours takes them shifted
    with torch.no_grad():
        ref = hf(tokens, labels=tokens, output_hidden_states=True)
        logits, loss, states = ours(tokens), ours(tokens, labels), hidden_states(ours, tokens)
    torch.testing.assert_close(logits, ref.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, ref.loss, rtol=1e-6, atol=1e-6)
    assert len(states) == len(ref.hidden_states)
    for got, want in zip(states, ref.hidden_states, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_state_dicts_convert_bit_exact_both_ways_and_a_fresh_hf_model_loads_ours(tied):
    hf = hf_model(tied=tied)
    ours = ours_from_hf(hf)
    assert ("head.weight" in ours.state_dict()) is not tied  # a tied model holds its one tensor once
    back = state_dict_to_hf(ours.state_dict(), ours.args)
    expected = {k: v for k, v in hf.state_dict().items() if not (tied and k == "lm_head.weight")}
    assert back.keys() == expected.keys()
    assert all(torch.equal(back[k], v) for k, v in expected.items())
    config = transformers.Qwen3Config(**hf_config_from_args(ours.args), attn_implementation="eager")
    fresh = transformers.Qwen3ForCausalLM(config).eval()
    fresh.load_state_dict(back, strict=not tied)  # tied: lm_head.weight is the embedding, not a key of its own
    assert torch.equal(fresh.lm_head.weight, hf.lm_head.weight)
    tokens = torch.randint(0, VOCAB, (2, SEQ))
    with torch.no_grad():
        assert torch.equal(fresh(tokens).logits, hf(tokens).logits)


def test_a_tied_checkpoint_whose_head_differs_is_refused():
    hf = hf_model(tied=True)
    args = args_from_hf_config(hf.config.to_dict())
    sd = dict(hf.state_dict()) | {"lm_head.weight": torch.zeros(VOCAB, 64)}
    with pytest.raises(ValueError, match=r"lm_head\.weight differs from model\.embed_tokens\.weight"):
        state_dict_from_hf(sd, args)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"attention_bias": True}, "attention_bias=true"),
        ({"use_sliding_window": True}, "use_sliding_window=true"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, "rope_type 'yarn'"),
    ],
)
def test_unsupported_configs_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        args_from_hf_config(hf_config().to_dict() | change)


@pytest.mark.parametrize("mode", ["selective", "elementwise", "full"])
def test_activation_checkpointing_gives_the_same_loss_and_grads(mode):
    reference = ours_from_hf(hf_model()).train()
    model = copy.deepcopy(reference)
    apply_activation_checkpointing(model, mode)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    losses = []
    for m in (reference, model):
        loss = m(tokens, tokens)
        loss.backward()
        losses.append(loss)
    assert torch.equal(losses[0], losses[1])
    for (name, p), q in zip(reference.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_directory_converts_bit_exact_both_ways_through_the_cli(tied, tmp_path):
    torch.manual_seed(0)
    original = transformers.Qwen3ForCausalLM(hf_config(tied=tied, vocab=4096))
    save_random(original, tmp_path / "hf")
    done = run_cli("convert", "from-hf", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt"), env=OFFLINE)
    assert done.returncode == 0, done.stderr
    recipe, state, _ = read_model_checkpoint(tmp_path / "ckpt")
    assert recipe.name == "qwen3-tiny" and recipe.model.tie_embeddings is tied and recipe.model.head_dim == 32
    assert ("head.weight" in state) is not tied

    done = run_cli("convert", "to-hf", "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"), env=OFFLINE)
    assert done.returncode == 0, done.stderr
    before, after = load_file(tmp_path / "hf/model.safetensors"), load_file(tmp_path / "out/model.safetensors")
    assert before.keys() == after.keys() and ("lm_head.weight" in after) is not tied
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert json.loads((tmp_path / "out/config.json").read_text())["tie_word_embeddings"] is tied
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    tokens = torch.randint(0, 4096, (2, 20))
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, original.eval()(tokens).logits)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_tiny_recipe_trains_through_the_trainer(tied, tmp_path):
    overrides = [
        "cluster.workers_per_node=1", "batch.seq_len=64", "batch.global_batch=4", "batch.micro_batch=2",
        "train.max_steps=8", "optim.warmup_steps=2", "train.log_every=1", "train.val_every=8",
        f"model.tie_embeddings={str(tied).lower()}", "checkpoint.every_steps=8", f"run_dir={tmp_path}",
    ]  # fmt: skip
    trainer = Trainer(load_recipe("qwen3-tiny", overrides=overrides))
    try:
        result = trainer.run()
    finally:
        trainer.close()
    assert len(result.losses) == 8 and result.losses[-1] < result.losses[0] - 0.5, result.losses
    (ckpt,) = result.checkpoints
    recipe, state, _ = read_model_checkpoint(ckpt)
    assert recipe.model.tie_embeddings is tied and ("head.weight" in state) is not tied


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.tie_embeddings=true", "layout.tp=2"], "layout.tp 2 with model.tie_embeddings true"),
        (["model.tie_embeddings=true", "layout.pp=2"], "layout.pp 2 with model.tie_embeddings true"),
        (["model.tie_embeddings=true", "layout.fsdp=true"], "layout.fsdp true with model.tie_embeddings true"),
        (["model.num_kv_heads=1", "layout.tp=2"], "layout.tp 2 must divide model.num_kv_heads 1"),
    ],
)
def test_what_the_family_does_not_run_with_is_refused_by_the_recipe_check(overrides, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe("qwen3-tiny", overrides=overrides)


def test_tp_wider_than_the_kv_heads_is_told_the_rule_alone():
    # qwen3 never replicates KV heads: what replication is not built with (FSDP here) would be a second, false reason
    with pytest.raises(RecipeError) as err:
        load_recipe("qwen3-tiny", overrides=["model.num_kv_heads=1", "layout.tp=2", "layout.fsdp=true"])
    assert (
        str(err.value)
        == "recipe qwen3-tiny.yaml: layout.tp 2 must divide model.num_kv_heads 1 (each rank holds whole KV groups)"
    )


def test_the_nxd_path_refuses_the_family():
    over = ["cluster.instance=trn1.32xlarge", "cluster.backend=neuron", "cluster.neuron_sdk=2.28", "compile.steps=2"]
    with pytest.raises(RecipeError, match=r"model\.family qwen3 runs on TorchNeuron .* not on torch-xla \+ NxD"):
        load_recipe("qwen3-tiny", overrides=over)


def test_the_spec_counts_a_tied_head_once():
    cfg = load_recipe("qwen3-tiny").model
    tied = dataclasses.replace(cfg, tie_embeddings=True)
    assert cfg.param_count() - tied.param_count() == cfg.vocab_size * cfg.hidden_size
    assert Qwen3(tied).num_params() == tied.param_count()


@pytest.mark.slow
def test_tp2_through_the_trainer_equals_tp1(tmp_path):
    """The training build at TP 2 (sharded init, the q/k norms replicated with their gradients summed, the
    vocab-parallel loss) against TP 1: the first step's gradients and the weights after three steps."""
    from test_train import _torchrun

    common = ["batch.seq_len=32", "batch.global_batch=4", "batch.micro_batch=2", "optim.clip_grad_norm=0",
              "optim.eps=1e-4"]  # fmt: skip
    tp1 = _torchrun(tmp_path, "qwen3-tiny", [*common, "cluster.workers_per_node=1"], 1)
    tp2 = _torchrun(tmp_path, "qwen3-tiny", [*common, "cluster.workers_per_node=2", "layout.tp=2"], 2)
    assert any("q_norm" in name for name in tp1["grads"])
    for name, grad in tp1["grads"].items():
        torch.testing.assert_close(tp2["grads"][name], grad, rtol=2e-4, atol=2e-6, msg=name)
    for name, p in tp1["params"].items():
        torch.testing.assert_close(tp2["params"][name], p, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("key", ["model.head_dim", "model.tie_embeddings"])
def test_the_shape_keys_of_the_family_cannot_change_on_resume(key):
    from trnrecipes.config.changes import check_allow_changes

    assert "covers the model's shape" in check_allow_changes([key])[0]
