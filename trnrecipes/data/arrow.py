"""Raw text -> ONE Arrow IPC stream file with a large_string column, read back by memory map (the 128-node Llama 2
post), in record batches of 1M rows (--batch-rows: another size; a smaller corpus is one batch), as any streaming
writer makes them. The trainer reads them in place (ArrowTexts: a document id maps to (batch, row) through the
batches' cumulative lengths), so a rank's memory holds no copy of the corpus, only the memory-mapped pages the OS
can drop.

Inputs: .jsonl / .jsonl.gz (one JSON object per line), .txt (one document per line), .parquet files or a directory
of Parquet shards, a directory saved by `datasets.save_to_disk` (data-*.arrow streams; a DatasetDict: one split's
directory), or a directory of .txt / .rst.txt / .md files (one document each).

Labelled text for classification (`label_field`): every record of a jsonl or Arrow input must carry a class id
(class_id: the one rule, which predict applies too), written as an int64 column beside the text (what
trnrecipes/data/classify.py reads).

A text column with a null is refused when it is opened (Arrow's null counts say so without reading a text), and
`trnrecipes sbatch` runs the same check: a stream that reached the row hours into a run would die there.
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile
import zlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import numpy as np
import pyarrow as pa

from trnrecipes.data import DataError, listed
from trnrecipes.schema import clipped, shown

TEXT_FILE_SUFFIXES = (".txt", ".md", ".rst")
JSON_LINES = (".jsonl", ".jsonl.gz", ".json")  # one JSON record a line
RECORD_FILE_SUFFIXES = (*JSON_LINES, ".arrow", ".parquet")  # files whose records can carry labels
BATCH_DOCS = 1024  # documents read and converted at a time: small enough to stream, big enough to be cheap
# Rows per record batch of a written corpus. The trainer keeps one small object per batch (ArrowTexts), so a billion
# documents are ~1000 batches; a smaller corpus is one batch, as before (memory-mapped the same way either way).
ROWS_PER_BATCH = 1 << 20
MAX_CLASS_ID = 2**63 - 1  # the label column is int64
Read = TypeVar("Read")


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
    batch_rows: int | None = None,
) -> ConversionStats:
    """Write every document of `inputs` to `out` (atomically: a temp file renamed at the end) in record batches of
    `batch_rows` (default ROWS_PER_BATCH); with `label_field`, each document's class id too, as an int64 column of
    that name. Converting holds one batch in memory, about twice."""
    if batch_rows is not None and batch_rows < 1:
        raise DataError(f"--batch-rows must be a positive whole number, got {batch_rows}")
    rows_per_batch = batch_rows or ROWS_PER_BATCH
    stats = ConversionStats()
    records = read_records(inputs, text_field, on_bad_utf8, stats, progress, label_field)
    fields = [pa.field(text_field, pa.large_string())] + ([pa.field(label_field, pa.int64())] if label_field else [])
    schema = pa.schema(fields)
    with atomic_output(out) as tmp, pa.OSFile(tmp, "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        batch: list[tuple[str, int | None]] = []
        held: list[pa.RecordBatch] = []  # small batches, joined into one of rows_per_batch rows when written
        held_rows = 0
        for text, label in records:
            if not text.strip():
                stats.skipped_empty += 1
                continue
            batch.append((text, label))
            if len(batch) == min(BATCH_DOCS, rows_per_batch - held_rows):
                _add_batch(held, schema, batch, stats)
                held_rows += len(batch)
                batch = []
                if held_rows == rows_per_batch:
                    _write_held(writer, schema, held)
                    held_rows = 0
        if batch:
            _add_batch(held, schema, batch, stats)
        if held:
            _write_held(writer, schema, held)
        if stats.documents == 0:
            raise DataError(
                f"no documents in {', '.join(map(str, inputs))}: every input was empty"
                f" ({stats.skipped_empty} empty, {stats.skipped_bad_utf8} with undecodable bytes)"
            )
    return stats


def _write_held(writer, schema: pa.Schema, held: list[pa.RecordBatch]) -> None:
    """The held small batches as one record batch; the list is emptied."""
    writer.write_batch(pa.Table.from_batches(held, schema).combine_chunks().to_batches()[0])
    held.clear()


def _add_batch(to, schema: pa.Schema, batch: list[tuple[str, int | None]], stats: ConversionStats) -> None:
    """The documents as one record batch, written to an IPC writer or appended to a list."""
    columns = [pa.array([text for text, _ in batch], pa.large_string())]
    if len(schema) == 2:
        labels = [label for _, label in batch]
        columns.append(pa.array(labels, pa.int64()))
        stats.labels.update(labels)
    record_batch = pa.record_batch(columns, schema=schema)
    if isinstance(to, list):
        to.append(record_batch)
    else:
        to.write_batch(record_batch)
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
    """The text column (`text_field`, else the first) of an Arrow IPC stream (or file), checked as
    check_text_column does, as one array: a copy of a multi-batch file (small inputs only; the trainer reads a
    corpus with ArrowTexts)."""
    return _text_column(read_table(path), path, text_field).combine_chunks()


class ArrowTexts:
    """The text column of an Arrow file, memory-mapped and read in place, whatever its record batches: rows are
    found through the batches' cumulative lengths (O(batches) memory), never by joining them into one copy."""

    def __init__(self, path: Path, text_field: str | None = None):
        self.path = Path(path)
        self.chunks = _text_column(read_table(path), path, text_field).chunks
        self.starts = np.cumsum([0] + [len(c) for c in self.chunks], dtype=np.int64)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def take(self, rows: Sequence[int]) -> list[str]:
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= len(self)):
            raise IndexError(f"{self.path}: row outside [0, {len(self)})")
        chunk = np.searchsorted(self.starts, rows, side="right") - 1
        pairs = zip(chunk.tolist(), (rows - self.starts[chunk]).tolist(), strict=True)
        return [self.chunks[c][r].as_py() for c, r in pairs]


