"""Resuming is refused when the checkpoint's recipe means something else than this one: another model shape,
tokenizer, data, sequence length, seed, optimizer or precision. checkpoint.allow_changes names the changes a user
wants anyway (a new learning rate). Torch-free: check_recipe validates allow_changes at render time.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

from trnrecipes.recipe import RecipeError
from trnrecipes.schema import shown

# Free to change on resume: how and where the run executes, how long it goes on, how it saves and logs, how it
# started (init_from, init_optimizer: a resume reads the run's own checkpoint) and what the eval job scores. The
# tokenizer's path may change too: its files are compared instead.
FREE = ("name", "description", "run_dir", "cluster", "slurm", "compile", "checkpoint", "layout", "train.max_steps",
        "train.log_every", "train.val_every", "train.val_batches", "train.init_from", "train.init_optimizer",
        "model.activation_checkpointing", "model.init_std", "batch.micro_batch", "data.tokenizer",
        "data.eval_path")  # fmt: skip
# Never: the weights would not load, or would compute something else (which residual form, which dims rotate).
FIXED = ("model.family", "model.vocab_size", "model.hidden_size", "model.num_layers", "model.num_heads",
         "model.num_kv_heads", "model.ffn_hidden_size", "model.parallel_residual", "model.rotary_pct")  # fmt: skip
# Accepted changes of these reorder the data: the saved position would index other documents, so it is dropped.
DATA_ORDER = ("data", "train.seed", "batch.seq_len")
# Not recipe keys, but decisions allow_changes can take: a new DP size (each DP rank's position is its own).
PSEUDO_KEYS = ("layout.dp",)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _flat(data: object, prefix: str = "") -> dict[str, object]:
    """{"optim": {"lr": 1}} -> {"optim.lr": 1}."""
    if not isinstance(data, dict):
        return {prefix: data}
    out: dict[str, object] = {}
    for key, value in data.items():
        out.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _matches(key: str, patterns: Iterable[str]) -> bool:
    """Whether `key` is one of `patterns` or inside one of them (a section)."""
    return any(key == p or key.startswith(p + ".") for p in patterns)


def allows(allowed: Iterable[str], key: str) -> bool:
    return _matches(key, allowed)


def changes_data_order(accepted_keys: Iterable[str]) -> bool:
    return any(_matches(key, DATA_ORDER) for key in accepted_keys)


def _recipe_keys() -> set[str]:
    """Every section and section.key of the recipe schema, plus the pseudo keys."""
    import dataclasses
    import typing

    from trnrecipes.recipe import Recipe

    keys = set(PSEUDO_KEYS)
    for name, tp in typing.get_type_hints(Recipe).items():
        keys.add(name)
        for cls in typing.get_args(tp) or (tp,):  # the model section: every family's config
            if dataclasses.is_dataclass(cls):
                keys.update(f"{name}.{f.name}" for f in dataclasses.fields(cls))
    return keys


def check_allow_changes(allowed: Iterable[str]) -> list[str]:
    """Problems with checkpoint.allow_changes entries (render time): each a section or key that may be allowed."""
    problems, known = [], _recipe_keys()
    for key in allowed:
        if not isinstance(key, str) or key not in known:
            problems.append(
                f"checkpoint.allow_changes: {shown(key)} is not a recipe section or section.key (e.g. optim.lr,"
                " data, layout.dp)"
            )
        elif _matches(key, FIXED) or any(s.startswith(key + ".") for s in FIXED):
            problems.append(
                f"checkpoint.allow_changes: {key!r} covers the model's shape, which cannot change on resume"
                f" ({', '.join(s for s in FIXED if _matches(s, [key]))}); start a new run_dir (train.init_from)"
            )
    return problems


def section_differences(saved: object, current: object, prefix: str) -> str:
    """'model.num_labels: 3 -> 2, ...': where two values of one recipe section (dataclasses or dicts) differ, the
    saved value first."""
    import dataclasses

    def flat(value: object) -> dict[str, object]:
        return _flat(dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value, prefix)

    was, now = flat(saved), flat(current)
    keys = sorted(k for k in set(was) | set(now) if was.get(k, "<unset>") != now.get(k, "<unset>"))
    return ", ".join(f"{k}: {shown(was.get(k, '<unset>'))} -> {shown(now.get(k, '<unset>'))}" for k in keys)


def _tokenizer_digest(directory: Path | None) -> str | None:
    if directory is None or not directory.is_dir():
        return None
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        file = directory / name
        digest.update(name.encode() + b"\0" + (file.read_bytes() if file.is_file() else b"<absent>") + b"\0")
    return digest.hexdigest()


def resume_differences(
    checkpoint: Path, current: dict, tokenizer_dir: Path | None, allowed: Iterable[str]
) -> tuple[list[str], list[str]]:
    """(refused, accepted) differences between checkpoint/recipe.yaml and the `current` recipe dict, as
    'key: saved -> now' lines. Refused: the model's shape, the tokenizer's files, and anything else that changes
    the meaning of the weights or the data position unless checkpoint.allow_changes names it."""
    from trnrecipes.checkpoint import saved_recipe  # torch: only when a checkpoint is read

    saved, now = _flat(saved_recipe(checkpoint)), _flat(current)
    refused, accepted = [], []
    for key in sorted(set(saved) | set(now)):
        a, b = saved.get(key, "<unset>"), now.get(key, "<unset>")
        if a == b or (_matches(key, FREE) and not _matches(key, FIXED)):
            continue
        line = f"{key}: {shown(a)} -> {shown(b)}"
        if not _matches(key, FIXED) and _matches(key, allowed):
            accepted.append(line)
        else:
            refused.append(line + ("" if not _matches(key, FIXED) else " (cannot change on resume)"))
    theirs = _tokenizer_digest(checkpoint / "tokenizer")
    ours = _tokenizer_digest(tokenizer_dir)
    if theirs is not None and ours is not None and theirs != ours:
        line = f"data.tokenizer: its files ({', '.join(TOKENIZER_FILES)}) differ from the checkpoint's copy"
        # Allowed only by name: token ids would mean other text unless the files merely were re-serialized.
        (accepted if "data.tokenizer" in allowed else refused).append(line)
    return refused, accepted


def check_resume(
    checkpoint: Path, current: dict, tokenizer_dir: Path | None, allowed: Iterable[str], log=print
) -> list[str]:
    """Raise RecipeError listing every refused difference; log the accepted ones and return their keys."""
    refused, accepted = resume_differences(checkpoint, current, tokenizer_dir, allowed)
    if refused:
        raise RecipeError(
            f"cannot resume from {checkpoint}: this recipe differs from the one it was trained with:\n  "
            + "\n  ".join(refused)
            + "\nrestore those values, start a new run_dir, or (where the change is sane, e.g. optim.lr) name each"
            " key in checkpoint.allow_changes"
        )
    for line in accepted:
        log(f"[trnrecipes] resuming with a changed recipe (checkpoint.allow_changes): {line}")
    return [line.split(":", 1)[0] for line in accepted]
