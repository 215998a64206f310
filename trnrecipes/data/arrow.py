"""Raw text -> ONE Arrow IPC stream file with a large_string column, read back by memory map (seed 002).

Inputs: .jsonl / .jsonl.gz (one JSON object per line), .txt (one document per line), a directory saved by
`datasets.save_to_disk` (data-*.arrow streams), or a directory of .txt / .rst.txt / .md files (one document each).
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from trnrecipes.data import DataError, listed
from trnrecipes.schema import clipped

TEXT_FILE_SUFFIXES = (".txt", ".md", ".rst")
BATCH_DOCS = 1024  # documents per record batch: small enough to stream, big enough to be cheap


@dataclass
class ConversionStats:
    documents: int = 0
    skipped_empty: int = 0
    skipped_bad_utf8: int = 0
    bad_examples: list[str] = field(default_factory=list)


def to_arrow(
    inputs: list[Path],
    out: Path,
    text_field: str = "text",
    on_bad_utf8: str = "skip",
    progress: bool = True,
) -> ConversionStats:
    """Write every document of `inputs` to `out` (atomically: a temp file renamed at the end)."""
    stats = ConversionStats()
    documents = read_documents(inputs, text_field, on_bad_utf8, stats, progress)
    schema = pa.schema([pa.field(text_field, pa.large_string())])
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    os.close(fd)
    try:
        with pa.OSFile(tmp, "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
            batch: list[str] = []
            for text in documents:
                if not text.strip():
                    stats.skipped_empty += 1
                    continue
                batch.append(text)
                if len(batch) == BATCH_DOCS:
                    writer.write_batch(pa.record_batch([pa.array(batch, pa.large_string())], schema=schema))
                    stats.documents += len(batch)
                    batch = []
            if batch:
                writer.write_batch(pa.record_batch([pa.array(batch, pa.large_string())], schema=schema))
                stats.documents += len(batch)
        if stats.documents == 0:
            raise DataError(
                f"no documents in {', '.join(map(str, inputs))}: every input was empty"
                f" ({stats.skipped_empty} empty, {stats.skipped_bad_utf8} with undecodable bytes)"
            )
        _make_readable(tmp)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return stats


def _make_readable(path: str) -> None:
    """mkstemp creates 0600; give the file the mode a plain open() would have."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def read_arrow(path: Path, text_field: str | None = None) -> pa.Array:
    """The text column of an Arrow IPC stream (or file), memory-mapped: nothing is read until it is used."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"Arrow file {path} does not exist")
    try:
        source = pa.memory_map(str(path))
        try:
            table = pa.ipc.open_stream(source).read_all()
        except pa.ArrowInvalid as stream_err:
            try:
                table = pa.ipc.open_file(source).read_all()
            except pa.ArrowInvalid:
                raise stream_err from None
    except (pa.ArrowException, OSError) as err:
        raise DataError(
            f"{path}: not a readable Arrow IPC stream or file ({clipped(err)}); corrupt or truncated?"
            " `trnrecipes data to-arrow` writes one"
        ) from None
    field_name = text_field or (table.schema.names or [""])[0]
    if field_name not in table.schema.names:
        raise DataError(f"{path} has no column {field_name!r}; its columns: {listed(table.schema.names)}")
    column = table.column(field_name)
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise DataError(f"{path}: column {field_name!r} holds {column.type}, not text (string)")
    return column.combine_chunks()


def read_documents(
    inputs: list[Path], text_field: str, on_bad_utf8: str, stats: ConversionStats, progress: bool = True
) -> Iterator[str]:
    """Every document of `inputs` (jsonl[.gz], json, txt, arrow files; directories of text files; datasets
    save_to_disk directories), decoded, counted in `stats`. The inputs are checked before any document is read, so
    a bad one fails before the caller writes anything."""
    if on_bad_utf8 not in ("skip", "fail"):
        raise DataError(f"on_bad_utf8 must be 'skip' or 'fail', got {on_bad_utf8!r}")
    files = [item for path in inputs for item in _expand(Path(path))]
    return _progress(_documents(files, text_field, on_bad_utf8, stats), progress, "documents")


def _expand(path: Path) -> list[tuple[Path, bool]]:
    """(file, whole): a file named on the command line is read by lines/records; files found in a directory of
    text files are one document each."""
    if not path.exists():
        raise DataError(f"input {path} does not exist")
    if path.is_file():
        if not path.name.endswith((".jsonl", ".jsonl.gz", ".json", ".arrow", *TEXT_FILE_SUFFIXES)):
            raise DataError(
                f"{path}: unknown input type; expected .jsonl[.gz], .json, .arrow, {', '.join(TEXT_FILE_SUFFIXES)}"
                " or a directory"
            )
        return [(path, False)]
    saved = sorted(path.glob("data-*.arrow"))
    if saved:  # datasets.save_to_disk
        return [(f, False) for f in saved]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith(TEXT_FILE_SUFFIXES))
    if not files:
        raise DataError(f"directory {path} holds no data-*.arrow (datasets.save_to_disk) and no .txt/.md/.rst files")
    return [(f, True) for f in files]


def _documents(
    files: list[tuple[Path, bool]], text_field: str, on_bad_utf8: str, stats: ConversionStats
) -> Iterator[str]:
    for f, whole in files:
        if whole:
            text = _decode(f.read_bytes(), f, on_bad_utf8, stats)
            if text is not None:
                yield text
        elif f.name.endswith((".jsonl", ".jsonl.gz", ".json")):
            yield from _jsonl(f, text_field, on_bad_utf8, stats)
        elif f.name.endswith(".arrow"):
            yield from _saved_arrow(f, text_field)
        else:
            yield from _lines(f, on_bad_utf8, stats)  # one document per line, like datasets' "text" loader


def _decode(raw: bytes, where: object, on_bad_utf8: str, stats: ConversionStats) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        if on_bad_utf8 == "fail":
            raise DataError(f"{where}: undecodable UTF-8 ({err}); use --on-bad-utf8 skip to skip and count") from None
        stats.skipped_bad_utf8 += 1
        if len(stats.bad_examples) < 5:
            stats.bad_examples.append(str(where))
        return None


def _lines(f: Path, on_bad_utf8: str, stats: ConversionStats) -> Iterator[str]:
    with open(f, "rb") as fh:
        for i, raw in enumerate(fh, 1):
            text = _decode(raw.rstrip(b"\r\n"), f"{f}:{i}", on_bad_utf8, stats)
            if text is not None:
                yield text


def _jsonl(f: Path, text_field: str, on_bad_utf8: str, stats: ConversionStats) -> Iterator[str]:
    opener = gzip.open if f.name.endswith(".gz") else open
    with opener(f, "rb") as fh:
        for i, raw in enumerate(_read_lines(fh, f), 1):
            line = _decode(raw, f"{f}:{i}", on_bad_utf8, stats)
            if line is None or not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{f}:{i}: not valid JSON ({err})") from None
            if not isinstance(record, dict) or text_field not in record:
                keys = listed(record) if isinstance(record, dict) else type(record).__name__
                raise DataError(f"{f}:{i}: no field {text_field!r} (has: {keys}); choose one with --text-field")
            if not isinstance(record[text_field], str):
                raise DataError(f"{f}:{i}: field {text_field!r} is {type(record[text_field]).__name__}, not text")
            yield record[text_field]


def _read_lines(fh, f: Path) -> Iterator[bytes]:
    """The lines of an open (possibly gzip) file; a corrupt or truncated gzip stream is a DataError naming `f`."""
    try:
        yield from fh
    except (OSError, EOFError, zlib.error) as err:
        what = "not a readable gzip file" if f.name.endswith(".gz") else "cannot be read"
        raise DataError(f"{f}: {what} ({clipped(err)}); corrupt or truncated?") from None


def _saved_arrow(f: Path, text_field: str) -> Iterator[str]:
    try:
        reader = pa.ipc.open_stream(pa.memory_map(str(f)))
        if text_field not in reader.schema.names:
            raise DataError(f"{f} has no column {text_field!r}; its columns: {listed(reader.schema.names)}")
        for batch in reader:
            for text in batch.column(text_field).to_pylist():
                if text is not None:
                    yield text
    except (pa.ArrowException, OSError) as err:
        raise DataError(f"{f}: not a readable Arrow IPC stream ({clipped(err)}); corrupt or truncated?") from None


def _progress(items: Iterator, enabled: bool, unit: str) -> Iterator:
    if not enabled:
        return items
    from tqdm import tqdm

    return tqdm(items, unit=f" {unit}", mininterval=1.0, disable=None)


class ArrowDocuments:
    """Documents of an Arrow text file, tokenized on demand (online), each followed by EOS."""

    def __init__(self, path: Path, tokenizer, text_field: str | None = None):
        self.path = path
        self.texts = read_arrow(path, text_field)
        self.tokenizer = tokenizer
        self.num_docs = len(self.texts)

    def tokens(self, doc_ids: list[int]) -> list:
        import numpy as np

        texts = self.texts.take(pa.array(doc_ids, pa.int64())).to_pylist()
        eos = np.array([self.tokenizer.eos_id], dtype=np.int64)
        return [np.concatenate([ids, eos]) for ids in self.tokenizer.encode_batch(texts)]
