"""BERT (recipes/bert) against real transformers BertModel / BertForSequenceClassification: fp32, CPU, random
config-built models, padded batches with token types; HF state dicts and configs both ways; the published sizes;
the "mlp" (M5) head; and the family contract that tests/test_families.py checks for registered families."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import typing

import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import REPO
from safetensors.torch import save_file

from recipes.bert import hf
from recipes.bert.model import Bert, BertArgs, EncoderCoreAttention, mean_pool
from recipes.bert.spec import SPEC
from trnrecipes.parallel.activation_checkpointing import apply_activation_checkpointing

torch.set_num_threads(2)
VOCAB, SEQ = 97, 17


def hf_config(hidden=64, heads=4, **kw) -> transformers.BertConfig:
    return transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=heads, intermediate_size=96,
        max_position_embeddings=40, type_vocab_size=3, num_labels=3, **kw,
    )  # fmt: skip


def randomised(model):
    torch.manual_seed(0)
    with torch.no_grad():  # everything random, norms and biases included, so no term can hide
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model.eval()


def batch(seed=1):
    """Tokens, a padding mask with real padding (rows of 17, 10 and 5 tokens) and token types from 3 segments."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, VOCAB, (3, SEQ), generator=gen)
    mask = torch.ones_like(tokens)
    mask[1, 10:] = mask[2, 5:] = 0
    tokens = tokens.masked_fill(mask == 0, 0)  # the pad id
    return tokens, mask, torch.randint(0, 3, tokens.shape, generator=gen)


def small(**fields) -> BertArgs:
    """Our config at hf_config's sizes (3 token types, as batch() uses)."""
    sizes = dict(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4, ffn_hidden_size=96, max_seq_len=40)
    return BertArgs(**(sizes | {"type_vocab_size": 3} | fields))


def ours_from(reference) -> Bert:
    args = hf.args_from_hf_config(reference.config.to_dict())
    ours = Bert(args).eval()
    ours.load_state_dict(hf.state_dict_from_hf(reference.state_dict(), args), strict=True)
    return ours


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("hidden", "heads", "attn"), [(64, 4, "eager"), (96, 3, "sdpa"), (48, 12, "eager")])
def test_classification_logits_hidden_states_and_loss_equal_hf(hidden, heads, attn):
    reference = randomised(
        transformers.BertForSequenceClassification(hf_config(hidden, heads, attn_implementation=attn))
    )
    assert reference.config._attn_implementation == attn
    ours = ours_from(reference)
    tokens, mask, types = batch()
    labels = torch.tensor([0, 2, 1])
    with torch.no_grad():
        base = reference.bert(tokens, attention_mask=mask, token_type_ids=types)
        close(ours.hidden_states(tokens, mask, types), base.last_hidden_state)
        close(ours.encode(tokens, mask, types), base.pooler_output)
        want = reference(tokens, attention_mask=mask, token_type_ids=types, labels=labels)
        close(ours(tokens, mask, types), want.logits)
        close(ours(tokens, mask, types, labels=labels), want.loss)
        # The mask and the token types both matter here, so the parity above covers them.
        assert not torch.allclose(ours(tokens, None, types)[1:], want.logits[1:], atol=1e-3)
        assert not torch.allclose(ours(tokens, mask)[1:], want.logits[1:], atol=1e-3)


def test_bert_model_checkpoint_imports_with_a_new_classifier():
    """all-MiniLM-L6-v2's layout: a bare BertModel, pooler but no classifier."""
    reference = randomised(transformers.BertModel(hf_config()))
    args = hf.args_from_hf_config(reference.config.to_dict())
    with pytest.warns(UserWarning, match="has no classifier.bias, classifier.weight: initialised"):
        state = hf.state_dict_from_hf(reference.state_dict(), args)
    ours = Bert(args).eval()
    ours.load_state_dict(state, strict=True)
    tokens, mask, types = batch()
    with torch.no_grad():
        want = reference(tokens, attention_mask=mask, token_type_ids=types)
        close(ours.hidden_states(tokens, mask, types), want.last_hidden_state)
        close(ours.encode(tokens, mask, types), want.pooler_output)
    fresh = Bert(args)
    fresh.init_weights(seed=hf.HEAD_INIT_SEED)  # the new head is what init_weights draws
    assert torch.equal(state["head.classifier.weight"], fresh.head.classifier.weight)
    assert torch.all(state["head.classifier.bias"] == 0)


