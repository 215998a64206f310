"""Which tokenizer made a Megatron .bin/.idx: `data preprocess` records it beside the files (PREFIX.tokenizer.json),
and sbatch's data check refuses token ids made by another tokenizer than data.tokenizer (in a blend, one source's
ids would mean one thing and another's another). Torch- and pyarrow-free: the render host reads it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

TOKENIZED_WITH = ".tokenizer.json"  # beside PREFIX.bin/.idx


def tokenizer_fingerprint(tokenizer_dir: str | Path) -> str:
    """The sha256 of a tokenizer directory's tokenizer.json: two tokenizers with the same one give the same ids."""
    return hashlib.sha256((Path(tokenizer_dir) / "tokenizer.json").read_bytes()).hexdigest()


def write_tokenized_with(prefix: str | Path, tokenizer_dir: str | Path, max_token_id: int | None = None) -> Path:
    """Record beside a .bin/.idx which tokenizer made it and its largest token id (read by tokenized_with; the
    data check compares the id with model.vocab_size without reading the .bin)."""
    path = Path(f"{prefix}{TOKENIZED_WITH}")
    record = {"tokenizer": str(tokenizer_dir), "sha256": tokenizer_fingerprint(tokenizer_dir), **_sizes(prefix)}
    if max_token_id is not None:
        record["max_token_id"] = int(max_token_id)
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def _sizes(prefix: str | Path) -> dict[str, int]:
    """The sizes of the pair the record describes: another tokenizer's pair (Megatron's preprocess_data.py run
    again with the prefix, a copy of another corpus over it) has other sizes. Not mtimes: a copy to shared storage
    (cp, aws s3 sync) changes those, and the record must survive it."""
    return {f"{suffix[1:]}_bytes": Path(f"{prefix}{suffix}").stat().st_size for suffix in (".bin", ".idx")}


def tokenized_with(prefix: str | Path) -> dict | None:
    """{tokenizer, sha256[, max_token_id]} of the tokenizer that made PREFIX.bin/.idx, or None where nothing
    recorded it (files from Megatron's own preprocess_data.py, or from before this record) or the record is of
    another pair than the one there now (its sizes differ: the pair was replaced, the record left behind)."""
    try:
        record = json.loads(Path(f"{prefix}{TOKENIZED_WITH}").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("sha256"), str):
        return None
    if "bin_bytes" in record or "idx_bytes" in record:  # records from before the sizes are trusted as they were
        try:
            if any(record.get(key) != size for key, size in _sizes(prefix).items()):
                return None
        except OSError:
            return None
    return record