def check_text_column(path: Path, text_field: str | None = None) -> None:
    """DataError unless `path` has a text column `text_field` with text in every row: read_arrow's checks, without
    reading a text or copying the column (what `trnrecipes sbatch` runs on a recipe's corpus)."""
    _text_column(read_table(path), path, text_field)


def _text_column(table: pa.Table, path: Path, text_field: str | None) -> pa.ChunkedArray:
    field_name = text_field or (table.schema.names or [""])[0]
    if field_name not in table.schema.names:
        raise DataError(f"{path} has no column {field_name!r}; its columns: {listed(table.schema.names)}")
    column = table.column(field_name)
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise DataError(f"{path}: column {field_name!r} holds {column.type}, not text (string)")
    if column.null_count:  # from the IPC metadata: no text is read
        raise DataError(
            f"{path}: column {field_name!r} has {column.null_count} null row(s), the first row {_first_null(column)};"
            f" every row needs text: `trnrecipes data to-arrow --in {path} --out NEW.arrow --text-field {field_name}`"
            " writes a copy without them"
        )
    return column


def _first_null(column: pa.ChunkedArray) -> int:
    """The row of the first null: only the validity bitmap of the first chunk with one is read."""
    start = 0
    for chunk in column.chunks:
        if chunk.null_count:
            break
        start += len(chunk)
    return start + int(chunk.is_null().to_numpy(zero_copy_only=False).argmax())


def read_naming_bad_row(path: Path, rows: Sequence[int], read: Callable[[Sequence[int]], Read]) -> Read:
    """read(rows), where a row that cannot be read or tokenized (a TypeError or ValueError: invalid UTF-8 in a
    memory-mapped string, a text the tokenizer refuses) is a DataError naming `path` and the row: bad input, which
    a requeue would only meet again, not a crash. The row is found by reading them one by one, after a failure. A
    failure no single row causes, or one every row causes (a bug in the code, not the data), is raised as it was."""
    try:
        return read(rows)
    except DataError:
        raise
    except (TypeError, ValueError):
        failed: list[tuple[int, Exception]] = []
        for row in rows:
            try:
                read([row])
            except (TypeError, ValueError) as row_err:
                failed.append((row, row_err))
        if failed and (len(failed) < len(rows) or len(rows) == 1):
            row, row_err = failed[0]
            raise DataError(
                f"{path}: row {row} cannot be read or tokenized ({clipped(row_err)}); fix or drop that row"
                + (f" ({len(failed)} rows of these {len(rows)} fail)" if len(failed) > 1 else "")
            ) from row_err
        raise


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
                " .jsonl[.gz], .json, .arrow and .parquet files and datasets.save_to_disk directories"
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
                f"{path}: unknown input type; expected .jsonl[.gz], .json, .arrow, .parquet,"
                f" {', '.join(TEXT_FILE_SUFFIXES)} or a directory"
            )
        return [(path, False)]
    saved = sorted(path.glob("data-*.arrow"))
    if saved:  # datasets.save_to_disk
        return [(f, False) for f in saved]
    if (path / "dataset_dict.json").is_file():  # a DatasetDict.save_to_disk: one directory per split
        splits = sorted(p.name for p in path.iterdir() if (p / "dataset_info.json").is_file())
        raise DataError(
            f"{path} is a datasets DatasetDict (splits: {listed(splits) or 'none'}); give one split's directory,"
            f" e.g. {path / (splits[0] if splits else 'train')}"
        )
    shards = sorted(p for p in path.rglob("*.parquet") if p.is_file())
    if shards:  # Parquet shards, as the Hugging Face Hub and Spark write them
        splits = sorted({split for f in shards if (split := _split_of(f, path))})
        if len(splits) > 1:  # train, test and validation together would leak the held-out sets into training
            raise DataError(
                f"{path} holds the Parquet shards of several splits ({listed(splits)}); give one split's files, e.g."
                f" {next(f for f in shards if _split_of(f, path) == splits[-1])}"
            )
        return [(f, False) for f in shards]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith(TEXT_FILE_SUFFIXES))
    if not files:
        raise DataError(
            f"directory {path} holds no data-*.arrow (datasets.save_to_disk), no .parquet and no .txt/.md/.rst files"
        )
    return [(f, True) for f in files]


