"""GPT-NeoX <-> Hugging Face `GPTNeoXForCausalLM`: config.json and state-dict conversion (plain tensor ops).

The only non-renaming step is the per-head q/k row permutation that makes the zero-frequency rotary layout of
recipes/neox/model.py compute exactly HF's partial rotary (see that module's docstring).
"""

from __future__ import annotations

import torch

from recipes.neox.model import NeoXArgs

# HF keys that are buffers, not weights (older transformers saved some of them).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "attention.bias", "attention.masked_bias")


def args_from_hf_config(cfg: dict) -> NeoXArgs:
    # As transformers 5 reads it (GPTNeoXConfig.convert_rope_params_to_dict): a non-empty rope_scaling replaces
    # rope_parameters whole; rotary_emb_base and rotary_pct fill in what the chosen dict lacks (a top-level
    # rope_theta or partial_rotary_factor is not read).
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"GPT-NeoX config: rope type {rope.get('rope_type') or rope.get('type')!r} is not supported")
    if cfg.get("tie_word_embeddings", False):
        raise ValueError("GPT-NeoX config: tied embeddings are not supported (GPT-NeoX and Pythia untie them)")
    if not cfg.get("attention_bias", True):
        raise ValueError("GPT-NeoX config: attention_bias false is not supported")
    if cfg.get("hidden_act", "gelu") != "gelu":
        raise ValueError(f"GPT-NeoX config: hidden_act {cfg['hidden_act']!r} is not supported (only 'gelu')")
    args = NeoXArgs(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=cfg["num_attention_heads"],
        ffn_hidden_size=cfg["intermediate_size"],
        max_seq_len=cfg.get("max_position_embeddings", 2048),
        rotary_pct=rope.get("partial_rotary_factor", cfg.get("rotary_pct", 0.25)),
        rotary_base=float(rope.get("rope_theta", cfg.get("rotary_emb_base", 10000))),
        norm_eps=cfg.get("layer_norm_eps", 1e-5),
        init_std=cfg.get("initializer_range", 0.02),
        parallel_residual=cfg.get("use_parallel_residual", True),
    )
    if args.rotary_dim % 2:
        raise ValueError(f"GPT-NeoX config: rotary dim {args.rotary_dim} (head_dim x rotary_pct) must be even")
    return args


def hf_config_from_args(args: NeoXArgs) -> dict:
    return {
        "architectures": ["GPTNeoXForCausalLM"],
        "model_type": "gpt_neox",
        "vocab_size": args.vocab_size,
        "hidden_size": args.hidden_size,
        "num_hidden_layers": args.num_layers,
        "num_attention_heads": args.num_heads,
        "intermediate_size": args.ffn_hidden_size,
        "hidden_act": "gelu",
        "max_position_embeddings": args.max_seq_len,
        "layer_norm_eps": args.norm_eps,
        "initializer_range": args.init_std,
        "use_parallel_residual": args.parallel_residual,
        "tie_word_embeddings": False,
        "attention_bias": True,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": args.rotary_base,
            "partial_rotary_factor": args.rotary_pct,
        },
        # The same, as transformers 4.x reads it.
        "rotary_pct": args.rotary_pct,
        "rotary_emb_base": args.rotary_base,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "dtype": "float32",
    }


def rotary_permutation(args: NeoXArgs) -> torch.Tensor:
    """perm[i] = the HF dim that our dim i holds, within one head."""
    hd, r = args.head_dim, args.rotary_dim
    half, rh = hd // 2, r // 2
    pass_dims = list(range(r, hd))  # HF's non-rotating dims, split over our two zero-frequency blocks
    order = list(range(rh)) + pass_dims[: half - rh] + list(range(rh, r)) + pass_dims[half - rh :]
    return torch.tensor(order)


def _qkv_row_order(args: NeoXArgs, to_ours: bool) -> torch.Tensor:
    perm = rotary_permutation(args)
    if not to_ours:
        perm = torch.argsort(perm)
    hd = args.head_dim
    block = torch.cat([perm, hd + perm, 2 * hd + torch.arange(hd)])  # q and k permuted, v untouched
    return torch.cat([h * 3 * hd + block for h in range(args.num_heads)])


def _renames(args: NeoXArgs) -> dict[str, str]:
    """our name -> HF name."""
    # embed_out: the hub's name for the head, read by transformers 4 and (renamed on load) 5.
    names = {"embed.weight": "gpt_neox.embed_in.weight", "head.weight": "embed_out.weight"}
    for kind in ("weight", "bias"):
        names[f"norm.{kind}"] = f"gpt_neox.final_layer_norm.{kind}"
        for i in range(args.num_layers):
            ours, hf = f"layers.{i}.", f"gpt_neox.layers.{i}."
            names[ours + f"attn_norm.{kind}"] = hf + f"input_layernorm.{kind}"
            names[ours + f"mlp_norm.{kind}"] = hf + f"post_attention_layernorm.{kind}"
            names[ours + f"attn.qkv.{kind}"] = hf + f"attention.query_key_value.{kind}"
            names[ours + f"attn.out.{kind}"] = hf + f"attention.dense.{kind}"
            names[ours + f"mlp.fc_in.{kind}"] = hf + f"mlp.dense_h_to_4h.{kind}"
            names[ours + f"mlp.fc_out.{kind}"] = hf + f"mlp.dense_4h_to_h.{kind}"
    return names


def _check_keys(given: set[str], expected: set[str], side: str) -> None:
    missing, unexpected = sorted(expected - given), sorted(given - expected)
    if missing or unexpected:
        raise ValueError(
            f"{side} state dict does not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )


def state_dict_from_hf(sd: dict[str, torch.Tensor], args: NeoXArgs) -> dict[str, torch.Tensor]:
    # Hub checkpoints name the head embed_out; transformers 5 models call it lm_head.
    sd = {("embed_out.weight" if k == "lm_head.weight" else k): v for k, v in sd.items()}
    sd = {k: v for k, v in sd.items() if not k.endswith(_IGNORED_SUFFIXES)}
    names = _renames(args)
    _check_keys(set(sd), set(names.values()), "HF")
    out = {ours: sd[hf] for ours, hf in names.items()}
    order = _qkv_row_order(args, to_ours=True)
    for i in range(args.num_layers):
        for kind in ("weight", "bias"):
            key = f"layers.{i}.attn.qkv.{kind}"
            out[key] = out[key][order].contiguous()
    return out


def state_dict_to_hf(sd: dict[str, torch.Tensor], args: NeoXArgs) -> dict[str, torch.Tensor]:
    names = _renames(args)
    _check_keys(set(sd), set(names), "trnrecipes")
    order = _qkv_row_order(args, to_ours=False)
    out = {}
    for ours, hf in names.items():
        tensor = sd[ours]
        out[hf] = (tensor[order] if ".attn.qkv." in ours else tensor).contiguous()
    return out