def test_pretraining_checkpoint_with_old_names_imports():
    """bert-base-uncased's layout: "bert." prefix, LayerNorm gamma/beta, masked-LM and NSP heads ("cls.*")."""
    reference = randomised(transformers.BertForPreTraining(hf_config()))
    sd = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
          for k, v in reference.state_dict().items()}  # fmt: skip
    assert any(k.startswith("cls.") for k in sd) and any(k.endswith("gamma") for k in sd)
    args = hf.args_from_hf_config(reference.config.to_dict())
    with pytest.warns(UserWarning, match="classifier"):
        ours = Bert(args).eval()
        ours.load_state_dict(hf.state_dict_from_hf(sd, args))
    tokens, mask, types = batch()
    with torch.no_grad():
        close(ours.hidden_states(tokens, mask, types), reference.bert(tokens, mask, types).last_hidden_state)


def test_state_dicts_round_trip_exactly_and_the_export_loads_strict():
    reference = randomised(transformers.BertForSequenceClassification(hf_config()))
    args = hf.args_from_hf_config(reference.config.to_dict())
    sd = reference.state_dict()
    back = hf.state_dict_to_hf(hf.state_dict_from_hf(sd, args), args)
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)

    ours = Bert(args).eval()
    ours.init_weights(seed=3)
    again = hf.state_dict_from_hf(hf.state_dict_to_hf(ours.state_dict(), args), args)
    assert all(torch.equal(again[k], v) for k, v in ours.state_dict().items())
    fresh = transformers.BertForSequenceClassification(transformers.BertConfig(**hf.hf_config_from_args(args)))
    fresh.load_state_dict(hf.state_dict_to_hf(ours.state_dict(), args), strict=True)
    tokens, mask, types = batch()
    with torch.no_grad():
        close(fresh.eval()(tokens, attention_mask=mask, token_type_ids=types).logits, ours(tokens, mask, types))


def test_config_round_trips_through_transformers_for_both_heads():
    args = small(pad_token_id=1, norm_eps=1e-7, init_std=0.03, dropout=0.2, attention_dropout=0.05,
                 classifier_dropout=0.3, num_labels=5)  # fmt: skip
    mlp = dataclasses.replace(args, head="mlp", pooling="mean", mlp_hidden_sizes=(32, 16))
    for a in (args, mlp):
        assert hf.args_from_hf_config(hf.hf_config_from_args(a)) == a
        through_hf = transformers.BertConfig(**hf.hf_config_from_args(a)).to_dict()
        assert hf.args_from_hf_config(json.loads(json.dumps(through_hf))) == a


