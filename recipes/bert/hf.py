"""BERT <-> Hugging Face: config.json and state dicts (plain tensor ops; no transformers import).

Export: the classification head as BertForSequenceClassification ("bert." encoder and pooler, "classifier"), which
AutoModelForSequenceClassification loads. The "mlp" head has no transformers class: it is exported as BertModel
(bare encoder keys, no pooler) plus its linears as extra "mlp_head.<i>" tensors and a "trnrecipes_head" key in
config.json; AutoModel loads the encoder from it (warning that the pooler is new and mlp_head unused), and import
reads both back.

Import reads those and BERT's other layouts: bare BertModel keys (all-MiniLM-L6-v2), "bert."-prefixed ones
(BertForSequenceClassification, BertForMaskedLM, BertForPreTraining), LayerNorm gamma/beta (old TF conversions
such as bert-base-uncased). Dropped on import: the pre-training heads ("cls.*": masked LM and next sentence), the
buffers older transformers saved, and the pooler when the head is "mlp" (which does not use it). Head weights the
checkpoint lacks (a BertModel has no classifier; a BertForMaskedLM no pooler) are initialised as
`Bert.init_weights(seed=HEAD_INIT_SEED)` draws them, with a warning naming them, so fine-tuning can start from it.
"""

from __future__ import annotations

import json
import warnings

import torch

from recipes.bert.model import Bert, BertArgs
from recipes.bert.spec import HEADS, POOLINGS
from recipes.common.init import fill_region

HEAD_KEY = "trnrecipes_head"  # config.json: the "mlp" head's description
HEAD_INIT_SEED = 0
_IGNORED_SUFFIXES = ("embeddings.position_ids", "embeddings.token_type_ids")  # buffers, not weights
_DROPPED_PREFIXES = ("cls.",)  # BertForPreTraining / BertForMaskedLM heads
_KINDS = ("weight", "bias")


def args_from_hf_config(cfg: dict) -> BertArgs:
    """BertArgs from a BERT config.json dict; ValueError naming every feature this model lacks."""
    required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
    if missing := [key for key in required if key not in cfg]:
        raise ValueError(
            f"BERT config lacks {', '.join(missing)} (a BERT config.json has all of: {', '.join(required)})"
        )
    problems = []
    if cfg.get("model_type", "bert") != "bert":
        problems.append(f"model_type {cfg['model_type']!r} (need 'bert')")
    if cfg.get("hidden_act", "gelu") != "gelu":
        problems.append(f"hidden_act {cfg['hidden_act']!r} (only 'gelu', the exact erf GELU)")
    if cfg.get("position_embedding_type", "absolute") != "absolute":  # transformers 4's relative variants
        problems.append(f"position_embedding_type {cfg['position_embedding_type']!r} (only 'absolute')")
    for key in ("is_decoder", "add_cross_attention"):
        if cfg.get(key, False):
            problems.append(f"{key}=true (this is an encoder: bidirectional, no cross-attention)")
    if cfg.get("problem_type") not in (None, "single_label_classification"):
        problems.append(f"problem_type {cfg['problem_type']!r} (the loss here is single-label cross-entropy)")
    head = cfg.get(HEAD_KEY) or {"kind": "classification"}
    if not isinstance(head, dict) or head.get("kind") not in HEADS or head.get("pooling", "cls") not in POOLINGS:
        problems.append(f"{HEAD_KEY} {head!r} (kind one of {HEADS}, pooling one of {POOLINGS})")
    if problems:
        raise ValueError("unsupported BERT config: " + "; ".join(problems))
    id2label = cfg.get("id2label")
    args = BertArgs(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=cfg["num_attention_heads"],
        ffn_hidden_size=cfg["intermediate_size"],
        max_seq_len=cfg.get("max_position_embeddings", 512),
        type_vocab_size=cfg.get("type_vocab_size", 2),
        pad_token_id=cfg.get("pad_token_id", 0),
        norm_eps=cfg.get("layer_norm_eps", 1e-12),
        init_std=cfg.get("initializer_range", 0.02),
        dropout=float(cfg.get("hidden_dropout_prob", 0.1)),
        attention_dropout=float(cfg.get("attention_probs_dropout_prob", 0.1)),
        classifier_dropout=None if cfg.get("classifier_dropout") is None else float(cfg["classifier_dropout"]),
        head=head["kind"],
        num_labels=len(id2label) if id2label else cfg.get("num_labels", 2),
        pooling=head.get("pooling", "cls"),
        mlp_hidden_sizes=_sizes(head.get("hidden_sizes", ())),
    )
    if problems := args.problems():
        raise ValueError("unsupported BERT config: " + "; ".join(problems))
    return args


