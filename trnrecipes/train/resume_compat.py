"""Resuming is refused when the checkpoint's recipe means something else than this one: another model shape,
tokenizer, data, sequence length, seed, optimizer or precision. checkpoint.allow_changes names the changes a user
wants anyway (a new learning rate). The rules (what is free, fixed, or needs naming) are trnrecipes.config.changes',
which check_recipe applies to allow_changes at render time; the comparison is config/saved_recipe.py's (torch-free:
sbatch runs it too).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from trnrecipes.config.saved_recipe import resume_differences
from trnrecipes.config.sections import RecipeError


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
