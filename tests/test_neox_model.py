"""GPT-NeoX/Pythia: exact parity with transformers' GPTNeoXForCausalLM (random weights, fp32), the zero-frequency
partial rotary, scaled init and activation checkpointing."""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers
from transformers.models.gpt_neox import modeling_gpt_neox as hf_neox

from recipes.neox import hf
from recipes.neox.model import NeoX, NeoXArgs, rotary_frequencies, rotate_half
from trnrecipes.parallel.activation_checkpointing import apply_activation_checkpointing

torch.set_num_threads(2)


def hf_model(head_dim: int, rotary_pct: float, heads: int = 4, layers: int = 2, vocab: int = 101, parallel=True):
    hidden = head_dim * heads
    cfg = transformers.GPTNeoXConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=4 * hidden, rotary_pct=rotary_pct, rotary_emb_base=10000, max_position_embeddings=128,
        use_parallel_residual=parallel, attn_implementation="eager", pad_token_id=0,
    )  # fmt: skip
    model = transformers.GPTNeoXForCausalLM(cfg).eval()
    with torch.no_grad():  # random everything, norms and biases included, so no term can hide
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


def ours_from(model) -> NeoX:
    args = hf.args_from_hf_config(model.config.to_dict())
    ours = NeoX(args).eval()
    ours.load_state_dict(hf.state_dict_from_hf(model.state_dict(), args))
    return ours


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


SHAPES = [(16, 0.25, True), (64, 0.25, True), (96, 0.25, True), (32, 1.0, True), (32, 0.5, False)]


@pytest.mark.parametrize(("head_dim", "rotary_pct", "parallel"), SHAPES)
def test_logits_equal_hf_in_both_directions(head_dim, rotary_pct, parallel):
    torch.manual_seed(head_dim)
    reference = hf_model(head_dim, rotary_pct, parallel=parallel)
    ours = ours_from(reference)
    tokens = torch.randint(0, 101, (2, 33))
    with torch.no_grad():
        want = reference(tokens).logits
        assert rel_err(ours(tokens), want) < 1e-5
        # ours -> HF: a fresh HF model loaded from our weights gives the same logits again.
        back = hf.state_dict_to_hf(ours.state_dict(), ours.args)
        fresh = transformers.GPTNeoXForCausalLM(reference.config).eval()
        fresh.load_state_dict({("lm_head.weight" if k == "embed_out.weight" else k): v for k, v in back.items()})
        assert rel_err(fresh(tokens).logits, want) < 1e-5


# config.json's RoPE keys alone and disagreeing: transformers 4's rotary_emb_base / rotary_pct and rope_scaling, 5's
# rope_parameters; and a top-level rope_theta, which GPTNeoXConfig does not read.
ROPE_KEYS = {
    "rotary_emb_base and rotary_pct alone": {"rotary_emb_base": 5.0, "rotary_pct": 0.5},
    "rope_parameters alone": {"rope_parameters": {"rope_type": "default", "rope_theta": 9.0,
                                                  "partial_rotary_factor": 0.5}},
    "rope_scaling alone": {"rope_scaling": {"rope_type": "default", "rope_theta": 7.0}},
    "rope_parameters vs rotary_emb_base and rotary_pct": {
        "rotary_emb_base": 5.0, "rotary_pct": 0.5, "rope_parameters": {"rope_type": "default", "rope_theta": 9.0}},
    "rope_scaling vs rope_parameters": {"rope_scaling": {"rope_type": "default", "rope_theta": 7.0},
                                        "rope_parameters": {"rope_type": "default", "rope_theta": 9.0,
                                                            "partial_rotary_factor": 0.5}},
    "rope_parameters vs an empty rope_scaling": {"rope_scaling": {}, "rope_parameters": {"rope_theta": 9.0}},
    "top-level rope_theta vs rotary_emb_base": {"rope_theta": 3.0, "rotary_emb_base": 5.0},
}  # fmt: skip


@pytest.mark.parametrize("keys", ROPE_KEYS.values(), ids=ROPE_KEYS.keys())
def test_rope_keys_read_as_transformers_reads_them(keys, tmp_path):
    """Where config.json's RoPE keys disagree, transformers 5 takes a non-empty rope_scaling whole over
    rope_parameters, and the chosen dict's values over rotary_emb_base / rotary_pct: so do we."""
    config = {"model_type": "gpt_neox", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 128, **keys}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    theirs = transformers.AutoConfig.from_pretrained(tmp_path).rope_parameters
    ours = hf.args_from_hf_config(json.loads((tmp_path / "config.json").read_text()))
    assert (ours.rotary_base, ours.rotary_pct) == (theirs["rope_theta"], theirs["partial_rotary_factor"])


