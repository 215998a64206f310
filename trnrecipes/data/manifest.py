"""A corpus written as a directory of Arrow shards (`data to-arrow --shard-bytes N`): its corpus.json lists the shards
in order with their rows and text bytes, so that training reads them as one corpus (document ids run through the
shards in order) without opening every shard first. Torch- and pyarrow-free: sbatch's data check reads it too.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from trnrecipes.data import DataError, listed

MANIFEST = "corpus.json"
FORMAT = "trnrecipes.arrow-shards"
VERSION = 1
SHARD_FILE = re.compile(r"shard_\d{6,}\.arrow")


@dataclass(frozen=True)
class Shard:
    file: str  # a name in the directory
    rows: int
    text_bytes: int  # the UTF-8 bytes of its texts (what data_plan estimates tokens from)


@dataclass(frozen=True)
class Manifest:
    text_field: str
    columns: tuple[str, ...]  # the text field, and the label field where there is one
    shards: tuple[Shard, ...]

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.shards)

    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "text_field": self.text_field,
            "columns": list(self.columns),
            "rows": self.rows,
            "shards": [s.__dict__ for s in self.shards],
        }


def holds_only_shards(names: list[str], hidden_ok: bool) -> bool:
    """Whether a directory of these names is a shard directory to-arrow wrote: its manifest and shards, nothing else
    (but, `hidden_ok`, hidden names: .nfs*, .DS_Store, which a reader may pass over and a replace may not remove)."""
    seen = [n for n in names if not (hidden_ok and n.startswith("."))]
    return MANIFEST in seen and all(n == MANIFEST or SHARD_FILE.fullmatch(n) for n in seen)


def shard_name(k: int) -> str:
    return f"shard_{k:06d}.arrow"


def write_manifest(directory: Path, manifest: Manifest) -> None:
    (Path(directory) / MANIFEST).write_text(json.dumps(manifest.to_dict(), indent=1) + "\n")


def read_manifest(directory: str | Path) -> Manifest:
    """The manifest of a shard directory; DataError naming what is wrong (no corpus.json, a newer format, a shard
    entry that is not one)."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.is_file():
        held = listed(sorted(p.name for p in directory.iterdir()), 5) or "nothing"
        raise DataError(
            f"{directory} is a directory without {MANIFEST} (it holds {held}): not a corpus `trnrecipes data to-arrow"
            " --shard-bytes` wrote; name one Arrow file, or such a directory"
        )
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        if record.get("format") != FORMAT:
            raise ValueError(f"format {record.get('format')!r}, not {FORMAT!r}")
        if not isinstance(record.get("version"), int) or record["version"] > VERSION:
            raise ValueError(f"version {record.get('version')!r}: made by a newer trnrecipes (this reads {VERSION})")
        shards = tuple(_shard(entry) for entry in record["shards"])
        columns = tuple(str(c) for c in record["columns"])
        manifest = Manifest(str(record["text_field"]), columns, shards)
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise DataError(
            f"{path}: not a readable shard manifest ({err}); corrupt? `trnrecipes data to-arrow` writes one"
        ) from None
    if manifest.rows != record.get("rows"):
        raise DataError(f"{path}: its shards hold {manifest.rows} rows, but it says {record.get('rows')}; corrupt?")
    return manifest


def _shard(entry: dict) -> Shard:
    shard = Shard(entry["file"], entry["rows"], entry["text_bytes"])
    if not (isinstance(shard.file, str) and SHARD_FILE.fullmatch(shard.file)):
        raise ValueError(f"shard {shard.file!r} is not a shard file name (shard_NNNNNN.arrow)")
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in (shard.rows, shard.text_bytes)):
        raise ValueError(f"shard {shard.file}: rows and text_bytes must be whole numbers")
    return shard
