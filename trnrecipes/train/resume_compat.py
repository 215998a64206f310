"""Resuming is refused when the checkpoint's recipe means something else than this one: another model shape,
tokenizer, data, sequence length, seed, optimizer or precision. checkpoint.allow_changes names the changes a user
wants anyway (a new learning rate). Torch-free: check_recipe validates allow_changes at render time.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from pathlib import Path

from trnrecipes.recipe import RecipeError

# Free to change on resume: how and where the run executes, how long it goes on, how it saves and logs. The
# tokenizer's path may change too: its files are compared instead.
FREE = ("name", "description", "run_dir", "cluster.", "slurm.", "compile.", "checkpoint.", "layout.", "train.max_steps",
        "train.log_every", "train.val_every", "train.val_batches", "train.init_from", "model.activation_checkpointing",
        "model.init_std", "batch.micro_batch", "data.tokenizer")  # fmt: skip
# Never: the weights would not load, or token ids would mean other text.
SHAPE = ("model.family", "model.vocab_size", "model.hidden_size", "model.num_layers", "model.num_heads",
         "model.num_kv_heads", "model.ffn_hidden_size")  # fmt: skip
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _flat(data: object, prefix: str = "") -> dict[str, object]:
    if not isinstance(data, dict):
        return {prefix: data}
    out: dict[str, object] = {}
    for key, value in data.items():
        out.update(_flat(value, f"{prefix}{key}."))
    return {k.rstrip("."): v for k, v in out.items()}


def _matches(key: str, patterns: Iterable[str]) -> bool:
    return any(key == p or (p.endswith(".") and key.startswith(p)) or key.startswith(p + ".") for p in patterns)


def check_allow_changes(allowed: Iterable[str]) -> list[str]:
    """Problems with checkpoint.allow_changes entries (render time): each a section or key that may be allowed."""
    problems = []
    for key in allowed:
        if not re.fullmatch(r"[a-z_]+(\.[a-z_]+)?", key):
            problems.append(f"checkpoint.allow_changes: {key[:80]!r} is not a section or section.key (e.g. optim.lr)")
        elif _matches(key, SHAPE) or any(s.startswith(key + ".") for s in SHAPE):
            problems.append(
                f"checkpoint.allow_changes: {key!r} covers the model's shape, which cannot change on resume"
                f" ({', '.join(s for s in SHAPE if _matches(s, [key]))}); start a new run_dir (train.init_from)"
            )
    return problems


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
        if a == b or (_matches(key, FREE) and not _matches(key, SHAPE)):
            continue
        line = f"{key}: {str(a)[:60]} -> {str(b)[:60]}"
        if not _matches(key, SHAPE) and _matches(key, allowed):
            accepted.append(line)
        else:
            refused.append(line + ("" if not _matches(key, SHAPE) else " (shape: cannot change)"))
    theirs = _tokenizer_digest(checkpoint / "tokenizer")
    ours = _tokenizer_digest(tokenizer_dir)
    if theirs is not None and ours is not None and theirs != ours:
        line = f"data.tokenizer: its files ({', '.join(TOKENIZER_FILES)}) differ from the checkpoint's copy"
        # Allowed only by name: token ids would mean other text unless the files merely were re-serialized.
        (accepted if "data.tokenizer" in allowed else refused).append(line)
    return refused, accepted


def check_resume(checkpoint: Path, current: dict, tokenizer_dir: Path | None, allowed: Iterable[str], log=print):
    """Raise RecipeError listing every refused difference; log the accepted ones."""
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