def test_export_dir_loads_in_auto_model_for_sequence_classification(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    args = hf.args_from_hf_config(hf_config().to_dict())
    ours = Bert(args).eval()
    ours.init_weights(seed=5)
    save_file(hf.state_dict_to_hf(ours.state_dict(), args), tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(hf.hf_config_from_args(args)))
    loaded = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    assert type(loaded) is transformers.BertForSequenceClassification
    tokens, mask, types = batch()
    with torch.no_grad():
        close(loaded(tokens, attention_mask=mask, token_type_ids=types).logits, ours(tokens, mask, types))


def test_mlp_head_export_loads_its_encoder_in_auto_model_and_comes_back(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = small(head="mlp", pooling="mean", mlp_hidden_sizes=(32,), num_labels=4)
    ours = Bert(args).eval()
    ours.init_weights(seed=6)
    exported = hf.state_dict_to_hf(ours.state_dict(), args)
    save_file(exported, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(hf.hf_config_from_args(args)))
    loaded = transformers.AutoModel.from_pretrained(tmp_path).eval()
    tokens, mask, types = batch()
    with torch.no_grad():
        close(loaded(tokens, attention_mask=mask, token_type_ids=types).last_hidden_state,
              ours.hidden_states(tokens, mask, types))  # fmt: skip
    back = hf.state_dict_from_hf(exported, hf.args_from_hf_config(json.loads((tmp_path / "config.json").read_text())))
    assert all(torch.equal(back[k], v) for k, v in ours.state_dict().items())


MINILM = {  # sentence-transformers/all-MiniLM-L6-v2's config.json as published
    "architectures": ["BertModel"], "attention_probs_dropout_prob": 0.1, "gradient_checkpointing": False,
    "hidden_act": "gelu", "hidden_dropout_prob": 0.1, "hidden_size": 384, "initializer_range": 0.02,
    "intermediate_size": 1536, "layer_norm_eps": 1e-12, "max_position_embeddings": 512, "model_type": "bert",
    "num_attention_heads": 12, "num_hidden_layers": 6, "pad_token_id": 0, "position_embedding_type": "absolute",
    "transformers_version": "4.8.2", "type_vocab_size": 2, "use_cache": True, "vocab_size": 30522,
}  # fmt: skip
BERT_BASE = MINILM | {"hidden_size": 768, "num_hidden_layers": 12, "intermediate_size": 3072}


@pytest.mark.parametrize(("cfg", "published"), [(BERT_BASE, 109_482_240), (MINILM, 22_713_216)])
def test_published_parameter_counts(cfg, published):
    args = hf.args_from_hf_config(cfg)
    assert (args.num_labels, args.norm_eps, args.max_seq_len, args.type_vocab_size) == (2, 1e-12, 512, 2)
    classifier = args.hidden_size * 2 + 2  # BertModel's count includes the pooler, not the classifier
    assert args.param_count() - classifier == published
    with torch.device("meta"):
        assert Bert(args).num_params() == args.param_count()
        assert sum(p.numel() for p in transformers.BertModel(transformers.BertConfig(**cfg)).parameters()) == published


def test_mlp_head_shape_count_pooling_and_loss():
    args = small(head="mlp", pooling="mean", mlp_hidden_sizes=(48, 24), num_labels=6)
    model = Bert(args).eval()
    model.init_weights(seed=0)
    assert model.num_params() == args.param_count()
    assert args.norm_head_params() == (64 * 48 + 48) + (48 * 24 + 24) + (24 * 6 + 6)
    tokens, mask, types = batch()
    with torch.no_grad():
        logits = model(tokens, mask, types)
        assert logits.shape == (3, 6)
        hidden = model.hidden_states(tokens, mask, types)
        torch.testing.assert_close(model.encode(tokens, mask, types), mean_pool(hidden, mask))
        assert torch.allclose(model.encode(tokens, mask, types)[2], hidden[2, :5].mean(0), atol=1e-6)
        # What sits under the padding never reaches the logits (keys are masked, the mean skips them).
        other = tokens.masked_fill(mask == 0, 7)
        torch.testing.assert_close(model(other, mask, types), logits, rtol=0, atol=1e-6)
        labels = torch.tensor([0, 5, 3])
        torch.testing.assert_close(model(tokens, mask, types, labels=labels), F.cross_entropy(logits, labels))
    with pytest.raises(ValueError, match=r"labels must be one class id per sequence, shape \(3,\); got \(3, 17\)"):
        model(tokens, mask, labels=tokens)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_activation_checkpointing_changes_nothing_but_memory(mode):
    args = small()
    base, other = Bert(args), Bert(args)
    base.init_weights(seed=0)
    other.load_state_dict(base.state_dict())
    apply_activation_checkpointing(other, mode)  # selective finds EncoderCoreAttention, a CoreAttention
    tokens, mask, types = batch()
    grads = []
    for model in (base, other):
        torch.manual_seed(9)  # the same dropout masks: recomputation replays the RNG
        model.train()(tokens, mask, types, labels=torch.tensor([0, 1, 1])).backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_init_is_berts_and_seeded():
    args = BertArgs(vocab_size=512, hidden_size=256, num_layers=2, num_heads=4, ffn_hidden_size=1024, max_seq_len=64)
    model = Bert(args)
    model.init_weights(seed=0)
    layer = model.layers[1]
    for w in (model.embed.word.weight, layer.attn.qkv.weight, layer.mlp.fc_out.weight, model.head.pooler.weight):
        assert w.std().item() == pytest.approx(0.02, rel=0.05)  # no depth scaling, as HF's BERT
    assert torch.all(layer.attn_norm.weight == 1) and torch.all(layer.attn.qkv.bias == 0)
    again = Bert(args)
    again.init_weights(seed=0)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True))


