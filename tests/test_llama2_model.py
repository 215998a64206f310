"""Llama2 (recipes/llama2/model.py) against real transformers LlamaForCausalLM: fp32, CPU, config-built models."""

from __future__ import annotations

import copy
import json
import math

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from torch import nn  # noqa: E402

from recipes.llama2.hf import (  # noqa: E402
    args_from_hf_config,
    hf_config_from_args,
    state_dict_from_hf,
    state_dict_to_hf,
)
from recipes.llama2.model import Llama2, Llama2Args  # noqa: E402
from trnrecipes.parallel.activation_checkpointing import apply_activation_checkpointing  # noqa: E402

# (hidden, heads, kv_heads, ffn, rope_theta): MHA, GQA 8/2, MQA-ish 4/1; head dims 16 and 32; an odd FFN width.
SHAPES = [
    pytest.param(64, 4, 4, 172, 10000.0, id="mha-hd16"),
    pytest.param(256, 8, 2, 384, 10000.0, id="gqa8/2-hd32"),
    pytest.param(64, 4, 1, 96, 500000.0, id="gqa4/1-hd16-theta5e5"),
    pytest.param(128, 4, 2, 200, 10000.0, id="gqa4/2-hd32"),
]
VOCAB, LAYERS, SEQ = 256, 2, 24


# Llama 3.1's rope scaling at a toy context: with head_dim 16 and theta 500,000 the wavelengths run from 6 to 6e5
# positions, so an original context of 32 puts some below high_freq_wavelen (8: kept), some between (smoothed) and the
# rest above low_freq_wavelen (32: divided by the factor).
LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}  # fmt: skip


def hf_model(hidden, heads, kv, ffn, theta, attn="eager", seed=0, rope=None):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=LAYERS,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_parameters=rope or {"rope_type": "default", "rope_theta": theta},
        initializer_range=0.1,  # larger than 0.02 so attention is far from uniform and the test has teeth
        attn_implementation=attn,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # HF inits norms to 1; random ones catch a misplaced norm weight
                p.uniform_(0.5, 1.5)
    return model


def ours_from_hf(model) -> tuple[Llama2, Llama2Args]:
    args = args_from_hf_config(model.config.to_dict())
    ours = Llama2(args).eval()
    ours.load_state_dict(state_dict_from_hf(model.state_dict(), args), strict=True)
    return ours, args


def max_rel_err(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize(("hidden", "heads", "kv", "ffn", "theta"), SHAPES)
def test_logits_match_hf_both_ways(hidden, heads, kv, ffn, theta):
    hf = hf_model(hidden, heads, kv, ffn, theta)
    ours, args = ours_from_hf(hf)
    assert (args.num_heads, args.num_kv_heads, args.rotary_base) == (heads, kv, theta)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(tokens).logits
        got = ours(tokens)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert max_rel_err(got, ref) < 1e-5

    # ours -> HF: a fresh HF model (strict load) gives the same logits, and the round trip is bit-exact.
    back = state_dict_to_hf(ours.state_dict(), args)
    hf_sd = {k: v for k, v in hf.state_dict().items()}
    assert back.keys() == hf_sd.keys()
    for k, v in hf_sd.items():
        assert torch.equal(back[k], v), k
    fresh = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config_from_args(args))).eval()
    fresh.load_state_dict(back, strict=True)
    with torch.no_grad():
        torch.testing.assert_close(fresh(tokens).logits, ref, rtol=1e-5, atol=1e-5)


def test_llama3_rope_scaling_matches_hf_logits_loss_and_hidden_states():
    """Llama 3.1's shape in small: GQA 8/2, theta 500,000 with rope_type llama3 (every frequency regime in use: see
    LLAMA3_ROPE), an untied head. Logits, the loss and every hidden state equal transformers'; plain RoPE would not."""
    hf = hf_model(128, 8, 2, 200, 500000.0, rope=LLAMA3_ROPE)
    ours, args = ours_from_hf(hf)
    assert args.rope_scaling is not None and args.rope_scaling.original_max_seq_len == 32
    assert (args.rotary_base, args.rope_scaling.factor) == (500000.0, 8.0)
    tokens = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf(tokens, labels=tokens, output_hidden_states=True)
        x = ours.embed(tokens)
        states = [x]
        for layer in ours.layers:
            x = layer(x)
            states.append(x)
        states[-1] = ours.norm(x)  # transformers' last hidden state is after the final norm
        labels = torch.cat([tokens[:, 1:], torch.full((2, 1), -100)], dim=1)
        loss = ours(tokens, labels=labels)
        logits = ours(tokens)
    assert len(ref.hidden_states) == len(states)
    for got, want in zip(states, ref.hidden_states, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, ref.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, ref.loss, rtol=1e-6, atol=1e-6)
    plain, _ = ours_from_hf(hf_model(128, 8, 2, 200, 500000.0))  # the same weights (seed 0), no rope scaling
    with torch.no_grad():
        assert max_rel_err(plain(tokens), ref.logits) > 1e-3  # the scaling is what made them equal
    back = state_dict_to_hf(ours.state_dict(), args)
    assert all(torch.equal(back[k], v) for k, v in hf.state_dict().items())  # to-hf: bit-exact


