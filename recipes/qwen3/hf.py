"""Conversion between this recipe's Qwen3 and Hugging Face transformers' Qwen3ForCausalLM / Qwen3MoeForCausalLM
(config and weights).

Plain tensor ops only (no transformers import). The attention and MLP weights are fused as Llama 2's
(recipes/llama2/hf.py); a tied model has no lm_head.weight of its own (transformers' save_pretrained writes none).
Experts: files hold one gate_proj / up_proj / down_proj per expert (the Hub's checkpoints, and what transformers 5's
save_pretrained writes back from its modules' fused gate_up_proj [E, 2I, H] = [gate; up] and down_proj [E, H, I]).
From-hf reads either form; to-hf writes the files' form, which from_pretrained fuses on load.
"""

from __future__ import annotations

import torch

from recipes.llama2.hf import _copy, _expected, _rope

from .spec import Qwen3Config

QWEN3_VOCAB = 151936  # Qwen3's embedding rows (151,669 tokens, padded)


def args_from_hf_config(cfg: dict) -> Qwen3Config:
    """Qwen3Config from a Qwen3ForCausalLM config.json dict; ValueError for features this model lacks."""
    problems = []
    if cfg.get("model_type", "qwen3") not in ("qwen3", "qwen3_moe"):
        problems.append(f"model_type {cfg['model_type']!r} (need 'qwen3' or 'qwen3_moe')")
    if cfg.get("attention_bias", False):
        problems.append("attention_bias=true (projections have no bias here)")
    if cfg.get("use_sliding_window", False):
        problems.append("use_sliding_window=true (every layer attends to the whole sequence here)")
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {cfg['hidden_act']!r} (need 'silu')")
    rope_key, rope = _rope(cfg)
    if rope["rope_type"] != "default":
        problems.append(f"{rope_key} with rope_type {rope['rope_type']!r} (supported: 'default')")
    if problems:
        raise ValueError("unsupported Qwen3 config: " + "; ".join(problems))
    heads = cfg["num_attention_heads"]
    return Qwen3Config(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        ffn_hidden_size=cfg["intermediate_size"],
        max_seq_len=cfg.get("max_position_embeddings", 32768),
        rotary_base=float(rope["rope_theta"]),
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        init_std=cfg.get("initializer_range", 0.02),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        **_moe_fields(cfg),
    )


def _moe_fields(cfg: dict) -> dict:
    """Qwen3Config's expert fields from a qwen3_moe config.json (transformers' Qwen3MoeConfig defaults where absent);
    none for a dense one, or one with no experts (every block dense)."""
    experts = cfg.get("num_experts", cfg.get("num_local_experts", 128))
    if cfg.get("model_type") != "qwen3_moe" or not experts:
        return {}
    return {
        "num_experts": experts,
        "num_experts_per_tok": cfg.get("num_experts_per_tok", 8),
        "moe_intermediate_size": cfg.get("moe_intermediate_size", 768),
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
        "decoder_sparse_step": cfg.get("decoder_sparse_step", 1),
        "mlp_only_layers": tuple(cfg.get("mlp_only_layers") or ()),
        "router_aux_loss_coef": float(cfg.get("router_aux_loss_coef", 0.001)),
    }


def hf_config_from_args(args: Qwen3Config) -> dict:
    """A config.json dict that transformers.Qwen3Config(**d) reads back as this model."""
    theta = float(args.rotary_base)
    moe = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_experts": args.num_experts,
        "num_experts_per_tok": args.num_experts_per_tok,
        "moe_intermediate_size": args.moe_intermediate_size,
        "norm_topk_prob": args.norm_topk_prob,
        "decoder_sparse_step": args.decoder_sparse_step,
        "mlp_only_layers": list(args.mlp_only_layers),
        "router_aux_loss_coef": args.router_aux_loss_coef,
        "output_router_logits": False,
    }
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
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
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "rope_theta": theta,  # transformers 4.x's key
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "tie_word_embeddings": args.tie_embeddings,
        # Qwen3's tokenizer's (Qwen/Qwen3-8B config.json: <|endoftext|> and <|im_end|>) where the vocabulary is its;
        # `convert to-hf` writes the ids of the checkpoint's own tokenizer over these when it has one.
        "bos_token_id": 151643 if args.vocab_size == QWEN3_VOCAB else None,
        "eos_token_id": 151645 if args.vocab_size == QWEN3_VOCAB else None,
        "dtype": "float32",
    } | (moe if args.num_experts else {})


