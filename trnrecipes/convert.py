"""`trnrecipes convert from-hf | to-hf`: between Hugging Face model directories and our checkpoints.

from-hf takes the architecture and sizes from the HF config.json (any GPT-NeoX or Llama shape); a recipe only adds
training settings (default: the family's tiny recipe). to-hf writes config.json + model.safetensors + tokenizer
files, which transformers' AutoModelForCausalLM.from_pretrained(DIR) loads offline, and trnrecipes-source.json: the
checkpoint it came from (path, step, sha256 of its manifest.json, which lists the sha256 of every file) and the
sha256 of every file of the export itself ("files"), so that a reused export is checked to be what was exported
(export_changes) before anyone credits that checkpoint with it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from safetensors.torch import load_file, save_file

from trnrecipes import REPO_ROOT
from trnrecipes.checkpoint import CheckpointError, read_model_checkpoint, write_model_checkpoint
from trnrecipes.config.families import FAMILIES, family_of_hf_config
from trnrecipes.config.recipe import load_recipe, recipe_from_dict
from trnrecipes.config.sections import RecipeError
from trnrecipes.files.durable import make_readable

EXPORT_SOURCE = "trnrecipes-source.json"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
    "tokenizer.model", "added_tokens.json",
)  # fmt: skip


def _hf_weights(hf_dir: Path) -> dict:
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        found = ", ".join(p.name for p in hf_dir.iterdir()) or "nothing"
        raise RecipeError(f"{hf_dir}: no *.safetensors weights (found: {found}); only safetensors are read")
    weights = {}
    for f in files:
        weights |= load_file(f)
    return weights


def from_hf(hf_dir: Path, out: Path, recipe_name: str | None = None) -> Path:
    hf_dir = Path(hf_dir)
    config_file = hf_dir / "config.json"
    if not config_file.is_file():
        raise RecipeError(f"{config_file}: not found; --hf must be a Hugging Face model directory")
    if Path(out).exists():
        raise RecipeError(f"{out} already exists; choose a new --out (checkpoints are never overwritten)")
    try:
        hf_config = json.loads(config_file.read_text())
    except ValueError as err:
        raise RecipeError(f"{config_file}: not valid JSON ({err})") from None
    if not isinstance(hf_config, dict):
        raise RecipeError(f"{config_file}: holds a JSON {type(hf_config).__name__}, not a model config (an object)")
    if as_text := _numbers_as_text(hf_config):  # read on, it is a TypeError or a false message about sizes
        raise RecipeError(f"{config_file}: {as_text}")
    try:
        family = family_of_hf_config(hf_config)
        args = family.hf.args_from_hf_config(hf_config)
    except (ValueError, KeyError) as err:
        raise RecipeError(f"{config_file}: {err}") from None
    except TypeError as err:  # a list where a number goes, ...
        raise RecipeError(f"{config_file}: a value of the wrong type ({err}); compare it with transformers'") from None
    _check_tokenizer_files(hf_dir)
    exported = export_source(hf_dir) or {}  # one of to_hf's: the recipe and length it was trained with
    if exported and export_changes(hf_dir, exported) != []:  # changed since (re-saved, fine-tuned): not its record
        exported = {}
    template = load_recipe(recipe_name or _exported_recipe(exported, family.name) or f"{family.name}-tiny")
    if template.model.family != family.name:
        raise RecipeError(f"--recipe {recipe_name} is a {template.model.family} recipe; {hf_dir} holds {family.name}")
    model = dataclasses.asdict(args) | {"activation_checkpointing": template.model.activation_checkpointing}
    data = template.to_dict() | {"model": model}
    if recipe_name is None:  # the default template adapts to short-context models; a named recipe must fit
        trained = exported.get("seq_len")  # a round trip keeps it (the template's 64 cut minilm's 128 silently)
        seq_len = trained if isinstance(trained, int) and trained > 0 else template.batch.seq_len
        data["batch"]["seq_len"] = min(seq_len, args.max_seq_len)
    recipe = recipe_from_dict(data, f"{template.name} with the model of {config_file}")
    weights = _hf_weights(hf_dir)  # its own errors name the directory once
    try:
        state = family.hf.state_dict_from_hf(weights, args)
    except ValueError as err:
        raise RecipeError(f"{hf_dir}: {err}") from None
    tokenizer = _tokenizer_files(hf_dir)
    with tempfile.TemporaryDirectory() as tmp:
        tok_dir = None
        if tokenizer:
            tok_dir = Path(tmp) / "tokenizer"
            tok_dir.mkdir()
            for f in tokenizer:
                shutil.copy2(f, tok_dir / f.name)
        return write_model_checkpoint(out, state, recipe, tok_dir)


def _numbers_as_text(hf_config: dict) -> str | None:
    """A size of a config.json written as text ("vocab_size": "30522"), in words, or None: transformers writes
    every size (keys ending in _size, _layers, _heads, _embeddings, or starting num_) and eps as a number."""
    for key, value in hf_config.items():
        sized = key.endswith(("_size", "_layers", "_heads", "_embeddings", "_eps", "_theta")) or key.startswith("num_")
        if sized and isinstance(value, str):
            return f'{key} is {json.dumps(value)[:60]}, text; write it as a JSON number (e.g. 30522, not "30522")'
    return None


def _check_tokenizer_files(hf_dir: Path) -> None:
    """A model's tokenizer files without the tokenizer.json trnrecipes reads (a BERT's vocab.txt, a GPT-2's
    vocab.json + merges.txt): the checkpoint could not tokenize, and predict, embed and eval would fail on it later.
    Refused before anything is converted; transformers writes the tokenizer.json from them."""
    held = [f.name for f in _tokenizer_files(hf_dir)] + [n for n in ("vocab.txt",) if (hf_dir / n).is_file()]
    if held and "tokenizer.json" not in held:
        raise RecipeError(
            f"{hf_dir} holds the tokenizer files {', '.join(held)} but no tokenizer.json, the one trnrecipes reads:"
            ' write it with transformers first (python -c "from transformers import AutoTokenizer as T;'
            f" T.from_pretrained('{hf_dir}').save_pretrained('{hf_dir}')\"), then convert again"
        )


def _exported_recipe(exported: dict, family: str) -> str | None:
    """The shipped recipe an export of ours was trained with (its record's name), where it is one of this family."""
    name = exported.get("recipe")
    if not isinstance(name, str):
        return None
    try:
        return name if load_recipe(name).model.family == family else None
    except (RecipeError, ValueError, OSError):  # a recipe file of the user's, not shipped: the family's template
        return None


def checkpoint_source(ckpt: Path) -> dict:
    """Which weights a checkpoint holds: its path, step and the sha256 of its manifest.json."""
    manifest = Path(ckpt) / "manifest.json"
    try:
        data = manifest.read_bytes()
        step = json.loads(data)["step"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{manifest}: not a trnrecipes checkpoint manifest with a step ({err})") from None
    return {"path": str(Path(ckpt).resolve()), "step": step, "manifest_sha256": hashlib.sha256(data).hexdigest()}


def export_source(hf_dir: Path) -> dict | None:
    """The checkpoint an HF directory was exported from (to_hf's record), or None if it has no readable record."""
    try:
        source = json.loads((Path(hf_dir) / EXPORT_SOURCE).read_text())
    except (OSError, ValueError):
        return None
    return source if isinstance(source, dict) else None


def export_changes(hf_dir: Path, record: dict) -> list[str] | None:
    """How an HF directory differs from what to_hf wrote there, by the sha256 of every file in its record: one entry
    per file added, missing or changed ([] when every file is as exported), or None when the record lists no files
    (an export made before they were recorded): nothing can be checked."""
    recorded = record.get("files")
    if not isinstance(recorded, dict):
        return None
    hf_dir = Path(hf_dir)
    on_disk = set(_export_files(hf_dir))
    changes = [f"{name} added" for name in sorted(on_disk) if name not in recorded]
    for name, digest in recorded.items():
        if name not in on_disk:
            changes.append(f"{name} missing")
            continue
        try:
            if _sha256(hf_dir / name) != digest:
                changes.append(f"{name} changed")
        except OSError as err:
            changes.append(f"{name} unreadable ({err.strerror or err})")
    return changes


def _export_files(directory: Path) -> list[str]:
    """Every file under an export (subdirectories too: anything added is found), its record excepted."""
    found = [  # links to directories too: os.walk lists them as directories and does not enter them
        (Path(here) / name).relative_to(directory).as_posix()
        for here, dirs, names in os.walk(directory)
        for name in names + [d for d in dirs if (Path(here) / d).is_symlink()]
    ]
    return sorted(name for name in found if name != EXPORT_SOURCE)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:  # streamed: a 40 GB model is never held in memory (no file_digest: Python 3.10)
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def to_hf(ckpt: Path, out: Path) -> Path:
    out = Path(out)
    if out.exists() and any(out.iterdir()):  # before the checkpoint is read: 140 GB for a 70B model
        raise RecipeError(f"{out} exists and is not empty; choose a new --out")
    recipe, state, tokenizer_dir = read_model_checkpoint(ckpt)
    source = checkpoint_source(ckpt)  # the manifest read_model_checkpoint just verified
    family, args = FAMILIES[recipe.model.family], recipe.model
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        make_readable(tmp)  # mkdtemp's 0700 and safetensors' 0600: the modes a plain mkdir and open give
        save_file(family.hf.state_dict_to_hf(state, args), tmp / "model.safetensors", metadata={"format": "pt"})
        make_readable(tmp / "model.safetensors")
        recipe_tokenizer = REPO_ROOT / recipe.data.tokenizer  # recipe paths are relative to the checkout
        if tokenizer_dir is None and recipe_tokenizer.is_dir():
            tokenizer_dir = recipe_tokenizer
        config = family.hf.hf_config_from_args(args) | _special_ids(tokenizer_dir)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for f in _tokenizer_files(tokenizer_dir) if tokenizer_dir else []:
            shutil.copy2(f, tmp / f.name)
        # read back just after writing (from the page cache): the sha256 a reuse is checked against
        files = {name: _sha256(tmp / name) for name in _export_files(tmp)}
        record = source | {"recipe": recipe.name, "seq_len": recipe.batch.seq_len, "files": files}  # from_hf's
        (tmp / EXPORT_SOURCE).write_text(json.dumps(record, indent=2) + "\n")
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _special_ids(tokenizer_dir: Path | None) -> dict[str, int]:
    """bos_token_id / eos_token_id of the tokenizer that travels with the export (generation stops at its eos), where
    it names them; the family's defaults stand otherwise."""
    if tokenizer_dir is None or not (tokenizer_dir / "tokenizer.json").is_file():
        return {}
    from trnrecipes.data.tokenizer import TokenizerError, load_tokenizer

    try:
        tok = load_tokenizer(tokenizer_dir)
    except TokenizerError:  # e.g. no eos_token named: the export copies the files as they are
        return {}
    ids = {"eos_token_id": tok.eos_id, "bos_token_id": tok.bos_id}
    return {k: v for k, v in ids.items() if v is not None}


def _tokenizer_files(directory: Path) -> list[Path]:
    return [directory / name for name in TOKENIZER_FILES if (directory / name).is_file()]