def test_state_dict_round_trip_is_exact():
    torch.manual_seed(0)
    reference = hf_model(16, 0.25)
    args = hf.args_from_hf_config(reference.config.to_dict())
    sd = {("embed_out.weight" if k == "lm_head.weight" else k): v for k, v in reference.state_dict().items()}
    back = hf.state_dict_to_hf(hf.state_dict_from_hf(sd, args), args)
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)


def test_greedy_generation_equals_hf():
    torch.manual_seed(1)
    reference = hf_model(16, 0.25)
    ours = ours_from(reference)
    prompt = torch.randint(0, 101, (1, 7))
    want = reference.generate(prompt, max_new_tokens=12, do_sample=False)
    tokens = prompt
    with torch.no_grad():
        for _ in range(12):
            tokens = torch.cat([tokens, ours(tokens)[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(tokens, want)


@pytest.mark.parametrize("head_dim", [16, 64, 96])
def test_zero_frequency_rotary_scores_equal_hf_and_the_naive_variant_does_not(head_dim):
    heads, seq, pct = 2, 40, 0.25
    args = NeoXArgs(vocab_size=10, hidden_size=heads * head_dim, num_layers=1, num_heads=heads,
                    ffn_hidden_size=8, max_seq_len=seq, rotary_pct=pct)  # fmt: skip
    gen = torch.Generator().manual_seed(head_dim)
    q, k = (torch.randn(1, heads, seq, head_dim, generator=gen, dtype=torch.float64) for _ in range(2))

    # HF's own rotary code, in float64.
    cfg = transformers.GPTNeoXConfig(hidden_size=args.hidden_size, num_attention_heads=heads, rotary_pct=pct)
    rope = hf_neox.GPTNeoXRotaryEmbedding(cfg)
    cos, sin = rope(q, torch.arange(seq)[None])
    q_hf, k_hf = hf_neox.apply_rotary_pos_emb(q, k, cos.double(), sin.double())
    scores_hf = q_hf @ k_hf.transpose(-1, -2)

    def rotate(x, freqs):  # angles in float32 like the model (and HF); everything else in float64
        angles = torch.arange(seq, dtype=torch.float32)[:, None] * freqs.float()
        return x * angles.cos().double() + rotate_half(x) * angles.sin().double()

    perm = hf.rotary_permutation(args)
    ours = rotate(q[..., perm], rotary_frequencies(args)) @ rotate(k[..., perm], rotary_frequencies(args)).mT
    assert (ours - scores_hf).abs().max().item() < 1e-12

    # Neuron NeMo's "[inv, inv, zeros]" + rotate_half over the full head pairs i with i + head_dim/2: not HF's.
    r = args.rotary_dim
    inv = 1.0 / (10000 ** (torch.arange(0, r, 2, dtype=torch.float32) / r))
    naive = torch.cat([inv, inv, torch.zeros(head_dim - r)])
    naive_scores = rotate(q, naive) @ rotate(k, naive).mT
    assert (naive_scores - scores_hf).abs().max().item() > 0.1


def test_scaled_init():
    args = NeoXArgs(vocab_size=64, hidden_size=512, num_layers=8, num_heads=8, ffn_hidden_size=2048, max_seq_len=16)
    model = NeoX(args)
    model.init_weights(seed=0)
    layer = model.layers[0]
    assert layer.attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert layer.mlp.fc_out.weight.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    assert layer.attn.out.weight.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    assert torch.all(layer.attn_norm.weight == 1) and torch.all(layer.attn.qkv.bias == 0)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_activation_checkpointing_changes_nothing_but_memory(mode):
    args = NeoXArgs(vocab_size=50, hidden_size=64, num_layers=2, num_heads=4, ffn_hidden_size=128, max_seq_len=32)
    base = NeoX(args)
    base.init_weights(seed=0)
    other = NeoX(args)
    apply_activation_checkpointing(other, mode)
    other.load_state_dict(base.state_dict())
    tokens = torch.randint(0, 50, (2, 16))
    grads = []
    for model in (base, other):
        model.train()
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        loss.backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