def _hf_shapes(args: Qwen3Config, fused_experts: bool = False) -> dict[str, tuple[int, ...]]:
    h, hd, f = args.hidden_size, args.head_dim, args.ffn_hidden_size
    shapes = {"model.embed_tokens.weight": (args.vocab_size, h), "model.norm.weight": (h,)}
    if not args.tie_embeddings:
        shapes["lm_head.weight"] = (args.vocab_size, h)
    for i in range(args.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (args.num_heads * hd, h),
            p + "self_attn.k_proj.weight": (args.num_kv_heads * hd, h),
            p + "self_attn.v_proj.weight": (args.num_kv_heads * hd, h),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.k_norm.weight": (hd,),
            p + "self_attn.o_proj.weight": (h, args.num_heads * hd),
            p + "post_attention_layernorm.weight": (h,),
        }
        if not args.is_sparse(i):
            shapes |= {
                p + "mlp.gate_proj.weight": (f, h),
                p + "mlp.up_proj.weight": (f, h),
                p + "mlp.down_proj.weight": (h, f),
            }
            continue
        e, m = args.num_experts, args.moe_intermediate_size
        shapes[p + "mlp.gate.weight"] = (e, h)
        if fused_experts:
            shapes |= {p + "mlp.experts.gate_up_proj": (e, 2 * m, h), p + "mlp.experts.down_proj": (e, h, m)}
        else:
            for j in range(e):
                x = f"{p}mlp.experts.{j}."
                shapes |= {x + "gate_proj.weight": (m, h), x + "up_proj.weight": (m, h), x + "down_proj.weight": (h, m)}
    return shapes


def _our_shapes(args: Qwen3Config) -> dict[str, tuple[int, ...]]:
    h, hd, f = args.hidden_size, args.head_dim, args.ffn_hidden_size
    shapes = {"embed.weight": (args.vocab_size, h), "norm.weight": (h,)}
    if not args.tie_embeddings:
        shapes["head.weight"] = (args.vocab_size, h)
    for i in range(args.num_layers):
        p = f"layers.{i}."
        shapes |= {
            p + "attn_norm.weight": (h,),
            p + "attn.qkv.weight": ((args.num_heads + 2 * args.num_kv_heads) * hd, h),
            p + "attn.q_norm.weight": (hd,),
            p + "attn.k_norm.weight": (hd,),
            p + "attn.out.weight": (h, args.num_heads * hd),
            p + "mlp_norm.weight": (h,),
        }
        if args.is_sparse(i):
            e, m = args.num_experts, args.moe_intermediate_size
            shapes |= {
                p + "mlp.router.weight": (e, h),
                p + "mlp.experts.gate_up": (e, 2 * m, h),
                p + "mlp.experts.down": (e, h, m),
            }
        else:
            shapes |= {p + "mlp.gate_up.weight": (2 * f, h), p + "mlp.down.weight": (h, f)}
    return shapes


def _without_tied_head(sd: dict[str, torch.Tensor], args: Qwen3Config) -> dict[str, torch.Tensor]:
    """A tied model's state dict as transformers' state_dict() gives it holds lm_head.weight as the embedding
    itself: dropped, after checking that it is the same values (else the checkpoint is not a tied model)."""
    if not args.tie_embeddings or "lm_head.weight" not in sd:
        return sd
    if not torch.equal(sd["lm_head.weight"], sd["model.embed_tokens.weight"]):
        raise ValueError("tie_word_embeddings=true, but lm_head.weight differs from model.embed_tokens.weight")
    return {k: v for k, v in sd.items() if k != "lm_head.weight"}


def state_dict_from_hf(sd: dict[str, torch.Tensor], args: Qwen3Config) -> dict[str, torch.Tensor]:
    """Qwen3ForCausalLM state dict -> Qwen3 state dict (fusing q/k/v per KV group and interleaving gate/up)."""
    sd = _without_tied_head(sd, args)
    fused = any(k.endswith("mlp.experts.gate_up_proj") for k in sd)  # a Qwen3MoeForCausalLM's own state_dict()
    _expected(_hf_shapes(args, fused), sd, "Hugging Face")
    h, hd, g = args.hidden_size, args.head_dim, args.num_kv_heads
    out = {"embed.weight": sd["model.embed_tokens.weight"], "norm.weight": sd["model.norm.weight"]}
    if not args.tie_embeddings:
        out["head.weight"] = sd["lm_head.weight"]
    for i in range(args.num_layers):
        p, o = f"model.layers.{i}.", f"layers.{i}."
        q = sd[p + "self_attn.q_proj.weight"].reshape(g, -1, h)  # [group, q_per_kv * hd, h]
        k = sd[p + "self_attn.k_proj.weight"].reshape(g, hd, h)
        v = sd[p + "self_attn.v_proj.weight"].reshape(g, hd, h)
        out[o + "attn_norm.weight"] = sd[p + "input_layernorm.weight"]
        out[o + "attn.qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, h)
        out[o + "attn.q_norm.weight"] = sd[p + "self_attn.q_norm.weight"]
        out[o + "attn.k_norm.weight"] = sd[p + "self_attn.k_norm.weight"]
        out[o + "attn.out.weight"] = sd[p + "self_attn.o_proj.weight"]
        out[o + "mlp_norm.weight"] = sd[p + "post_attention_layernorm.weight"]
        if args.is_sparse(i):
            out |= _experts_from_hf(sd, p, o, args.num_experts, fused)
            continue
        gate, up = sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]
        out[o + "mlp.gate_up.weight"] = torch.stack([gate, up], dim=1).reshape(-1, h)  # rows gate_0, up_0, ...
        out[o + "mlp.down.weight"] = sd[p + "mlp.down_proj.weight"]
    return out