def test_llama3_config_json_as_meta_ships_it_and_as_transformers_5_writes_it():
    """Meta's Llama 3.1 config.json (transformers 4: rope_scaling + top-level rope_theta) and transformers 5's
    (rope_parameters) read as the same model; ours writes both spellings, and transformers reads ours back."""
    meta = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "hidden_act": "silu",
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "bos_token_id": 128000,
        "eos_token_id": 128001, "torch_dtype": "bfloat16",
    }  # fmt: skip
    args = args_from_hf_config(meta)
    assert (args.vocab_size, args.num_kv_heads, args.rotary_base, args.max_seq_len) == (128256, 8, 500000.0, 131072)
    assert args.rope_scaling.original_max_seq_len == 8192 and args.rope_scaling.high_freq_factor == 4.0
    assert args.param_count() == 8_030_261_248  # Llama 3.1 8B, as Meta gives it
    written = hf_config_from_args(args)
    assert (written["bos_token_id"], written["eos_token_id"]) == (128000, 128001)
    cfg = transformers.LlamaConfig(**written)
    assert cfg.rope_parameters["rope_type"] == "llama3" and cfg.rope_parameters["factor"] == 8.0
    assert args_from_hf_config(cfg.to_dict()) == args
    assert args_from_hf_config({k: v for k, v in written.items() if k != "rope_parameters"}) == args


def test_matches_hf_sdpa_attention_too():
    hf = hf_model(256, 8, 2, 384, 10000.0, attn="sdpa")
    ours, _ = ours_from_hf(hf)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, rtol=1e-5, atol=1e-5)