def test_clear_errors_for_unsupported_configs_and_state_dicts():
    base = hf_config().to_dict()
    for change, message in [
        ({"hidden_act": "relu"}, "hidden_act 'relu'"),
        ({"position_embedding_type": "relative_key"}, "position_embedding_type 'relative_key'"),
        ({"problem_type": "regression"}, "problem_type 'regression'"),
        ({"id2label": {"0": "score"}}, "model.num_labels 1"),
        ({hf.HEAD_KEY: {"kind": "ffn"}}, "trnrecipes_head"),
        # a string is no list of sizes: it was read as '6', '4' and told 'expected an integer, got '6''
        ({hf.HEAD_KEY: {"kind": "mlp", "hidden_sizes": "64"}}, 'hidden_sizes must be a list of integers, got "64"'),
    ]:
        with pytest.raises(ValueError, match=message):
            hf.args_from_hf_config(base | change)
    with pytest.raises(ValueError, match="lacks vocab_size"):
        hf.args_from_hf_config({"model_type": "bert"})
    reference = transformers.BertForSequenceClassification(hf_config())
    args = hf.args_from_hf_config(reference.config.to_dict())
    sd = reference.state_dict() | {"bert.encoder.layer.9.output.dense.weight": torch.zeros(1)}
    with pytest.raises(ValueError, match=r"unknown \['encoder.layer.9.output.dense.weight'\]"):
        hf.state_dict_from_hf(sd, args)
    with pytest.raises(ValueError, match="wrong shapes"):
        hf.state_dict_from_hf(sd | {"bert.pooler.dense.bias": torch.zeros(3)}, dataclasses.replace(args, num_layers=9))


# ---- the family contract (tests/test_families.py runs it once the family is registered in
# trnrecipes/config/families.py)

CONTRACT = [
    BertArgs(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4, ffn_hidden_size=256, max_seq_len=128),
    BertArgs(vocab_size=VOCAB, hidden_size=64, num_layers=3, num_heads=4, ffn_hidden_size=256, max_seq_len=64,
             head="mlp", pooling="cls", mlp_hidden_sizes=(32, 8), num_labels=7),
]  # fmt: skip


@pytest.mark.parametrize("cfg", CONTRACT, ids=["classification", "mlp"])
def test_contract_part_counts_plan_and_tp_rule(cfg):
    with torch.device("meta"):
        model = Bert(cfg)
    parts = SPEC.parts

    def count(*modules) -> int:
        return sum(p.numel() for m in modules for p in m.parameters())

    assert count(getattr(model, parts.embedding)) == cfg.embedding_params()
    assert all(count(layer) == cfg.layer_params() for layer in getattr(model, parts.layers))
    assert count(getattr(model, parts.norm), getattr(model, parts.head)) == cfg.norm_head_params()
    assert model.num_params() == cfg.param_count() and cfg.flops_per_token(cfg.max_seq_len) > 6 * cfg.param_count()
    plan = SPEC.parallel_plan
    for path in plan.COLUMN_PARALLEL + plan.ROW_PARALLEL:
        assert isinstance(model.layers[0].get_submodule(path), torch.nn.Linear), path
    for path in plan.NORMS + plan.BRANCHES:
        model.layers[0].get_submodule(path)
    assert isinstance(model.layers[0].attn.core, EncoderCoreAttention)
    assert cfg.problems() == [] and cfg.tp_problems(1) == cfg.tp_problems(2) == cfg.tp_problems(4) == []
    assert cfg.tp_problems(3) == [
        "layout.tp 3 must divide model.num_heads 4",
        "layout.tp 3 must divide model.ffn_hidden_size 256",
    ]
    with pytest.raises(ValueError, match=r"layout\.tp 8 must divide model\.num_heads 4"):
        plan.check_tensor_parallel(cfg, 8)


def test_contract_bounds_problems_and_torch_free_spec():
    hints = typing.get_type_hints(SPEC.config)
    numeric = {n for n, tp in hints.items() if tp in (int, float) or set(typing.get_args(tp)) & {int, float}}
    assert sorted(SPEC.bounds) == sorted(numeric)
    assert dataclasses.fields(SPEC.config)[0].name == "family"
    cfg = CONTRACT[0]
    bad = dataclasses.replace(cfg, pooling="mean", mlp_hidden_sizes=(8,), num_labels=1, pad_token_id=VOCAB)
    assert bad.problems() == [
        f"model.pad_token_id {VOCAB} must be below vocab_size {VOCAB}",
        "model.num_labels 1: the loss is cross-entropy over classes, so at least 2 (regression is not supported)",
        "model.pooling 'mean' needs model.head 'mlp': the classification head is BERT's pooler, which reads the"
        " first ([CLS]) token",
        "model.mlp_hidden_sizes [8] needs model.head 'mlp' (head is 'classification')",
    ]
    assert dataclasses.replace(cfg, num_heads=5).problems() == ["model.hidden_size 64 is not divisible by num_heads 5"]
    code = "import sys, recipes.bert.spec; assert 'torch' not in sys.modules, 'torch'"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
