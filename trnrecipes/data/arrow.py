"""Raw text -> ONE Arrow IPC stream file with a large_string column, read back by memory map (seed 002).

Inputs: .jsonl / .jsonl.gz (one JSON object per line), .txt (one document per line), a directory saved by
`datasets.save_to_disk` (data-*.arrow streams), or a directory of .txt / .rst.txt / .md files (one document each).

Labelled text for classification (`label_field`): every record of a jsonl or Arrow input must carry an integer (or
bool) class id, written as an int64 column beside the text (what trnrecipes/data/classify.py reads).
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile
import zlib
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from trnrecipes.data import DataError, listed
from trnrecipes.schema import clipped, shown

TEXT_FILE_SUFFIXES = (".txt", ".md", ".rst")
RECORD_FILE_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".arrow")  # files whose records can carry labels
BATCH_DOCS = 1024  # documents per record batch: small enough to stream, big enough to be cheap


@dataclass
class ConversionStats:
    documents: int = 0
    skipped_empty: int = 0
    skipped_bad_utf8: int = 0
    bad_examples: list[str] = field(default_factory=list)
    labels: Counter = field(default_factory=Counter)  # class id -> documents written (with a label_field)


def to_arrow(
    inputs: list[Path],
    out: Path,
    text_field: str = "text",
    on_bad_utf8: str = "skip",
    progress: bool = True,
    label_field: str | None = None,
) -> ConversionStats:
    """Write every document of `inputs` to `out` (atomically: a temp file renamed at the end); with `label_field`,
    each document's class id too, as an int64 column of that name."""
    stats = ConversionStats()
    records = read_records(inputs, text_field, on_bad_utf8, stats, progress, label_field)
    fields = [pa.field(text_field, pa.large_string())] + ([pa.field(label_field, pa.int64())] if label_field else [])
    schema = pa.schema(fields)
    with atomic_output(out) as tmp, pa.OSFile(tmp, "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        batch: list[tuple[str, int | None]] = []
        for text, label in records:
            if not text.strip():
                stats.skipped_empty += 1
                continue
            batch.append((text, label))
            if len(batch) == BATCH_DOCS:
                _write_batch(writer, schema, batch, stats)
                batch = []
        if batch:
            _write_batch(writer, schema, batch, stats)
        if stats.documents == 0:
            raise DataError(
                f"no documents in {', '.join(map(str, inputs))}: every input was empty"
                f" ({stats.skipped_empty} empty, {stats.skipped_bad_utf8} with undecodable bytes)"
            )
    return stats


def _write_batch(writer, schema: pa.Schema, batch: list[tuple[str, int | None]], stats: ConversionStats) -> None:
    columns = [pa.array([text for text, _ in batch], pa.large_string())]
    if len(schema) == 2:
        labels = [label for _, label in batch]
        columns.append(pa.array(labels, pa.int64()))
        stats.labels.update(labels)
    writer.write_batch(pa.record_batch(columns, schema=schema))
    stats.documents += len(batch)


def write_table(table: pa.Table, out: Path) -> None:
    """`table` as an Arrow IPC stream at `out`, atomically (what read_arrow and read_table read)."""
    with atomic_output(out) as tmp, pa.OSFile(tmp, "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)


@contextmanager
def atomic_output(out: Path) -> Iterator[str]:
    """A temp file beside `out`, renamed onto it when the block ends without an error (and removed if it fails):
    a reader never sees a half-written file."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield tmp
        _make_readable(tmp)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _make_readable(path: str) -> None:
    """mkstemp creates 0600; give the file the mode a plain open() would have."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def read_arrow(path: Path, text_field: str | None = None) -> pa.Array:
    """The text column of an Arrow IPC stream (or file), memory-mapped: nothing is read until it is used."""
    table = read_table(path)
    field_name = text_field or (table.schema.names or [""])[0]
    if field_name not in table.schema.names:
        raise DataError(f"{path} has no column {field_name!r}; its columns: {listed(table.schema.names)}")
    column = table.column(field_name)
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise DataError(f"{path}: column {field_name!r} holds {column.type}, not text (string)")
    return column.combine_chunks()


def read_table(path: Path) -> pa.Table:
    """An Arrow IPC stream (or file), memory-mapped, with a clear error for a missing or unreadable one."""
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
    return table


def read_documents(
    inputs: list[Path], text_field: str, on_bad_utf8: str, stats: ConversionStats, progress: bool = True
) -> Iterator[str]:
    """Every document of `inputs` (jsonl[.gz], json, txt, arrow files; directories of text files; datasets
    save_to_disk directories), decoded, counted in `stats`. The inputs are checked before any document is read, so
    a bad one fails before the caller writes anything."""
    return (text for text, _ in read_records(inputs, text_field, on_bad_utf8, stats, progress))


def read_records(
    inputs: list[Path],
    text_field: str,
    on_bad_utf8: str,
    stats: ConversionStats,
    progress: bool = True,
    label_field: str | None = None,
) -> Iterator[tuple[str, int | None]]:
    """(text, class id) for every document of `inputs`, as read_documents; the class id is None without
    `label_field`, and with it every record must carry one (plain text files, which cannot, are refused)."""
    if on_bad_utf8 not in ("skip", "fail"):
        raise DataError(f"on_bad_utf8 must be 'skip' or 'fail', got {on_bad_utf8!r}")
    if label_field is not None and label_field == text_field:
        raise DataError(f"the label field and the text field are both {label_field!r}; they must be two columns")
    files = [item for path in inputs for item in _expand(Path(path))]
    if label_field is not None:
        unlabelled = [str(f) for f, whole in files if whole or not f.name.endswith(RECORD_FILE_SUFFIXES)]
        if unlabelled:
            raise DataError(
                f"{listed(unlabelled, 3)}: plain text carries no labels; --label-field {label_field} reads"
                " .jsonl[.gz], .json and .arrow files and datasets.save_to_disk directories"
            )
    return _progress(_documents(files, text_field, on_bad_utf8, stats, label_field), progress, "documents")


def _expand(path: Path) -> list[tuple[Path, bool]]:
    """(file, whole): a file named on the command line is read by lines/records; files found in a directory of
    text files are one document each."""
    if not path.exists():
        raise DataError(f"input {path} does not exist")
    if path.is_file():
        if not path.name.endswith((*RECORD_FILE_SUFFIXES, *TEXT_FILE_SUFFIXES)):
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
    files: list[tuple[Path, bool]], text_field: str, on_bad_utf8: str, stats: ConversionStats, label_field: str | None
) -> Iterator[tuple[str, int | None]]:
    for f, whole in files:
        if whole:
            text = _decode(f.read_bytes(), f, on_bad_utf8, stats)
            if text is not None:
                yield text, None
        elif f.name.endswith((".jsonl", ".jsonl.gz", ".json")):
            yield from _jsonl(f, text_field, on_bad_utf8, stats, label_field)
        elif f.name.endswith(".arrow"):
            yield from _saved_arrow(f, text_field, label_field)
        else:  # one document per line, like datasets' "text" loader
            yield from ((text, None) for text in _lines(f, on_bad_utf8, stats))


def _class_id(value: object, where: str, label_field: str) -> int:
    """A record's label as a class id: an integer >= 0, or a bool (False 0, True 1)."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int) and value >= 0:
        return value
    raise DataError(
        f"{where}: {label_field} {shown(value)} is not a class id (an integer 0, 1, ... or a bool);"
        " map class names to ids before converting"
    )


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


def _jsonl(
    f: Path, text_field: str, on_bad_utf8: str, stats: ConversionStats, label_field: str | None
) -> Iterator[tuple[str, int | None]]:
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
            if label_field is None:
                yield record[text_field], None
                continue
            if label_field not in record:
                raise DataError(
                    f"{f}:{i}: no label field {label_field!r} (has: {listed(record)}); with --label-field every"
                    " record needs one"
                )
            yield record[text_field], _class_id(record[label_field], f"{f}:{i}", label_field)


def _read_lines(fh, f: Path) -> Iterator[bytes]:
    """The lines of an open (possibly gzip) file; a corrupt or truncated gzip stream is a DataError naming `f`."""
    try:
        yield from fh
    except (OSError, EOFError, zlib.error) as err:
        what = "not a readable gzip file" if f.name.endswith(".gz") else "cannot be read"
        raise DataError(f"{f}: {what} ({clipped(err)}); corrupt or truncated?") from None


def _saved_arrow(f: Path, text_field: str, label_field: str | None) -> Iterator[tuple[str, int | None]]:
    try:
        reader = pa.ipc.open_stream(pa.memory_map(str(f)))
        for name in [text_field] + ([label_field] if label_field is not None else []):
            if name not in reader.schema.names:
                raise DataError(f"{f} has no column {name!r}; its columns: {listed(reader.schema.names)}")
        row = 0
        for batch in reader:
            texts = batch.column(text_field).to_pylist()
            labels = batch.column(label_field).to_pylist() if label_field is not None else [None] * len(texts)
            for text, label in zip(texts, labels, strict=True):
                if text is not None:
                    if label_field is None:
                        yield text, None
                    elif label is None:
                        raise DataError(f"{f}: row {row} has no {label_field!r} (null); every row needs a class id")
                    else:
                        yield text, _class_id(label, f"{f}: row {row}", label_field)
                row += 1
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