SPLITS = ("train", "test", "validation", "valid", "val", "dev", "eval")


def _split_of(shard: Path, root: Path) -> str | None:
    """The split a Parquet shard belongs to, by the Hub's naming (train-00000-of-00003.parquet, or a train/ folder)."""
    stem = shard.name.split("-")[0].split(".")[0].lower()
    if stem in SPLITS:
        return stem
    return next((part.lower() for part in shard.relative_to(root).parts[:-1] if part.lower() in SPLITS), None)


def _documents(
    files: list[tuple[Path, bool]], text_field: str, on_bad_utf8: str, stats: ConversionStats, label_field: str | None
) -> Iterator[tuple[str, int | None]]:
    for f, whole in files:
        if whole:
            text = _decode(f.read_bytes(), f, on_bad_utf8, stats)
            if text is not None:
                yield text, None
        elif f.name.endswith(JSON_LINES):
            yield from _jsonl(f, text_field, on_bad_utf8, stats, label_field)
        elif f.name.endswith(".arrow"):
            yield from _saved_arrow(f, text_field, label_field)
        elif f.name.endswith(".parquet"):
            yield from _parquet(f, text_field, label_field)
        else:  # one document per line, like datasets' "text" loader
            yield from ((text, None) for text in _lines(f, on_bad_utf8, stats))