def state_dict_to_hf(sd: dict[str, torch.Tensor], args: Qwen3Config) -> dict[str, torch.Tensor]:
    """Qwen3 state dict -> Qwen3ForCausalLM state dict; the exact inverse of state_dict_from_hf (a tied model's
    without lm_head.weight: transformers ties it to the embedding on load)."""
    _expected(_our_shapes(args), sd, "Qwen3")
    h, hd, g = args.hidden_size, args.head_dim, args.num_kv_heads
    qpk = args.num_heads // g
    out = {"model.embed_tokens.weight": sd["embed.weight"], "model.norm.weight": sd["norm.weight"]}
    if not args.tie_embeddings:
        out["lm_head.weight"] = sd["head.weight"]
    for i in range(args.num_layers):
        p, o = f"model.layers.{i}.", f"layers.{i}."
        q, k, v = sd[o + "attn.qkv.weight"].reshape(g, (qpk + 2) * hd, h).split([qpk * hd, hd, hd], dim=1)
        out[p + "input_layernorm.weight"] = sd[o + "attn_norm.weight"]
        out[p + "self_attn.q_proj.weight"] = _copy(q.reshape(-1, h))  # own copies: safetensors refuses views
        out[p + "self_attn.k_proj.weight"] = _copy(k.reshape(-1, h))
        out[p + "self_attn.v_proj.weight"] = _copy(v.reshape(-1, h))
        out[p + "self_attn.q_norm.weight"] = sd[o + "attn.q_norm.weight"]
        out[p + "self_attn.k_norm.weight"] = sd[o + "attn.k_norm.weight"]
        out[p + "self_attn.o_proj.weight"] = sd[o + "attn.out.weight"]
        out[p + "post_attention_layernorm.weight"] = sd[o + "mlp_norm.weight"]
        if args.is_sparse(i):
            out |= _experts_to_hf(sd, o, p)
            continue
        gate_up = sd[o + "mlp.gate_up.weight"].reshape(-1, 2, h)
        out[p + "mlp.gate_proj.weight"] = _copy(gate_up[:, 0])
        out[p + "mlp.up_proj.weight"] = _copy(gate_up[:, 1])
        out[p + "mlp.down_proj.weight"] = sd[o + "mlp.down.weight"]
    return out


def _experts_from_hf(sd: dict[str, torch.Tensor], p: str, o: str, experts: int, fused: bool) -> dict[str, torch.Tensor]:
    """A sparse block's router and experts: gate and up rows interleaved per expert, as the dense MLP's."""
    if fused:
        gate, up = sd[p + "mlp.experts.gate_up_proj"].chunk(2, dim=1)  # [E, I, H] each: HF's [gate; up]
        down = sd[p + "mlp.experts.down_proj"]
    else:
        gate, up, down = (
            torch.stack([sd[f"{p}mlp.experts.{j}.{name}_proj.weight"] for j in range(experts)])
            for name in ("gate", "up", "down")
        )
    return {
        o + "mlp.router.weight": sd[p + "mlp.gate.weight"],
        o + "mlp.experts.gate_up": torch.stack([gate, up], dim=2).flatten(1, 2),  # [E, 2I, H]
        o + "mlp.experts.down": down.contiguous(),
    }


def _experts_to_hf(sd: dict[str, torch.Tensor], o: str, p: str) -> dict[str, torch.Tensor]:
    """The inverse of _experts_from_hf, in the files' per-expert form."""
    gate_up, down = sd[o + "mlp.experts.gate_up"], sd[o + "mlp.experts.down"]
    gate_up = gate_up.unflatten(1, (-1, 2))  # [E, I, 2, H]
    out = {p + "mlp.gate.weight": sd[o + "mlp.router.weight"]}
    for j in range(gate_up.shape[0]):
        x = f"{p}mlp.experts.{j}."
        out[x + "gate_proj.weight"] = _copy(gate_up[j, :, 0])
        out[x + "up_proj.weight"] = _copy(gate_up[j, :, 1])
        out[x + "down_proj.weight"] = _copy(down[j])
    return out
