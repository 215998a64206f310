"""Conversion between this recipe's Llama2 and Hugging Face transformers' LlamaForCausalLM (config and weights).

Plain tensor ops only (no transformers import), so checkpoints convert on machines without transformers.
"""

from __future__ import annotations

import torch

from .model import Llama2Args
from .spec import RopeScaling

LLAMA3_VOCAB = 128256  # Llama 3's tiktoken-style BPE: 128,000 tokens and 256 reserved special ones

# HF keeps rotary inverse frequencies as non-persistent buffers; older checkpoints saved them anyway.
_HF_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.original_inv_freq")


_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor")  # original_max_position_embeddings has a default


def _rope(cfg: dict) -> tuple[str, dict]:
    """The RoPE settings of a config.json as transformers 5 reads them (PreTrainedConfig.convert_rope_params_to_dict
    and standardize_rope_params): a non-empty rope_scaling (4.x's key, Meta's Llama 3.1 config.json) replaces
    rope_parameters whole, even where both are given and disagree; rope_theta comes from the chosen dict, else the
    top-level rope_theta, else 10000; llama3's original_max_position_embeddings defaults to max_position_embeddings.
    Returns the key it came from, for messages."""
    key = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    rope = dict(cfg.get(key) or {})
    rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    rope.setdefault("rope_type", rope.get("type", "default"))
    if rope["rope_type"] == "llama3":
        rope.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings", 2048))
    return key, rope


def _rope_scaling(key: str, rope: dict) -> tuple[RopeScaling | None, list[str]]:
    """None (default RoPE) or Llama 3's scaling; problems for any other kind."""
    rope_type = rope["rope_type"]
    if rope_type == "default":
        return None, []
    if rope_type != "llama3":
        return None, [f"{key} with rope_type {rope_type!r} (supported: 'default', 'llama3')"]
    if missing := [k for k in _LLAMA3_KEYS if k not in rope]:
        return None, [f"{key} of rope_type 'llama3' without {missing}"]
    scaling = RopeScaling(
        factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_seq_len=int(rope["original_max_position_embeddings"]),
    )
    return scaling, scaling.problems()


def args_from_hf_config(cfg: dict) -> Llama2Args:
    """Llama2Args from a LlamaForCausalLM config.json dict; ValueError for features this model lacks."""
    problems = []
    if cfg.get("model_type", "llama") != "llama":
        problems.append(f"model_type {cfg['model_type']!r} (need 'llama')")
    if cfg.get("tie_word_embeddings", False):
        problems.append("tie_word_embeddings=true (the head is untied from the embedding here)")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key, False):
            problems.append(f"{key}=true (projections have no bias here)")
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {cfg['hidden_act']!r} (need 'silu')")
    rope_key, rope = _rope(cfg)
    scaling, scaling_problems = _rope_scaling(rope_key, rope)
    problems += scaling_problems
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim")
    if head_dim is not None and head_dim * heads != hidden:
        problems.append(f"head_dim {head_dim} != hidden_size / num_attention_heads = {hidden}/{heads}")
    if problems:
        raise ValueError("unsupported Llama config: " + "; ".join(problems))
    return Llama2Args(
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        ffn_hidden_size=cfg["intermediate_size"],
        max_seq_len=cfg.get("max_position_embeddings", 2048),
        rotary_base=float(rope["rope_theta"]),
        rope_scaling=scaling,
        norm_eps=cfg.get("rms_norm_eps", 1e-6),  # LlamaConfig's default when the key is absent
        init_std=cfg.get("initializer_range", 0.02),
    )


def hf_config_from_args(args: Llama2Args) -> dict:
    """A config.json dict that transformers.LlamaConfig(**d) (5.x, and 4.x) reads back as this model."""
    theta = float(args.rotary_base)
    rope = {"rope_type": "default", "rope_theta": theta}
    scaling = args.rope_scaling
    if scaling is not None:
        rope = {
            "rope_type": "llama3",
            "rope_theta": theta,
            "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_seq_len,
        }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": args.vocab_size,
        "hidden_size": args.hidden_size,
        "intermediate_size": args.ffn_hidden_size,
        "num_hidden_layers": args.num_layers,
        "num_attention_heads": args.num_heads,
        "num_key_value_heads": args.num_kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_seq_len,
        "initializer_range": args.init_std,
        "rms_norm_eps": args.norm_eps,
        # transformers 5 reads rope_parameters, but a rope_scaling beside it (4.x's spelling, written for 4.x) wins
        # whole, its rope_theta taken from the top level: all three agree. 4.x reads rope_theta and rope_scaling.
        "rope_parameters": rope,
        "rope_theta": theta,
        **({"rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"}} if scaling is not None else {}),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        # Llama 2's tokenizer's; Llama 3's (128000, 128001) where the vocabulary is its: `convert to-hf` writes
        # the ids of the checkpoint's own tokenizer over these when it has one.
        "bos_token_id": 128000 if args.vocab_size == LLAMA3_VOCAB else 1,
        "eos_token_id": 128001 if args.vocab_size == LLAMA3_VOCAB else 2,
        "dtype": "float32",  # transformers 5 name; it warns that torch_dtype is deprecated
    }


