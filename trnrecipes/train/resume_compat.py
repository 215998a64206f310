"""Resuming is refused when the checkpoint's recipe means something else than this one: another model shape,
tokenizer, data, sequence length, seed, optimizer or precision. checkpoint.allow_changes names the changes a user
wants anyway (a new learning rate). The rules (what is free, fixed, or needs naming) are trnrecipes.config.changes',
which check_recipe applies to allow_changes at render time. Torch-free until a checkpoint is read.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

from trnrecipes.config.changes import FIXED, FREE, flat_keys, matches
from trnrecipes.config.sections import RecipeError
from trnrecipes.schema import shown

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


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

    saved, now = flat_keys(saved_recipe(checkpoint)), flat_keys(current)
    refused, accepted = [], []
    for key in sorted(set(saved) | set(now)):
        a, b = saved.get(key, "<unset>"), now.get(key, "<unset>")
        if a == b or (matches(key, FREE) and not matches(key, FIXED)):
            continue
        line = f"{key}: {shown(a)} -> {shown(b)}"
        if not matches(key, FIXED) and matches(key, allowed):
            accepted.append(line)
        else:
            refused.append(line + ("" if not matches(key, FIXED) else " (cannot change on resume)"))
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
