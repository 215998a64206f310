"""Checkpoint directories, written so that work is never lost and a half-written one is never mistaken for whole.

    step_N/
      model.safetensors                 weights, our names (TP > 1: model-tp00-of-08.safetensors ..., one per rank)
      shards.json                       per parameter: the dim its TP shards split, or null (replicated)
      optim-tp00-of-01.safetensors      AdamW moments per parameter (training checkpoints)
      state.json                        step, layout; data-dpNNNN.json / rng-rankNNNN.safetensors per rank
      recipe.yaml, tokenizer/           the resolved recipe and the tokenizer files
      manifest.json                     sha256 of every file above
      done                              written last, once everything above is fsync'd
Files are written into a temp dir that is renamed to step_N at the end: step_N exists whole or not at all. Loading
verifies every checksum and reads tensors with safetensors and the rest as JSON/YAML: nothing is ever unpickled.
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

FORMAT = 2
WEIGHTS = "model.safetensors"
SHARDS = "shards.json"
DONE = "done"


class CheckpointError(RecipeError):
    """A checkpoint that is missing, incomplete or corrupt; the message names the file."""


def shard_file(prefix: str, tp_rank: int, tp: int) -> str:
    """The file of TP rank `tp_rank` of `prefix` ("model" or "optim"); unsharded weights are model.safetensors."""
    if prefix == "model" and tp == 1:
        return WEIGHTS
    return f"{prefix}-tp{tp_rank:02d}-of-{tp:02d}.safetensors"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fsync_dir(path: Path) -> None:
    """Make the directory's entries (files created or renamed in it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())


def hash_and_sync(path: Path) -> str:
    """sha256 of a file just written (read back while it is still in the page cache), after an fsync: its
    manifest entry. Each rank calls this on its own files, so no one reads the whole checkpoint back."""
    fsync_file(path)
    return _sha256(path)


def write_common(tmp: Path, recipe: Recipe, tokenizer_dir: Path | None) -> None:
    (tmp / "recipe.yaml").write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))
    if tokenizer_dir is not None and not (tmp / "tokenizer").exists():
        shutil.copytree(tokenizer_dir, tmp / "tokenizer")


def finalize(tmp: Path, out: Path, step: int, digests: dict[str, str] | None = None) -> Path:
    """Manifest of every file in `tmp`, the done marker, then one rename to `out`, each made durable in turn.

    digests: files (relative names) already fsync'd and hashed by whoever wrote them (hash_and_sync; in training,
    each rank its own shards); only the others (recipe, tokenizer, ...) are read here.
    """
    known = digests or {}
    paths = sorted(tmp.rglob("*"))
    files = {str(p.relative_to(tmp)): p for p in paths if p.is_file()}
    if missing := sorted(set(known) - set(files)):
        raise CheckpointError(f"{tmp}: {missing[0]} was reported written but is not there ({len(missing)} missing)")
    entries = {name: known[name] if name in known else hash_and_sync(p) for name, p in files.items()}
    manifest = tmp / "manifest.json"
    manifest.write_text(json.dumps({"format": FORMAT, "step": step, "files": entries}, indent=2) + "\n")
    fsync_file(manifest)
    for d in [tmp, *(p for p in paths if p.is_dir())]:
        fsync_dir(d)
    # Only now, with everything it vouches for on disk, the done marker; then the rename that publishes step_N.
    (tmp / DONE).write_text("")
    fsync_file(tmp / DONE)
    fsync_dir(tmp)
    os.replace(tmp, out)
    fsync_dir(out.parent)
    return out


def write_model_checkpoint(
    out: Path, state_dict: dict[str, torch.Tensor], recipe: Recipe, tokenizer_dir: Path | None = None, step: int = 0
) -> Path:
    """A weights-only checkpoint (convert from-hf), same format as training's with TP 1."""
    out = Path(out)
    if out.exists():
        raise CheckpointError(f"{out} already exists; choose a new --out (checkpoints are never overwritten)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save_file({k: v.detach().contiguous().cpu() for k, v in state_dict.items()}, tmp / WEIGHTS)
        (tmp / SHARDS).write_text(json.dumps({"tp": 1, "dims": {k: None for k in state_dict}}) + "\n")
        write_common(tmp, recipe, tokenizer_dir)
        return finalize(tmp, out, step)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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
    if not isinstance(files, dict) or manifest.get("format") != FORMAT or SHARDS not in files:
        raise CheckpointError(f"{path}/manifest.json: not a format-{FORMAT} manifest listing {SHARDS}")
    for name, digest in files.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file}: listed in the manifest but missing")
        if _sha256(file) != digest:
            raise CheckpointError(f"{file}: checksum mismatch (truncated or corrupted)")
    return manifest


def read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: unreadable ({err})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return value


def consolidate(path: Path, prefix: str = "model") -> dict[str, torch.Tensor]:
    """Full tensors from the per-TP-rank files `<prefix>-tpNN-of-MM.safetensors` (or the single unsharded file)."""
    shards = read_json(path / SHARDS)
    tp, dims = int(shards["tp"]), shards["dims"]
    parts = [load_file(path / shard_file(prefix, r, tp)) for r in range(tp)]
    if tp == 1:
        return parts[0]
    full = {}
    for name, tensor in parts[0].items():
        dim = dims.get(name.split(".", 1)[1] if prefix == "optim" else name)
        full[name] = tensor if dim is None else torch.cat([p[name] for p in parts], dim=dim)
    return full


def read_model_checkpoint(path: Path) -> tuple[Recipe, dict[str, torch.Tensor], Path | None]:
    """(recipe, consolidated state dict, tokenizer dir or None), after verifying the checkpoint."""
    path = Path(path)
    verify(path)
    recipe = recipe_from_dict(yaml.safe_load((path / "recipe.yaml").read_text()), str(path / "recipe.yaml"))
    tokenizer = path / "tokenizer"
    return recipe, consolidate(path), tokenizer if tokenizer.is_dir() else None