def test_greedy_generation_matches_hf():
    hf = hf_model(128, 4, 2, 200, 10000.0)
    ours, _ = ours_from_hf(hf)
    prompt = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    # min_new_tokens keeps HF from stopping early if it happens to emit the eos id (2).
    ref = hf.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    tokens = prompt
    with torch.no_grad():
        for _ in range(8):  # no KV cache: recompute the whole sequence each step
            tokens = torch.cat([tokens, ours(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert tokens.tolist() == ref.tolist()


def test_config_round_trip_through_transformers():
    args = Llama2Args(
        vocab_size=100,
        hidden_size=64,
        num_layers=3,
        num_heads=8,
        num_kv_heads=2,
        ffn_hidden_size=96,
        max_seq_len=128,
        rotary_base=123456.0,
        norm_eps=1e-6,
        init_std=0.01,
    )
    cfg = transformers.LlamaConfig(**hf_config_from_args(args))
    assert cfg.rope_parameters == {"rope_type": "default", "rope_theta": 123456.0}
    assert args_from_hf_config(cfg.to_dict()) == args
    # transformers 4 style (top-level rope_theta, no rope_parameters) reads the same.
    legacy = {k: v for k, v in hf_config_from_args(args).items() if k != "rope_parameters"}
    assert args_from_hf_config(legacy) == args


def llama3(factor: float, original: int | None = 64, **more) -> dict:
    """Llama 3's rope scaling dict; a key given None (original, rope_type) left out."""
    rope = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    rope |= ({"original_max_position_embeddings": original} if original else {}) | more
    return {k: v for k, v in rope.items() if v is not None}  # rope_type=None: without it


# config.json's RoPE keys alone and disagreeing (transformers 4's rope_scaling and top-level rope_theta, 5's
# rope_parameters), each read by ours as by transformers.
ROPE_KEYS = {
    "rope_theta alone": {"rope_theta": 123.0},
    "rope_parameters alone": {"rope_parameters": {"rope_type": "default", "rope_theta": 77.0}},
    "rope_scaling alone": {"rope_scaling": llama3(8.0)},
    "rope_scaling alone, 4.x's 'type'": {"rope_scaling": {"type": "llama3", **llama3(8.0, rope_type=None)}},
    "neither": {},
    "rope_parameters' theta vs top-level": {"rope_theta": 500000.0,
                                            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    "top-level theta vs rope_parameters'": {"rope_theta": 10000.0,
                                            "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
    "top-level theta, rope_parameters without": {"rope_theta": 500000.0, "rope_parameters": {"rope_type": "default"}},
    "rope_scaling llama3 vs rope_parameters default": {
        "rope_theta": 5.0, "rope_scaling": llama3(8.0), "rope_parameters": {"rope_type": "default", "rope_theta": 9.0}},
    "rope_scaling default vs rope_parameters llama3": {
        "rope_scaling": {"rope_type": "default"}, "rope_parameters": llama3(32.0, rope_theta=9.0)},
    "rope_scaling vs rope_parameters, both llama3": {
        "rope_theta": 5.0, "rope_scaling": llama3(8.0, 64), "rope_parameters": llama3(32.0, 128, rope_theta=9.0)},
    "rope_scaling's theta vs top-level": {"rope_theta": 5.0, "rope_scaling": llama3(8.0, rope_theta=11.0)},
    "rope_scaling null": {"rope_scaling": None, "rope_parameters": llama3(32.0, rope_theta=9.0)},
    "llama3 without original_max_position_embeddings": {
        "original_max_position_embeddings": 128, "rope_parameters": llama3(8.0, None, rope_theta=3.0)},
}  # fmt: skip


@pytest.mark.parametrize("keys", ROPE_KEYS.values(), ids=ROPE_KEYS.keys())
def test_rope_keys_read_as_transformers_reads_them(keys, tmp_path):
    """Where config.json's rope_theta, rope_scaling and rope_parameters disagree, transformers 5 takes a non-empty
    rope_scaling whole over rope_parameters, and the chosen dict's rope_theta over the top-level one: so do we."""
    config = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 256, **keys}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    theirs = transformers.AutoConfig.from_pretrained(tmp_path).rope_parameters
    ours = args_from_hf_config(json.loads((tmp_path / "config.json").read_text()))
    assert ours.rotary_base == theirs["rope_theta"]
    if theirs["rope_type"] == "default":
        assert ours.rope_scaling is None
    else:
        s = ours.rope_scaling
        assert theirs["rope_type"] == s.type == "llama3"
        assert (s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_seq_len) == tuple(
            theirs[k] for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tie_word_embeddings": True}, "tie_word_embeddings"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "linear"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "without .'low_freq_factor'"),
        (
            {"rope_parameters": {**LLAMA3_ROPE, "low_freq_factor": 4.0}},
            "high_freq_factor 4.0 must be above low_freq_factor 4.0",
        ),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "dynamic"),
        ({"head_dim": 32}, "head_dim"),
    ],
)
def test_unsupported_configs_are_refused(change, message):
    args = Llama2Args(vocab_size=100, hidden_size=64, num_layers=1, num_heads=4, ffn_hidden_size=96, max_seq_len=32)
    with pytest.raises(ValueError, match=message):
        args_from_hf_config(hf_config_from_args(args) | change)


def test_state_dict_key_errors_name_the_keys():
    args = Llama2Args(vocab_size=100, hidden_size=64, num_layers=1, num_heads=4, ffn_hidden_size=96, max_seq_len=32)
    hf_sd = state_dict_to_hf(Llama2(args).state_dict(), args)
    hf_sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)  # old checkpoints: ignored
    state_dict_from_hf(hf_sd, args)
    del hf_sd["model.layers.0.mlp.up_proj.weight"]
    hf_sd["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    with pytest.raises(ValueError, match=r"missing keys \['model.layers.0.mlp.up_proj.weight'\].*q_proj.bias"):
        state_dict_from_hf(hf_sd, args)
    with pytest.raises(ValueError, match=r"unknown keys.*layers\.1\.attn_norm\.weight"):
        state_dict_to_hf(Llama2(Llama2Args(**{**vars(args), "num_layers": 2})).state_dict(), args)


def test_llama2_7b_param_count_on_meta():
    args = Llama2Args(
        vocab_size=32000,
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=32,
        ffn_hidden_size=11008,
        max_seq_len=4096,
    )
    with torch.device("meta"):
        model = Llama2(args)
        model.init_weights()  # a no-op on meta, but must not fail
    assert model.num_params() == 6_738_415_616


def test_scaled_init():
    args = Llama2Args(vocab_size=64, hidden_size=512, num_layers=8, num_heads=8, ffn_hidden_size=1024, max_seq_len=8)
    model = Llama2(args)
    model.init_weights(seed=0)
    layer = model.layers[3]
    out_std = args.init_std / math.sqrt(2 * args.num_layers)
    assert layer.attn.out.weight.std().item() == pytest.approx(out_std, rel=0.1)
    assert layer.mlp.down.weight.std().item() == pytest.approx(out_std, rel=0.1)
    assert layer.attn.qkv.weight.std().item() == pytest.approx(args.init_std, rel=0.1)
    assert layer.mlp.gate_up.weight.std().item() == pytest.approx(args.init_std, rel=0.1)
    assert torch.equal(layer.attn_norm.weight, torch.ones(512)) and torch.equal(model.norm.weight, torch.ones(512))


def shard(module, proj: str, back: str, rank: int, tp: int):
    """A copy of an attention/MLP block holding rank's column shard of `proj` and row shard of `back`."""
    local = copy.deepcopy(module)
    w_in, w_out = getattr(module, proj).weight, getattr(module, back).weight
    n_in, n_out = w_in.shape[0] // tp, w_out.shape[1] // tp
    setattr(local, proj, nn.Linear(w_in.shape[1], n_in, bias=False))
    setattr(local, back, nn.Linear(n_out, w_out.shape[0], bias=False))
    with torch.no_grad():
        getattr(local, proj).weight.copy_(w_in[rank * n_in : (rank + 1) * n_in])
        getattr(local, back).weight.copy_(w_out[:, rank * n_out : (rank + 1) * n_out])
    return local


@pytest.mark.parametrize("tp", [2, 4])
def test_contiguous_row_shards_hold_whole_heads_and_ffn_units(tp):
    # Tensor parallelism in miniature: each rank's forward on its shard (local sizes from the weight shapes), summed
    # as a row-parallel all-reduce would, equals the unsharded block. Wrong layouts mix q/k/v or gate/up rows.
    args = Llama2Args(
        vocab_size=64, hidden_size=128, num_layers=1, num_heads=8, num_kv_heads=4, ffn_hidden_size=96, max_seq_len=16
    )
    model = Llama2(args).eval()
    model.init_weights(seed=0)
    x = torch.randn(2, 16, 128, generator=torch.Generator().manual_seed(1))
    attn, mlp = model.layers[0].attn, model.layers[0].mlp
    with torch.no_grad():
        attn_parts = [shard(attn, "qkv", "out", r, tp)(x) for r in range(tp)]
        mlp_parts = [shard(mlp, "gate_up", "down", r, tp)(x) for r in range(tp)]
        torch.testing.assert_close(sum(attn_parts), attn(x), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(sum(mlp_parts), mlp(x), rtol=1e-5, atol=1e-6)
        # Rank 0's attention output equals the full block with the other ranks' heads' output columns zeroed.
        keep = attn.out.weight.clone()
        keep[:, attn.out.weight.shape[1] // tp :] = 0
        full = copy.deepcopy(attn)
        full.out.weight.copy_(keep)
        torch.testing.assert_close(attn_parts[0], full(x), rtol=1e-5, atol=1e-6)


def test_activation_checkpointing_gives_same_loss_and_grads():
    base = Llama2Args(
        vocab_size=64, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=96, max_seq_len=16
    )
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    ref = Llama2(base)
    ref.init_weights(seed=0)
    results = {}
    for mode in ("none", "selective", "full"):
        model = Llama2(base).train()
        apply_activation_checkpointing(model, mode)
        model.load_state_dict(ref.state_dict())
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        results[mode] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    for mode in ("selective", "full"):
        torch.testing.assert_close(results[mode][0], results["none"][0])
        for name, grad in results["none"][1].items():
            torch.testing.assert_close(results[mode][1][name], grad, msg=f"{mode}: {name}")


def test_unknown_checkpointing_mode_is_refused_by_the_config():
    with pytest.raises(ValueError, match="activation_checkpointing"):
        Llama2Args(
            vocab_size=8,
            hidden_size=8,
            num_layers=1,
            num_heads=2,
            ffn_hidden_size=8,
            max_seq_len=8,
            activation_checkpointing="some",
        )