def _expected(names_shapes: dict[str, tuple[int, ...]], sd: dict[str, torch.Tensor], what: str) -> None:
    keys = {k for k in sd if not k.endswith(_HF_IGNORED_SUFFIXES)}
    missing = sorted(set(names_shapes) - keys)
    unknown = sorted(keys - set(names_shapes))
    problems = []
    if missing:
        problems.append(f"missing keys {missing}")
    if unknown:
        problems.append(f"unknown keys {unknown}")
    bad = [f"{k}: {tuple(sd[k].shape)} != {s}" for k, s in names_shapes.items() if k in sd and tuple(sd[k].shape) != s]
    if bad:
        problems.append(f"wrong shapes {bad}")
    if problems:
        raise ValueError(f"{what} state dict does not match the config: " + "; ".join(problems))


def _hf_shapes(args: Llama2Args) -> dict[str, tuple[int, ...]]:
    h, hd, f = args.hidden_size, args.head_dim, args.ffn_hidden_size
    shapes = {
        "model.embed_tokens.weight": (args.vocab_size, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (args.vocab_size, h),
    }
    for i in range(args.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (args.num_heads * hd, h),
            p + "self_attn.k_proj.weight": (args.num_kv_heads * hd, h),
            p + "self_attn.v_proj.weight": (args.num_kv_heads * hd, h),
            p + "self_attn.o_proj.weight": (h, args.num_heads * hd),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (f, h),
            p + "mlp.up_proj.weight": (f, h),
            p + "mlp.down_proj.weight": (h, f),
        }
    return shapes


def _our_shapes(args: Llama2Args) -> dict[str, tuple[int, ...]]:
    h, hd, f = args.hidden_size, args.head_dim, args.ffn_hidden_size
    shapes = {"embed.weight": (args.vocab_size, h), "norm.weight": (h,), "head.weight": (args.vocab_size, h)}
    for i in range(args.num_layers):
        p = f"layers.{i}."
        shapes |= {
            p + "attn_norm.weight": (h,),
            p + "attn.qkv.weight": ((args.num_heads + 2 * args.num_kv_heads) * hd, h),
            p + "attn.out.weight": (h, args.num_heads * hd),
            p + "mlp_norm.weight": (h,),
            p + "mlp.gate_up.weight": (2 * f, h),
            p + "mlp.down.weight": (h, f),
        }
    return shapes


def _copy(t: torch.Tensor) -> torch.Tensor:
    return t.clone(memory_format=torch.contiguous_format)


def state_dict_from_hf(sd: dict[str, torch.Tensor], args: Llama2Args) -> dict[str, torch.Tensor]:
    """LlamaForCausalLM state dict -> Llama2 state dict (fusing q/k/v per KV group and interleaving gate/up)."""
    _expected(_hf_shapes(args), sd, "Hugging Face")
    h, hd, g = args.hidden_size, args.head_dim, args.num_kv_heads
    out = {"embed.weight": sd["model.embed_tokens.weight"], "norm.weight": sd["model.norm.weight"]}
    out["head.weight"] = sd["lm_head.weight"]
    for i in range(args.num_layers):
        p, o = f"model.layers.{i}.", f"layers.{i}."
        q = sd[p + "self_attn.q_proj.weight"].reshape(g, -1, h)  # [group, q_per_kv * hd, h]
        k = sd[p + "self_attn.k_proj.weight"].reshape(g, hd, h)
        v = sd[p + "self_attn.v_proj.weight"].reshape(g, hd, h)
        out[o + "attn_norm.weight"] = sd[p + "input_layernorm.weight"]
        out[o + "attn.qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, h)
        out[o + "attn.out.weight"] = sd[p + "self_attn.o_proj.weight"]
        out[o + "mlp_norm.weight"] = sd[p + "post_attention_layernorm.weight"]
        gate, up = sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]
        out[o + "mlp.gate_up.weight"] = torch.stack([gate, up], dim=1).reshape(-1, h)  # rows gate_0, up_0, ...
        out[o + "mlp.down.weight"] = sd[p + "mlp.down_proj.weight"]
    return out


def state_dict_to_hf(sd: dict[str, torch.Tensor], args: Llama2Args) -> dict[str, torch.Tensor]:
    """Llama2 state dict -> LlamaForCausalLM state dict; the exact inverse of state_dict_from_hf."""
    _expected(_our_shapes(args), sd, "Llama2")
    h, hd, g = args.hidden_size, args.head_dim, args.num_kv_heads
    qpk = args.num_heads // g
    out = {"model.embed_tokens.weight": sd["embed.weight"], "model.norm.weight": sd["norm.weight"]}
    out["lm_head.weight"] = sd["head.weight"]
    for i in range(args.num_layers):
        p, o = f"model.layers.{i}.", f"layers.{i}."
        q, k, v = sd[o + "attn.qkv.weight"].reshape(g, (qpk + 2) * hd, h).split([qpk * hd, hd, hd], dim=1)
        gate_up = sd[o + "mlp.gate_up.weight"].reshape(-1, 2, h)
        # Own, contiguous copies: slices are strided views sharing one storage, which safetensors refuses to save.
        out[p + "input_layernorm.weight"] = sd[o + "attn_norm.weight"]
        out[p + "self_attn.q_proj.weight"] = _copy(q.reshape(-1, h))
        out[p + "self_attn.k_proj.weight"] = _copy(k.reshape(-1, h))
        out[p + "self_attn.v_proj.weight"] = _copy(v.reshape(-1, h))
        out[p + "self_attn.o_proj.weight"] = sd[o + "attn.out.weight"]
        out[p + "post_attention_layernorm.weight"] = sd[o + "mlp_norm.weight"]
        out[p + "mlp.gate_proj.weight"] = _copy(gate_up[:, 0])
        out[p + "mlp.up_proj.weight"] = _copy(gate_up[:, 1])
        out[p + "mlp.down_proj.weight"] = sd[o + "mlp.down.weight"]
    return out