def class_id(value: object, where: str, label_field: str, num_labels: int | None = None) -> int:
    """A label as a class id, by the one rule of to-arrow --label-field and predict: an integer from 0, below
    `num_labels` (model.num_labels) where that is known and within int64 (the label column's type) always, or a
    bool (false 0, true 1, as Python counts them: JSON has no other way to write a binary label, so refusing one
    would only send the user to rewrite the file). Anything else is a DataError naming `where` and the value."""
    number = int(value) if isinstance(value, bool) else value
    limit = MAX_CLASS_ID + 1 if num_labels is None else num_labels
    if type(number) is int and 0 <= number < limit:
        return number
    valid = "0, 1, ... up to 2**63 - 1" if num_labels is None else f"in [0, {num_labels}) (model.num_labels)"
    hint = "; map class names to ids first" if isinstance(value, str) else ""
    raise DataError(
        f"{where}: {label_field} {shown(value)} is not a class id (an integer {valid}, or a bool: false 0, true 1)"
        f"{hint}"
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
            record = parse_record(line, f"{f}:{i}", text_field)
            if label_field is None:
                yield record[text_field], None
                continue
            if label_field not in record:
                raise DataError(
                    f"{f}:{i}: no label field {label_field!r} (has: {listed(record)}); with --label-field every"
                    " record needs one"
                )
            yield record[text_field], class_id(record[label_field], f"{f}:{i}", label_field)


def parse_record(line: str, where: str, text_field: str | None = None) -> dict:
    """One JSON line as a record (an object); with `text_field`, one holding text there. `where` names the line."""
    try:
        record = json.loads(line)
    except ValueError as err:  # JSONDecodeError, and an integer too long for int()
        raise DataError(f"{where}: not valid JSON ({clipped(err)})") from None
    if text_field is None:
        if not isinstance(record, dict):
            raise DataError(f"{where}: a JSON {type(record).__name__}, not an object (a record)")
        return record
    if not isinstance(record, dict) or text_field not in record:
        keys = listed(record) if isinstance(record, dict) else type(record).__name__
        raise DataError(f"{where}: no field {text_field!r} (has: {keys}); choose one with --text-field")
    if not isinstance(record[text_field], str):
        raise DataError(f"{where}: field {text_field!r} is {type(record[text_field]).__name__}, not text")
    return record


def read_row_lines(f: Path) -> Iterator[tuple[str, str]]:
    """(where, line) for each row of a line-based file (.jsonl[.gz], .json, .txt, ...) as predict and embed number
    rows: a row is a non-blank line, counted from 0 in file order, and `where` names it "FILE: row N (line L)" (L:
    the file's line, from 1, to find it in an editor). Undecodable UTF-8 fails, since skipping the line would shift
    every row after it."""
    row = 0
    with (gzip.open if f.name.endswith(".gz") else open)(f, "rb") as fh:
        for i, raw in enumerate(_read_lines(fh, f), 1):
            where = f"{f}: row {row} (line {i})"
            try:
                line = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as err:
                raise DataError(
                    f"{where}: undecodable UTF-8 ({clipped(err)}); re-encode the file as UTF-8, or read the Arrow"
                    f" file `trnrecipes data to-arrow --in {f} --out NEW.arrow` writes without such lines"
                ) from None
            if line.strip():
                yield where, line
                row += 1


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
        yield from _rows(f, reader.schema.names, reader, text_field, label_field)
    except (pa.ArrowException, OSError) as err:
        raise DataError(f"{f}: not a readable Arrow IPC stream ({clipped(err)}); corrupt or truncated?") from None


def _parquet(f: Path, text_field: str, label_field: str | None) -> Iterator[tuple[str, int | None]]:
    import pyarrow.parquet as pq

    try:
        source = pq.ParquetFile(f)
        names = source.schema_arrow.names
        columns = [n for n in (text_field, label_field) if n is not None and n in names]
        yield from _rows(f, names, source.iter_batches(batch_size=BATCH_DOCS, columns=columns), text_field, label_field)
    except (pa.ArrowException, OSError) as err:
        raise DataError(f"{f}: not a readable Parquet file ({clipped(err)}); corrupt or truncated?") from None


def _rows(f: Path, names: list[str], batches, text_field: str, label_field: str | None):
    """(text, class id) for the rows of a file's record batches; null texts are skipped, a null label refused."""
    for name in [text_field] + ([label_field] if label_field is not None else []):
        if name not in names:
            raise DataError(f"{f} has no column {name!r}; its columns: {listed(names)}")
    row = 0
    for batch in batches:
        texts = batch.column(text_field).to_pylist()
        labels = batch.column(label_field).to_pylist() if label_field is not None else [None] * len(texts)
        for text, label in zip(texts, labels, strict=True):
            if text is not None and not isinstance(text, str):
                raise DataError(f"{f}: row {row}: {text_field} is {type(text).__name__} {shown(text)}, not text")
            if text is not None:
                if label_field is None:
                    yield text, None
                elif label is None:
                    raise DataError(f"{f}: row {row} has no {label_field!r} (null); every row needs a class id")
                else:
                    yield text, class_id(label, f"{f}: row {row}", label_field)
            row += 1


def _progress(items: Iterator, enabled: bool, unit: str) -> Iterator:
    if not enabled:
        return items
    from tqdm import tqdm

    return tqdm(items, unit=f" {unit}", mininterval=1.0, disable=None)


class ArrowDocuments:
    """Documents of an Arrow text file, tokenized on demand (online), each followed by EOS."""

    def __init__(self, path: Path, tokenizer, text_field: str | None = None):
        self.path = path
        self.texts = ArrowTexts(path, text_field)
        self.tokenizer = tokenizer
        self.num_docs = len(self.texts)

    def tokens(self, doc_ids: list[int]) -> list:
        return read_naming_bad_row(self.path, doc_ids, self._tokens)

    def _tokens(self, doc_ids: Sequence[int]) -> list:
        texts = self.texts.take(doc_ids)
        eos = np.array([self.tokenizer.eos_id], dtype=np.int64)
        return [np.concatenate([ids, eos]) for ids in self.tokenizer.encode_batch(texts)]