def hf_config_from_args(args: BertArgs) -> dict:
    """A config.json dict that transformers' BertConfig(**d) reads back as this model (5.x, and 4.x)."""
    cfg = {
        "architectures": ["BertForSequenceClassification" if args.head == "classification" else "BertModel"],
        "model_type": "bert",
        "vocab_size": args.vocab_size,
        "hidden_size": args.hidden_size,
        "num_hidden_layers": args.num_layers,
        "num_attention_heads": args.num_heads,
        "intermediate_size": args.ffn_hidden_size,
        "hidden_act": "gelu",
        "max_position_embeddings": args.max_seq_len,
        "position_embedding_type": "absolute",
        "type_vocab_size": args.type_vocab_size,
        "pad_token_id": args.pad_token_id,
        "layer_norm_eps": args.norm_eps,
        "initializer_range": args.init_std,
        "hidden_dropout_prob": args.dropout,
        "attention_probs_dropout_prob": args.attention_dropout,
        "classifier_dropout": args.classifier_dropout,
        "id2label": {str(i): f"LABEL_{i}" for i in range(args.num_labels)},
        "label2id": {f"LABEL_{i}": i for i in range(args.num_labels)},
        "problem_type": "single_label_classification",  # else HF picks the loss from the labels' dtype
        "dtype": "float32",
    }
    if args.head == "mlp":
        cfg[HEAD_KEY] = {"kind": "mlp", "pooling": args.pooling, "hidden_sizes": list(args.mlp_hidden_sizes)}
    return cfg


def _encoder_names(args: BertArgs) -> dict[str, str]:
    """our name -> HF's bare (BertModel) name, for everything but the fused qkv."""
    names = {
        "embed.word.weight": "embeddings.word_embeddings.weight",
        "embed.position.weight": "embeddings.position_embeddings.weight",
        "embed.token_type.weight": "embeddings.token_type_embeddings.weight",
    }
    for kind in _KINDS:
        names[f"embed.norm.{kind}"] = f"embeddings.LayerNorm.{kind}"
        for i in range(args.num_layers):
            ours, hf = f"layers.{i}.", f"encoder.layer.{i}."
            names[ours + f"attn.out.{kind}"] = hf + f"attention.output.dense.{kind}"
            names[ours + f"attn_norm.{kind}"] = hf + f"attention.output.LayerNorm.{kind}"
            names[ours + f"mlp.fc_in.{kind}"] = hf + f"intermediate.dense.{kind}"
            names[ours + f"mlp.fc_out.{kind}"] = hf + f"output.dense.{kind}"
            names[ours + f"mlp_norm.{kind}"] = hf + f"output.LayerNorm.{kind}"
    return names


def _head_names(args: BertArgs) -> dict[str, str]:
    """our name -> HF's (bare) name for the head's parameters."""
    names = {}
    for kind in _KINDS:
        if args.head == "classification":
            names[f"head.pooler.{kind}"] = f"pooler.dense.{kind}"
            names[f"head.classifier.{kind}"] = f"classifier.{kind}"
        else:
            for i in range(len(args.head_widths()) - 1):
                names[f"head.linears.{i}.{kind}"] = f"mlp_head.{i}.{kind}"
    return names


def _qkv_names(i: int) -> list[str]:
    return [f"encoder.layer.{i}.attention.self.{p}" for p in ("query", "key", "value")]


def _shapes(args: BertArgs) -> dict[str, tuple[int, ...]]:
    """Our parameter shapes, read off the model built on the meta device (exact by construction)."""
    with torch.device("meta"):
        return {name: tuple(p.shape) for name, p in Bert(args).named_parameters()}


def _hf_shapes(args: BertArgs, names: dict[str, str], ours: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """HF (bare) name -> shape for the renamed parameters `names` and every layer's q, k and v."""
    h = args.hidden_size
    shapes = {hf: ours[name] for name, hf in names.items()}
    for i in range(args.num_layers):
        shapes |= {f"{name}.{kind}": (h, h) if kind == "weight" else (h,) for name in _qkv_names(i) for kind in _KINDS}
    return shapes


def _check(given: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]], side: str) -> None:
    missing, unknown = sorted(set(expected) - set(given)), sorted(set(given) - set(expected))
    wrong = [f"{k}: {tuple(given[k].shape)} != {s}" for k, s in expected.items() if k in given and given[k].shape != s]
    if missing or unknown or wrong:
        raise ValueError(
            f"{side} state dict does not match the config: missing {missing[:5]}, unknown {unknown[:5]},"
            f" wrong shapes {wrong[:5]}"
        )


