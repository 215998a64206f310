"""Checkpoint directories: model weights (safetensors, our parameter names), the resolved recipe, the tokenizer,
a manifest with checksums, and a `done` marker written last. A directory appears whole or not at all (temp dir +
atomic rename), and loading verifies every checksum and never unpickles anything.

This is the model part; optimizer/data/RNG state, async saves and resume are issue #6.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file, save_file

from trnrecipes.recipe import Recipe, RecipeError, recipe_from_dict

FORMAT = 1
WEIGHTS = "model.safetensors"
DONE = "done"


class CheckpointError(RecipeError):
    """A checkpoint that is missing, incomplete or corrupt; the message names the file."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_model_checkpoint(
    out: Path, state_dict: dict[str, torch.Tensor], recipe: Recipe, tokenizer_dir: Path | None = None, step: int = 0
) -> Path:
    out = Path(out)
    if out.exists():
        raise CheckpointError(f"{out} already exists; choose a new --out (checkpoints are never overwritten)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save_file({k: v.detach().contiguous().cpu() for k, v in state_dict.items()}, tmp / WEIGHTS)
        (tmp / "recipe.yaml").write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))
        if tokenizer_dir is not None:
            shutil.copytree(tokenizer_dir, tmp / "tokenizer")
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        manifest = {
            "format": FORMAT,
            "step": step,
            "files": {str(p.relative_to(tmp)): _sha256(p) for p in files},
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        for p in [*files, tmp / "manifest.json"]:
            with p.open("rb") as f:
                os.fsync(f.fileno())
        (tmp / DONE).write_text("")
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def verify(path: Path) -> dict:
    """The manifest of a complete, uncorrupted checkpoint, else CheckpointError saying what is wrong."""
    path = Path(path)
    if not (path / DONE).exists():
        raise CheckpointError(f"{path}: no '{DONE}' marker: not a complete trnrecipes checkpoint")
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}/manifest.json: unreadable ({err})") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or manifest.get("format") != FORMAT or WEIGHTS not in files:
        raise CheckpointError(f"{path}/manifest.json: not a format-{FORMAT} manifest listing {WEIGHTS}")
    for name, digest in files.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file}: listed in the manifest but missing")
        if _sha256(file) != digest:
            raise CheckpointError(f"{file}: checksum mismatch (truncated or corrupted)")
    return manifest


def read_model_checkpoint(path: Path) -> tuple[Recipe, dict[str, torch.Tensor], Path | None]:
    """(recipe, state dict, tokenizer dir or None), after verifying the checkpoint."""
    path = Path(path)
    verify(path)
    recipe = recipe_from_dict(yaml.safe_load((path / "recipe.yaml").read_text()), str(path / "recipe.yaml"))
    tokenizer = path / "tokenizer"
    return recipe, load_file(path / WEIGHTS), tokenizer if tokenizer.is_dir() else None
