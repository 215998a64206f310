"""Which recipe keys may change when a run resumes from its checkpoint, and which never may: the rules behind
checkpoint.allow_changes, validated when a recipe is loaded (torch-free). Comparing a checkpoint's recipe with the
current one is trnrecipes.train.resume_compat's, which applies these rules.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterable

from trnrecipes.config.sections import Recipe
from trnrecipes.schema import shown

# Free to change on resume: how and where the run executes, how long it goes on, how it saves, logs and is profiled
# (monitor), how it started (init_from, init_optimizer: a resume reads the run's own checkpoint), what the eval job
# scores and where. The tokenizer's path may change too: its files are compared instead.
FREE = ("name", "description", "run_dir", "cluster", "slurm", "compile", "checkpoint", "layout", "train.max_steps",
        "train.log_every", "train.val_every", "train.val_batches", "train.init_from", "train.init_optimizer",
        "model.activation_checkpointing", "model.activation_checkpointing_full_layers", "model.attention",
        "model.init_std", "batch.micro_batch", "data.tokenizer", "data.eval_path", "eval", "monitor",
        "k8s")  # fmt: skip
# Never: the weights would not load, or would compute something else (which residual form, which dims rotate, which
# blocks hold how many experts of what width, an encoder's head: its labels, pooling and layers).
FIXED = ("model.family", "model.vocab_size", "model.hidden_size", "model.num_layers", "model.num_heads",
         "model.num_kv_heads", "model.ffn_hidden_size", "model.parallel_residual", "model.rotary_pct", "model.head_dim",
         "model.tie_embeddings", "model.num_experts", "model.moe_intermediate_size", "model.decoder_sparse_step",
         "model.mlp_only_layers", "model.type_vocab_size", "model.head", "model.num_labels", "model.pooling",
         "model.mlp_hidden_sizes")  # fmt: skip
# And per family: a learned position table (BERT's) has max_seq_len rows; rotary models have none.
FAMILY_FIXED = {"bert": ("model.max_seq_len",)}


def fixed_keys(family: object) -> tuple[str, ...]:
    """FIXED, with the keys `family` (a model.family) adds."""
    return FIXED + FAMILY_FIXED.get(family, ()) if isinstance(family, str) else FIXED


# Accepted changes of these reorder the data: the saved position would index other documents, so it is dropped.
DATA_ORDER = ("data", "train.seed", "batch.seq_len")
# Not recipe keys, but decisions allow_changes can take: a new DP size (each DP rank's position is its own).
PSEUDO_KEYS = ("layout.dp",)


def flat_keys(data: object, prefix: str = "") -> dict[str, object]:
    """{"optim": {"lr": 1}} -> {"optim.lr": 1}."""
    if not isinstance(data, dict):
        return {prefix: data}
    out: dict[str, object] = {}
    for key, value in data.items():
        out.update(flat_keys(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def matches(key: str, patterns: Iterable[str]) -> bool:
    """Whether `key` is one of `patterns` or inside one of them (a section)."""
    return any(key == p or key.startswith(p + ".") for p in patterns)


def allows(allowed: Iterable[str], key: str) -> bool:
    return matches(key, allowed)


def changes_data_order(accepted_keys: Iterable[str]) -> bool:
    return any(matches(key, DATA_ORDER) for key in accepted_keys)


def _recipe_keys() -> set[str]:
    """Every section and section.key of the recipe schema, plus the pseudo keys."""
    keys = set(PSEUDO_KEYS)
    for name, tp in typing.get_type_hints(Recipe).items():
        keys.add(name)
        for cls in typing.get_args(tp) or (tp,):  # the model section: every family's config
            if dataclasses.is_dataclass(cls):
                keys.update(f"{name}.{f.name}" for f in dataclasses.fields(cls))
    return keys


def check_allow_changes(allowed: Iterable[str], family: str | None = None) -> list[str]:
    """Problems with checkpoint.allow_changes entries (render time): each a section or key that may be allowed."""
    problems, known, fixed = [], _recipe_keys(), fixed_keys(family)
    for key in allowed:
        if not isinstance(key, str) or key not in known:
            problems.append(
                f"checkpoint.allow_changes: {shown(key)} is not a recipe section or section.key (e.g. optim.lr,"
                " data, layout.dp)"
            )
        elif matches(key, fixed) or any(s.startswith(key + ".") for s in fixed):
            problems.append(
                f"checkpoint.allow_changes: {key!r} covers the model's shape, which cannot change on resume"
                f" ({', '.join(s for s in fixed if matches(s, [key]))}); start a new run_dir (train.init_from)"
            )
    return problems