def _normalised(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Bare BertModel names: prefix "bert." stripped, gamma/beta renamed, buffers and pre-training heads dropped."""
    out = {}
    for key, tensor in sd.items():
        if key.endswith(_IGNORED_SUFFIXES) or key.startswith(_DROPPED_PREFIXES):
            continue
        key = key.removeprefix("bert.")
        if ".LayerNorm." in key and key.endswith((".gamma", ".beta")):  # TF-era checkpoints
            key = key.rsplit(".", 1)[0] + (".weight" if key.endswith(".gamma") else ".bias")
        out[key] = tensor
    return out


def _initial(names: list[str], args: BertArgs, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Parameters `names` as Bert(args).init_weights(HEAD_INIT_SEED) draws them (only these are drawn)."""
    with torch.device("meta"):
        rules = Bert(args).init_rules()
    out = {}
    for name in names:
        out[name] = torch.empty(shapes[name])
        fill_region(out[name], shapes[name], (0,) * len(shapes[name]), rules[name], HEAD_INIT_SEED, name)
    return out


def state_dict_from_hf(sd: dict[str, torch.Tensor], args: BertArgs) -> dict[str, torch.Tensor]:
    """A BERT state dict in any layout the module docstring lists -> Bert's (q, k, v fused per head)."""
    sd = _normalised(sd)
    if args.head == "mlp":
        sd = {k: v for k, v in sd.items() if not k.startswith("pooler.")}  # BertModel's pooler: unused here
    head = _head_names(args)
    new = sorted(name for name, hf in head.items() if hf not in sd)  # head weights the checkpoint lacks
    names = _encoder_names(args) | {name: hf for name, hf in head.items() if name not in new}
    shapes = _shapes(args)
    _check(sd, _hf_shapes(args, names, shapes), "Hugging Face BERT")
    out = {name: sd[hf] for name, hf in names.items()}
    for i in range(args.num_layers):
        for kind in _KINDS:
            q, k, v = (sd[f"{name}.{kind}"] for name in _qkv_names(i))
            rest = q.shape[1:]
            per_head = [t.reshape(args.num_heads, args.head_dim, *rest) for t in (q, k, v)]
            out[f"layers.{i}.attn.qkv.{kind}"] = torch.stack(per_head, dim=1).reshape(-1, *rest)
    if new:
        warnings.warn(
            f"the BERT checkpoint has no {', '.join(head[n] for n in new)}: initialised as"
            f" init_weights(seed={HEAD_INIT_SEED}) draws them; train the head before trusting its outputs",
            stacklevel=2,
        )
        out |= _initial(new, args, shapes)
    return out


def state_dict_to_hf(sd: dict[str, torch.Tensor], args: BertArgs) -> dict[str, torch.Tensor]:
    """Bert's state dict -> BertForSequenceClassification's (classification head) or BertModel's plus the
    mlp_head tensors ("mlp" head); the exact inverse of state_dict_from_hf."""
    _check(sd, _shapes(args), "trnrecipes BERT")
    prefix = "bert." if args.head == "classification" else ""  # BertForSequenceClassification nests its BertModel
    out = {prefix + hf: sd[name] for name, hf in _encoder_names(args).items()}
    for name, hf in _head_names(args).items():
        out[hf if hf.startswith(("classifier.", "mlp_head.")) else prefix + hf] = sd[name]
    for i in range(args.num_layers):
        for kind in _KINDS:
            qkv = sd[f"layers.{i}.attn.qkv.{kind}"]
            rest = qkv.shape[1:]
            per_head = qkv.reshape(args.num_heads, 3, args.head_dim, *rest)
            for j, name in enumerate(_qkv_names(i)):
                # Own, contiguous copies: slices share one storage, which safetensors refuses to save.
                out[f"{prefix}{name}.{kind}"] = per_head[:, j].reshape(-1, *rest).clone()
    return out


def _sizes(value) -> tuple:
    """trnrecipes_head.hidden_sizes as a tuple; a string is no list of sizes (tuple("64") read as '6', '4')."""
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{HEAD_KEY}.hidden_sizes must be a list of integers, got {json.dumps(value)[:60]}")
    return tuple(value)
