"""A checkpoint's recipe read back, and how it differs from the recipe of a run that would resume from it:
torch-free, so `trnrecipes sbatch` can say at render time what the trainer would refuse at the job's start (after
its wait in the queue). The rules (what is free, fixed, or needs naming in checkpoint.allow_changes) are
trnrecipes.config.changes'; the trainer's refusal is trnrecipes.train.resume_compat.check_resume.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable
from pathlib import Path

from trnrecipes.config.changes import FREE, fixed_keys, flat_keys, matches
from trnrecipes.config.families import FAMILIES
from trnrecipes.schema import shown

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")  # what a checkpoint's tokenizer/ copy is compared by

# Before each family had its own model section, recipes held every family's fields; a checkpoint from then lists
# the other family's at these defaults. Dropped on reading, so those checkpoints still resume and evaluate.
LEGACY_MODEL_DEFAULTS = {"num_kv_heads": None, "rotary_pct": 1.0, "parallel_residual": True}
# Recipe keys added since checkpoints were first written (classification, incremental training), at the value a
# recipe that does not set them resolves to: filled in where a saved recipe lacks them, so those checkpoints resume.
LEGACY_SECTION_DEFAULTS = {
    "train": {"init_optimizer": "reset"},
    "optim": {"state_dtype": "fp32"},
    "data": {"label_field": "label", "eval_path": None, "sources": []},
}


def read_saved_recipe(path: Path) -> dict:
    """The resolved recipe a checkpoint was written with, as the plain mapping in its recipe.yaml (RecipeError if
    it cannot be read)."""
    from trnrecipes.config.recipe import read_recipe_file  # config.recipe imports config.changes: no cycle

    data = read_recipe_file(Path(path) / "recipe.yaml")  # size-capped, no YAML aliases
    for section, defaults in LEGACY_SECTION_DEFAULTS.items():
        if isinstance(data.get(section), dict):
            data[section] = defaults | data[section]
    model = data.get("model")
    if isinstance(model, dict) and model.get("family") in FAMILIES:
        config = FAMILIES[model["family"]].config
        fields = {f.name for f in dataclasses.fields(config)}
        for key, default in LEGACY_MODEL_DEFAULTS.items():
            if key not in fields and key in model and model[key] == default:
                del model[key]
        try:  # resolved as this version resolves it (num_kv_heads: null -> num_heads), so equal sections compare equal
            data["model"] = {**model, **dataclasses.asdict(config(**model))}
        except (TypeError, ValueError):
            pass  # left as saved: the resume check reports what differs
    return data


def tokenizer_digest(directory: Path | None) -> str | None:
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
    saved, now = flat_keys(read_saved_recipe(checkpoint)), flat_keys(current)
    refused, accepted, fixed = [], [], fixed_keys(saved.get("model.family"))
    for key in sorted(set(saved) | set(now)):
        a, b = saved.get(key, "<unset>"), now.get(key, "<unset>")
        if a == b or (matches(key, FREE) and not matches(key, fixed)):
            continue
        line = f"{key}: {shown(a)} -> {shown(b)}"
        if not matches(key, fixed) and matches(key, allowed):
            accepted.append(line)
        else:
            refused.append(line + ("" if not matches(key, fixed) else " (cannot change on resume)"))
    theirs = tokenizer_digest(checkpoint / "tokenizer")
    ours = tokenizer_digest(tokenizer_dir)
    if theirs is not None and ours is not None and theirs != ours:
        line = f"data.tokenizer: its files ({', '.join(TOKENIZER_FILES)}) differ from the checkpoint's copy"
        # Allowed only by name: token ids would mean other text unless the files merely were re-serialized.
        (accepted if "data.tokenizer" in allowed else refused).append(line)
    return refused, accepted


# What a new phase from train.init_from may change of a rotary model: a long-context stage raises the length and the
# RoPE base or scaling (Meta's and Qwen's reports), which no weight depends on. BERT's max_seq_len is its position
# table's rows: fixed (changes.FAMILY_FIXED).
CONTEXT_KEYS = ("model.max_seq_len", "model.rotary_base", "model.rope_scaling")


def init_from_problem(recipe, checkpoint: Path) -> str | None:
    """What the trainer refuses of train.init_from's checkpoint, without reading its tensors (sbatch asks too):
    init_optimizer 'keep' of weights only, or a model that differs in more than how it runs (changes.FREE) and a
    rotary model's context (CONTEXT_KEYS). RecipeError where its recipe.yaml cannot be read."""
    try:
        has_state = (checkpoint / "state.json").is_file()
    except OSError as err:  # a directory this user cannot search (another user's checkpoint): Python 3.11 raises
        return f"train.init_from {checkpoint}: cannot be read ({err.strerror or err})"
    if recipe.train.init_optimizer == "keep" and not has_state:
        return (
            f"train.init_from {checkpoint} holds weights only (no optimizer state: a `convert from-hf` output or a"
            " model-only copy), so train.init_optimizer 'keep' has nothing to keep; use 'reset'"
        )
    from trnrecipes.config.recipe import recipe_from_dict  # config.recipe imports config.changes: no cycle

    was = recipe_from_dict(read_saved_recipe(checkpoint), str(checkpoint / "recipe.yaml"), launching=False).model
    if was.family != recipe.model.family:
        return (
            f"train.init_from {checkpoint}: its model.family is {was.family}, this recipe's {recipe.model.family};"
            " a model fine-tunes in the shape it was trained in"
        )
    fixed, free = fixed_keys(was.family), FREE + CONTEXT_KEYS
    differs = []
    for f in dataclasses.fields(was):
        key, a, b = f"model.{f.name}", getattr(was, f.name), getattr(recipe.model, f.name, None)
        if a != b and (matches(key, fixed) or not matches(key, free)):
            differs.append(f"{key}: {shown(a)} -> {shown(b)}")
    if not differs:
        return None
    return (
        f"train.init_from {checkpoint}: its model section differs from this recipe's (checkpoint -> recipe):"
        f" {', '.join(differs)}; a model fine-tunes in the shape it was trained in"
    )
