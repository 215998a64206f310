"""Raw text -> ONE Arrow IPC stream file with a large_string column, read back by memory map (the 128-node Llama 2
post), in record batches of 131,072 rows (--batch-rows: another size; a smaller corpus is one batch), as any streaming
writer makes them. The trainer reads them in place (ArrowTexts: a document id maps to (batch, row) through the
batches' cumulative lengths), so a rank's memory holds no copy of the corpus, only the memory-mapped pages the OS
can drop.

Inputs (inputs.py finds them): JSON lines (.jsonl, .json, also .gz or .zst; standard input), .txt (a document a
line), .parquet and .arrow files, directories of them (walked in sorted path order), a directory saved by
`datasets.save_to_disk`, or a directory of .txt / .md / .rst files (a document each). A record that cannot be used is
an error naming its place, or skipped and listed (bad_records.py).

Labelled text for classification (`label_field`): every record of a jsonl or Arrow input must carry a class id
(class_id: the one rule, which predict applies too), written as an int64 column beside the text (what
trnrecipes/data/classify.py reads).

A text column with a null is refused when it is opened (Arrow's null counts say so without reading a text), and
`trnrecipes sbatch` runs the same check: a stream that reached the row hours into a run would die there.
"""

from __future__ import annotations

import errno
import gzip
import io
import itertools
import os
import sys
import tempfile
import zlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, TypeVar

import numpy as np
import pyarrow as pa

from trnrecipes.data import DataError, listed
from trnrecipes.data.arrow_marks import CUT_SHORT, stream_cut_short
from trnrecipes.data.bad_records import BadRecords, rejects_of
from trnrecipes.data.corpus_writer import CorpusWriter, corpus_schema, shard_dir_output
from trnrecipes.data.inputs import InputFile, find_inputs, input_names
from trnrecipes.data.json_lines import arrow_texts, json_loads, non_blank
from trnrecipes.data.manifest import MANIFEST, read_manifest
from trnrecipes.files.durable import durable_replace, make_readable
from trnrecipes.files.storage_errors import errno_of
from trnrecipes.schema import clipped, shell_word, shown

BATCH_DOCS = 1024  # documents read and converted at a time: small enough to stream, big enough to be cheap
COLUMNAR_ROWS = 8192  # a Parquet file's rows read at a time where its texts stay Arrow (_batch_texts)
JSON_BLOCK_BYTES = 1 << 22  # JSON lines read at a time by the quicker loop (_jsonl_texts)
# Rows per record batch of a written corpus. Small enough that a conversion by several processes joins the parts into
# the output as they come (a batch is written once its rows are all done), and that writing holds little (3 KB web
# pages: 400 MB a batch, not 3 GB at 1M rows); large enough that the trainer's one small object per batch
# (ArrowTexts: about 1.2 KB) stays small: a billion documents are ~7,600 batches, ~9 MB a rank.
ROWS_PER_BATCH = 1 << 17
MAX_CLASS_ID = 2**63 - 1  # the label column is int64
Read = TypeVar("Read")
Texts = list[str] | pa.Array  # a block's texts: an Arrow large_string array where pyarrow read the JSON lines


@dataclass
class ConversionStats:
    documents: int = 0
    skipped_empty: int = 0
    rejected: int = 0  # bad records skipped (--on-bad-record skip)
    labels: Counter = field(default_factory=Counter)  # class id -> documents written (with a label_field)


def to_arrow(
    inputs: Sequence[str | Path | InputFile],
    out: Path,
    text_field: str = "text",
    on_bad_record: str = "error",
    progress: bool = True,
    label_field: str | None = None,
    batch_rows: int | None = None,
    max_bad_records: int | None = None,
    split: str | None = None,
    list_rejects: bool = True,
    shard_bytes: int | None = None,
) -> ConversionStats:
    """Write every document of `inputs` to `out` (atomically: a temp file renamed at the end) in record batches of
    `batch_rows` (default ROWS_PER_BATCH); with `label_field`, each document's class id too, as an int64 column of
    that name; with `shard_bytes`, a directory of shards of about that size (corpus_writer.py). Converting holds one
    batch in memory, about twice. Bad records: `on_bad_record` (error or skip, up to `max_bad_records`; skipped ones
    listed in OUT.rejects.jsonl, with `list_rejects`). In this process; parallel.py converts in several."""
    rows_per_batch = checked_batch_rows(batch_rows)
    stats = ConversionStats()
    bad = BadRecords(on_bad_record, max_bad_records, rejects_of(out) if list_rejects else None)
    files = find_inputs(inputs, split)
    check_labelled(files, text_field, label_field)
    blocks = (block for f in files for block in file_texts(f, text_field, bad, label_field))
    schema = corpus_schema(text_field, label_field)
    output = atomic_output(out) if shard_bytes is None else shard_dir_output(out)
    with (
        output as tmp,
        rejects_listed(bad),
        CorpusWriter(Path(tmp), schema, rows_per_batch, shard_bytes) as writer,
        _progress_bar(progress, " documents") as bar,
    ):
        for texts, labels in document_blocks(blocks, stats):
            writer.write(record_batch(schema, texts, labels))
            bar.update(len(texts))
        stats.rejected = bad.count
        if stats.documents == 0:
            raise no_documents(inputs, stats, bad)
    return stats


def checked_batch_rows(batch_rows: int | None) -> int:
    if batch_rows is not None and batch_rows < 1:
        raise DataError(f"--batch-rows must be a positive whole number, got {batch_rows}")
    return batch_rows or ROWS_PER_BATCH


class NoDocuments(DataError):
    """A conversion whose inputs hold no document: a rerun of the same inputs meets it again."""


def no_documents(inputs: Sequence, stats: ConversionStats, bad: BadRecords) -> DataError:
    first = f", the first {bad.first}" if bad.first else ""
    if stats.skipped_empty == 0 and bad.count == 0:  # blank lines, or files of nothing, are no records at all
        return NoDocuments(f"no documents in {input_names(inputs)}: it holds no records (empty, or blank lines only)")
    return NoDocuments(
        f"no documents in {input_names(inputs)}: every record was empty or bad ({stats.skipped_empty} empty,"
        f" {bad.count} bad records{first})"
    )


def document_blocks(
    blocks: Iterator[tuple[Texts, list[int] | None]], stats: ConversionStats
) -> Iterator[tuple[Texts, list[int] | None]]:
    """The blocks (texts, class ids or None) without their empty or blank documents, which are counted; the others
    counted into `stats`. A block left with no documents is dropped."""
    for texts, labels in blocks:
        if isinstance(texts, pa.Array):
            kept = non_blank(texts)
            if kept.false_count:
                stats.skipped_empty += kept.false_count
                texts = texts.filter(kept)
                labels = list(itertools.compress(labels, kept.to_pylist())) if labels is not None else None
        else:
            kept = [k for k, text in enumerate(texts) if text.strip()]
            if len(kept) < len(texts):
                stats.skipped_empty += len(texts) - len(kept)
                texts = [texts[k] for k in kept]
                labels = [labels[k] for k in kept] if labels is not None else None
        if not len(texts):
            continue
        stats.documents += len(texts)
        if labels is not None:
            stats.labels.update(labels)
        yield texts, labels


def record_batch(schema: pa.Schema, texts: Texts, labels: list[int] | None) -> pa.RecordBatch:
    """Documents as a record batch of `schema` (corpus_schema: the text, and the label if it has one)."""
    columns = [texts if isinstance(texts, pa.Array) else pa.array(texts, pa.large_string())]
    if len(schema) == 2:
        columns.append(pa.array(labels, pa.int64()))
    return pa.record_batch(columns, schema=schema)


def write_table(table: pa.Table, out: Path) -> None:
    """`table` as an Arrow IPC stream at `out`, atomically (what read_arrow and read_table read)."""
    with atomic_output(out) as tmp, pa.OSFile(tmp, "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)


@contextmanager
def atomic_output(out: Path) -> Iterator[str]:
    """A temp file beside `out`, renamed onto it (on disk first) when the block ends without an error (and removed
    if it fails): a reader never sees a half-written file, even after a crash of the machine."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield tmp
        make_readable(tmp)
        durable_replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@contextmanager
def rejects_listed(bad: BadRecords) -> Iterator[None]:
    """Under the skip policy, `bad` lists what it skips in a temp file renamed onto bad.rejects when the block ends
    without an error, as the output is. Under error, a rejects file an earlier skip run left there is removed on
    success: it described the output now replaced."""
    if bad.rejects is None:
        yield
    elif bad.policy == "skip":
        with atomic_output(bad.rejects) as tmp, open(tmp, "w", encoding="utf-8") as sink:
            bad.sink = sink
            yield
    else:
        yield
        if bad.rejects.is_file():
            bad.rejects.unlink()


def read_arrow(path: Path, text_field: str | None = None) -> pa.Array:
    """The text column (`text_field`, else the first) of an Arrow IPC stream (or file), checked as
    check_text_column does, as one array: a copy of a multi-batch file (small inputs only; the trainer reads a
    corpus with ArrowTexts)."""
    return _text_column(read_table(path), path, text_field).combine_chunks()


class ArrowTexts:
    """The text column of an Arrow corpus, memory-mapped and read in place, whatever its record batches: rows are
    found through the batches' cumulative lengths (O(batches) memory), never by joining them into one copy. The
    corpus is one file, or a directory of shards with a manifest (manifest.py), read as their concatenation: the
    manifest's row counts number the documents, and a shard is opened when a row of it is first read."""

    def __init__(self, path: Path, text_field: str | None = None):
        self.path = Path(path)
        if self.path.is_dir():
            manifest = read_manifest(self.path)
            self.text_field = text_field or manifest.text_field
            if self.text_field not in manifest.columns:
                columns = listed(manifest.columns)
                raise DataError(f"{self.path} has no column {self.text_field!r}; its columns: {columns}")
            self.shards = [_ShardTexts(self.path / s.file, self.text_field, s.rows) for s in manifest.shards]
            self._text_bytes = sum(s.text_bytes for s in manifest.shards)
        else:
            self.text_field = text_field
            self.shards = [_ShardTexts(self.path, text_field)]
            self.shards[0].open()  # a single file is checked when it is opened, as before
            self._text_bytes = None
        self.starts = np.cumsum([0] + [s.rows for s in self.shards], dtype=np.int64)

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def chunks(self) -> list[pa.Array]:
        """Every record batch's text, in order (opens every shard)."""
        return [chunk for shard in self.shards for chunk in shard.open().chunks]

    def check(self) -> None:
        """Open every shard: DataError for one that is missing, unreadable, or not what the manifest says."""
        for shard in self.shards:
            shard.open()

    def text_bytes(self) -> int:
        """The UTF-8 bytes of every text: from the manifest, or the offsets of each batch (no text is read)."""
        if self._text_bytes is None:
            self._text_bytes = sum(_value_bytes(c) for c in self.chunks)
        return self._text_bytes

    def take(self, rows: Sequence[int]) -> list[str]:
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= len(self)):
            raise IndexError(f"{self.path}: row outside [0, {len(self)})")
        if len(self.shards) == 1:
            return self.shards[0].take(rows)
        shard = np.searchsorted(self.starts, rows, side="right") - 1
        texts: list = [None] * len(rows)
        for s in np.unique(shard).tolist():
            where = np.flatnonzero(shard == s)
            for i, text in zip(where.tolist(), self.shards[s].take(rows[where] - self.starts[s]), strict=True):
                texts[i] = text
        return texts


class _ShardTexts:
    """The text column of one Arrow file, opened (memory-mapped, checked) on first use; `rows` the count a manifest
    says it holds (None: whatever it holds)."""

    def __init__(self, path: Path, text_field: str | None, rows: int | None = None):
        self.path, self.text_field, self.expected = path, text_field, rows
        self.chunks: list[pa.Array] | None = None

    @property
    def rows(self) -> int:
        return self.expected if self.expected is not None else int(self.open().starts[-1])

    def open(self) -> _ShardTexts:
        if self.chunks is None:
            chunks = _text_column(read_table(self.path), self.path, self.text_field).chunks
            self.starts = np.cumsum([0] + [len(c) for c in chunks], dtype=np.int64)
            if self.expected is not None and self.starts[-1] != self.expected:
                raise DataError(
                    f"{self.path}: {int(self.starts[-1])} rows, but {MANIFEST} beside it says {self.expected}: a shard"
                    " replaced or cut short since the corpus was written? Write the corpus again with"
                    " `trnrecipes data to-arrow`"
                )
            self.chunks = chunks
        return self

    def take(self, rows: np.ndarray) -> list[str]:
        self.open()
        chunk = np.searchsorted(self.starts, rows, side="right") - 1
        pairs = zip(chunk.tolist(), (rows - self.starts[chunk]).tolist(), strict=True)
        return [self.chunks[c][r].as_py() for c, r in pairs]


def _value_bytes(chunk: pa.Array) -> int:
    """The bytes of text in one chunk of a string column: its last offset less its first, without reading a text."""
    if len(chunk) == 0:
        return 0
    width = np.int64 if pa.types.is_large_string(chunk.type) else np.int32
    offsets = np.frombuffer(chunk.buffers()[1], dtype=width)
    return int(offsets[chunk.offset + len(chunk)] - offsets[chunk.offset])


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
            f" every row needs text: {_copy_without_nulls(Path(path), field_name)}"
        )
    return column


def _copy_without_nulls(path: Path, field_name: str) -> str:
    """The to-arrow command that writes the corpus again without its null rows: of a shard, the whole shard
    directory (a copy of one shard would not mend the corpus data.path names), in shards of its size."""
    from trnrecipes.data.manifest import MANIFEST

    folder = path.parent
    if (folder / MANIFEST).is_file():
        largest = max((f.stat().st_size for f in folder.glob("*.arrow")), default=path.stat().st_size)
        return (
            f"`trnrecipes data to-arrow --in {shell_word(folder)} --out NEW_DIR --shard-bytes"
            f" {max(1, -(-largest // 10**6))}M --text-field {shell_word(field_name)} --on-bad-record skip` writes the"
            " shard directory again without them"
        )
    return (
        f"`trnrecipes data to-arrow --in {shell_word(path)} --out NEW.arrow --text-field {shell_word(field_name)}"
        " --on-bad-record skip` writes a copy without them"
    )


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
            if stream_cut_short(path):
                raise DataError(f"{path}: {CUT_SHORT}")
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
    inputs: Sequence[str | Path | InputFile],
    text_field: str,
    bad: BadRecords,
    progress: bool = True,
    split: str | None = None,
) -> Iterator[str]:
    """Every document of `inputs` (as find_inputs finds them), decoded; a bad record is `bad`'s to refuse or skip,
    when it is met. The inputs are found and checked before any document is read, so a missing or unknown one
    fails before the caller writes anything."""
    return (text for text, _ in read_records(inputs, text_field, bad, progress, split=split))


def read_records(
    inputs: Sequence[str | Path | InputFile],
    text_field: str,
    bad: BadRecords,
    progress: bool = True,
    label_field: str | None = None,
    split: str | None = None,
) -> Iterator[tuple[str, int | None]]:
    """(text, class id) for every document of `inputs`, as read_documents; the class id is None without
    `label_field`, and with it every record must carry one (plain text files, which cannot, are refused)."""
    files = find_inputs(inputs, split)
    check_labelled(files, text_field, label_field)
    return _progress(_documents(files, text_field, bad, label_field), progress, "documents")


def check_labelled(files: list[InputFile], text_field: str, label_field: str | None) -> None:
    """With `label_field`, DataError for plain text files among `files` (they carry no labels), or for a label field
    that is the text field."""
    if label_field is not None and label_field == text_field:
        raise DataError(f"the label field and the text field are both {label_field!r}; they must be two columns")
    if label_field is not None:
        unlabelled = [f.name for f in files if f.kind in ("lines", "document")]
        if unlabelled:
            raise DataError(
                f"{listed(unlabelled, 3)}: plain text carries no labels; --label-field {label_field} reads"
                " JSON lines, .arrow and .parquet files and datasets.save_to_disk directories"
            )


def _documents(
    files: list[InputFile], text_field: str, bad: BadRecords, label_field: str | None
) -> Iterator[tuple[str, int | None]]:
    for f in files:
        yield from file_records(f, text_field, bad, label_field)


class ReadCount:
    """How far into one input file reading has got, in the file's bytes (compressed ones for .gz and .zst): what a
    progress bar counts. The reader of the file sets `position`."""

    def __init__(self) -> None:
        self.position: Callable[[], int] = lambda: 0

    @property
    def bytes(self) -> int:
        try:
            return int(self.position())
        except (ValueError, OSError, pa.ArrowException):  # the file closed: the reader is done with it
            return 0


def file_texts(
    f: InputFile, text_field: str, bad: BadRecords, label_field: str | None, read: ReadCount | None = None
) -> Iterator[tuple[Texts, list[int] | None]]:
    """The documents of one input file in blocks: (texts, their class ids with `label_field`, else None), as
    file_records reads them (without labels, JSON lines by a quicker loop, with the same result, in Arrow where
    msgspec or pyarrow's JSON reader read them; Parquet and Arrow files a batch at a time, in Arrow where a batch
    holds plain text)."""
    if f.kind.startswith("jsonl") and label_field is None:
        for texts in _jsonl_texts(f, text_field, bad, read):
            yield texts, None
        return
    if f.kind in ("arrow", "parquet") and label_field is None:
        for texts in (_arrow_rows if f.kind == "arrow" else _parquet)(f, text_field, bad, None, read, texts=True):
            yield texts, None
        return
    records = file_records(f, text_field, bad, label_field, read)
    while block := list(itertools.islice(records, BATCH_DOCS)):
        yield [text for text, _ in block], [label for _, label in block] if label_field is not None else None


def file_records(
    f: InputFile, text_field: str, bad: BadRecords, label_field: str | None, read: ReadCount | None = None
) -> Iterator[tuple[str, int | None]]:
    """(text, class id) for every record of one input file, as read_records; `read` counts its bytes as they go."""
    if f.kind == "document":
        try:
            raw = f.path.read_bytes().removeprefix(BOM)
        except OSError as err:
            raise unreadable(f.name, err) from err
        text = _decode(raw, f.name, None, bad)
        if text is not None:
            yield text, None
    elif f.kind.startswith("jsonl"):
        yield from _jsonl(f, text_field, bad, label_field, read)
    elif f.kind == "arrow":
        yield from _arrow_rows(f, text_field, bad, label_field, read)
    elif f.kind == "parquet":
        yield from _parquet(f, text_field, bad, label_field, read)
    else:  # one document per line, like datasets' "text" loader
        yield from ((text, None) for text in _lines(f, bad, read))


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


def _decode(raw: bytes, name: str, line: int | None, bad: BadRecords) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        bad.reject(name, f"invalid UTF-8 ({clipped(err)})", line=line)
        return None


def _lines(f: InputFile, bad: BadRecords, read: ReadCount | None = None) -> Iterator[str]:
    with open_lines(f.path, read) as fh:
        for i, raw in enumerate(_read_lines(fh, f.name), 1):
            text = _decode(raw.rstrip(b"\r\n"), f.name, i, bad)
            if text is not None:
                yield text


def _jsonl(
    f: InputFile, text_field: str, bad: BadRecords, label_field: str | None, read: ReadCount | None = None
) -> Iterator[tuple[str, int | None]]:
    with open_lines(f.path, read) as fh:
        for i, raw in enumerate(_read_lines(fh, f.name), 1):
            record = _json_record(raw, f.name, i, text_field, bad, label_field)
            if record is not None:
                yield record


def _json_record(
    raw: bytes, name: str, i: int, text_field: str, bad: BadRecords, label_field: str | None
) -> tuple[str, int | None] | None:
    """Line `i` of a JSON-lines file as (text, class id), or None: blank, or a bad record (`bad` told)."""
    line = _decode(raw, name, i, bad)
    if line is None or not line.strip():
        return None
    record, problem = _parsed(line, text_field)
    if problem is not None:
        file = "FILE" if name == "<stdin>" else name
        convert = f"JSON lines are a record a line (as .json and .jsonl are read): jq -c '.[]' {file} > records.jsonl"
        if i == 1 and line.strip() == "[":  # not a bad record: the whole file one indented array, every line refused
            raise DataError(f"{name}: one JSON array, not JSON lines; {convert}")
        if i == 1 and line.lstrip().startswith(("[{", "[ {")):  # an array of records on one line: the file's all?
            problem += f"; if the file is one JSON array, {convert}"
        bad.reject(name, problem, line=i)
        return None
    if label_field is None:
        return record[text_field], None
    where = f"{name}:{i}"
    if label_field not in record:
        raise DataError(
            f"{where}: no label field {label_field!r} (has: {listed(record)}); with --label-field every record"
            " needs one"
        )
    return record[text_field], class_id(record[label_field], where, label_field)


def _jsonl_texts(
    f: InputFile, text_field: str, bad: BadRecords, read: ReadCount | None
) -> Iterator[pa.Array | list[str]]:
    """The texts of a JSON-lines file in blocks of about JSON_BLOCK_BYTES of lines: what _jsonl reads, quicker. A
    block msgspec (or pyarrow's JSON reader) reads as json does comes as Arrow (json_lines.py); any other is read
    line by line: a line that is an object with text at `text_field` is taken as it is, and any other (blank, bad,
    text that is not a string) goes through _json_record, which says what is wrong with it."""
    i = 0
    with open_lines(f.path, read) as fh:
        for block in _byte_blocks(fh, f.name):
            newlines = np.flatnonzero(np.frombuffer(block, np.uint8) == ord("\n"))
            if (arrow := arrow_texts(block, newlines, text_field)) is not None:
                i += len(newlines) + (block[-1:] != b"\n")
                yield arrow
                continue
            texts = []
            for raw in _split_lines(block):
                i += 1
                try:
                    text = json_loads(raw.decode())[text_field]
                    # a surrogate comes only from a \u escape (raw.decode() refuses one encoded in UTF-8)
                    if type(text) is str and (b"\\u" not in raw or not _unpaired_surrogate(text)):
                        texts.append(text)
                        continue
                except (ValueError, KeyError, TypeError, RecursionError):  # UnicodeDecodeError, JSONDecodeError
                    pass
                if (record := _json_record(raw, f.name, i, text_field, bad, None)) is not None:
                    texts.append(record[0])
            yield texts


def open_lines(path: Path | None, read: ReadCount | None = None) -> BinaryIO:
    """A JSON-lines or text file opened for reading lines, decompressed by its name (.gz: gzip, .zst: zstd with
    pyarrow's codec); None: standard input. `read` is given how far into the file reading has got."""
    if path is None:
        _refuse_compressed_stdin(sys.stdin.buffer)
        _skip_bom(sys.stdin.buffer)
        return nullcontext(sys.stdin.buffer)
    try:
        if path.name.lower().endswith(".gz"):
            fh = gzip.open(path, "rb")
            position = fh.fileobj.tell
        elif path.name.lower().endswith(".zst"):
            raw = pa.OSFile(str(path))
            fh = io.BufferedReader(pa.CompressedInputStream(raw, "zstd"), 1 << 20)
            position = raw.tell
        else:
            fh = open(path, "rb")
            position = fh.tell
    except OSError as err:  # not the output's: a reader of it must not take it for a write refused
        raise unreadable(str(path), err) from err
    if read is not None:
        read.position = position
    try:
        _skip_bom(fh)
    except (OSError, EOFError, zlib.error) as err:  # a compressed file cut short or corrupt at its start
        fh.close()
        raise unreadable(str(path), err) from err
    return fh


# UTF-8's byte order mark, which Windows tools put first: JSON forbids it (line 1 would be a bad record), and in text it
# would be the document's first character, tokenized.
BOM = b"\xef\xbb\xbf"


def _skip_bom(fh: BinaryIO) -> None:
    peek = getattr(fh, "peek", None)
    if peek is not None and peek(len(BOM))[: len(BOM)] == BOM:
        fh.read(len(BOM))


# The first bytes of a compressed stream: piped in undecompressed, each would read as invalid UTF-8 on line 1.
COMPRESSED_MAGIC = {b"\x1f\x8b": ("gzip", "zcat"), b"\x28\xb5\x2f\xfd": ("zstd", "zstdcat")}


def _refuse_compressed_stdin(stdin: BinaryIO) -> None:
    """DataError where standard input starts as gzip or zstd data does (a file piped in undecompressed)."""
    peek = getattr(stdin, "peek", None)
    head = peek(4)[:4] if peek is not None else b""
    for magic, (kind, tool) in COMPRESSED_MAGIC.items():
        if head.startswith(magic):
            raise DataError(
                f"<stdin>: {kind}-compressed data, not JSON lines; decompress it in the pipe ({tool} FILE | trnrecipes"
                " data ... --in -), or name the file with --in (.gz and .zst files are read as they are)"
            )


FIELD_SAMPLE_LINES = 100


def check_text_field(files: list[InputFile], text_field: str) -> None:
    """DataError where none of the first FIELD_SAMPLE_LINES records of the first JSON-lines file has `text_field`
    while some are objects: a --text-field misnamed. Under --on-bad-record error the first record would be told as a
    bad record, with skip as the way on, which would reject every record: the whole corpus read (hours at TB scale)
    and listed as rejects first."""
    first = next((f for f in files if f.kind.startswith("jsonl") and f.path is not None), None)
    if first is None:
        return
    fields: dict[str, None] = {}
    try:
        with open_lines(first.path) as fh:
            for _, line in zip(range(FIELD_SAMPLE_LINES), fh, strict=False):
                try:
                    record = json_loads(line)
                except (ValueError, RecursionError):
                    continue
                if isinstance(record, dict):
                    if text_field in record:
                        return
                    fields.update(dict.fromkeys(record))
    except (OSError, EOFError, DataError):
        return  # the conversion reads it again, and says what is wrong where it is
    if fields:
        raise DataError(
            f"--text-field {text_field}: none of the first records of {first.name} has it (they have:"
            f" {listed(fields, 5)}); name the field that holds the text"
        )


def parse_record(line: str, where: str, text_field: str | None = None) -> dict:
    """One JSON line as a record (an object); with `text_field`, one holding text there. `where` names the line."""
    record, problem = _parsed(line, text_field)
    if problem is not None:
        raise DataError(f"{where}: {problem}")
    return record


def _parsed(line: str, text_field: str | None) -> tuple[dict, str | None]:
    """(record, None), or (_, what is wrong with the line): not JSON, not an object, or (with `text_field`) without
    text there."""
    try:
        record = json_loads(line)
    except ValueError as err:  # JSONDecodeError, and an integer too long for int()
        return {}, f"not valid JSON ({clipped(err)})"
    except RecursionError as err:
        return {}, f"JSON nested too deep for Python's json module to read ({clipped(err)})"
    if not isinstance(record, dict):
        return {}, f"a JSON {type(record).__name__}, not an object (a record)"
    if text_field is None:
        return record, None
    if text_field not in record:
        return record, f"no field {text_field!r} (has: {listed(record)}); choose one with --text-field"
    if record[text_field] is None:
        return record, f"field {text_field!r} is null"
    if not isinstance(record[text_field], str):
        return record, f"field {text_field!r} is {type(record[text_field]).__name__}, not text"
    if surrogate := _unpaired_surrogate(record[text_field]):
        return record, f"field {text_field!r} holds an unpaired surrogate escape ({surrogate}): not encodable as UTF-8"
    return record, None


def _unpaired_surrogate(text: str) -> str | None:
    """The first unpaired surrogate in `text` (json reads one from an escape alone: no UTF-8, so no Arrow string, can
    hold it), as that escape (\\ud800), or None."""
    if text.isascii():  # most texts: no encoding needed to know
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return f"\\u{ord(err.object[err.start]):04x}"
    return None


def read_row_lines(f: Path) -> Iterator[tuple[str, str]]:
    """(where, line) for each row of a line-based file (.jsonl[.gz|.zst], .json, .txt, ...) as predict and embed
    number rows: a row is a non-blank line, counted from 0 in file order, and `where` names it "FILE: row N (line L)"
    (L: the file's line, from 1, to find it in an editor). Undecodable UTF-8 fails, since skipping the line would
    shift every row after it."""
    row = 0
    with open_lines(f) as fh:
        for i, raw in enumerate(_read_lines(fh, str(f)), 1):
            where = f"{f}: row {row} (line {i})"
            try:
                line = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as err:
                raise DataError(
                    f"{where}: undecodable UTF-8 ({clipped(err)}); re-encode the file as UTF-8, or read the Arrow"
                    f" file `trnrecipes data to-arrow --in {shell_word(f)} --out NEW.arrow --on-bad-record skip`"
                    " writes without"
                    " such lines"
                ) from None
            if line.strip():
                yield where, line
                row += 1


def _read_lines(fh, name: str) -> Iterator[bytes]:
    """The lines of an open (possibly compressed) file; a corrupt or truncated stream is a DataError naming it."""
    try:
        yield from fh
    except (OSError, EOFError, zlib.error) as err:
        raise unreadable(name, err) from None


def _byte_blocks(fh, name: str) -> Iterator[bytes]:
    """The bytes of an open file in blocks of whole lines, of about JSON_BLOCK_BYTES (a longer line whole), as
    _read_lines reads them."""
    rest: list[bytes] = []  # a line's start, chunk by chunk: joined once (+= would copy it again for every chunk)
    try:
        while chunk := fh.read(JSON_BLOCK_BYTES):
            end = chunk.rfind(b"\n") + 1
            if end == 0:
                rest.append(chunk)
                continue
            yield b"".join((*rest, memoryview(chunk)[:end]))
            rest = [chunk[end:]]
    except (OSError, EOFError, zlib.error) as err:
        raise unreadable(name, err) from None
    if any(rest):
        yield b"".join(rest)


def _split_lines(block: bytes) -> list[bytes]:
    """The lines of a block as readlines gives them: each with its newline, the last without where it has none."""
    lines = block.split(b"\n")
    return [line + b"\n" for line in lines[:-1]] + ([lines[-1]] if lines[-1] else [])


def unreadable(name: str, err: BaseException, kind: str | None = None) -> DataError:
    """`name` cannot be read: for want of access (a file not opened), or not as a `kind` (else as its name's
    compression says), corrupt or truncated."""
    if isinstance(err, FileNotFoundError):  # listed, then removed (or a link's target): the inputs changed meanwhile
        return DataError(f"{name}: gone since the inputs were listed (removed or renamed?); run the command again")
    if isinstance(err, OSError) and errno_of(err) in NOT_OPENED:  # the file's access, not its content
        return DataError(f"{name}: cannot be read ({clipped(err)}); fix its permissions or name another file")
    suffix = name.lower()
    compressed = "gzip" if suffix.endswith(".gz") else "zstd" if suffix.endswith(".zst") else None
    kind = kind or (f"{compressed} file" if compressed else None)
    what = f"not a readable {kind}" if kind else "cannot be read"
    if compressed == "zstd" and "requires too much memory" in str(err):  # a window over the 128 MiB the codec takes
        return DataError(
            f"{name}: {what} ({clipped(err)}): its window is larger than this reader takes (made with zstd --long);"
            f" decompress it in a pipe: zstd -dc --long=31 {name} | trnrecipes data ... --in -"
        )
    return DataError(f"{name}: {what} ({clipped(err)}); corrupt or truncated?")


NOT_OPENED = {errno.EACCES, errno.EPERM, errno.ENOENT, errno.EISDIR}


def _arrow_rows(
    f: InputFile, text_field: str, bad: BadRecords, label_field: str | None, read: ReadCount | None, texts=False
):
    """The rows of an Arrow IPC stream (datasets' data-*.arrow, ours) or file, memory-mapped; `texts`: the texts
    of its record batches instead (_batch_texts)."""
    try:
        source = pa.memory_map(str(f.path))
        if read is not None:
            read.position = source.tell
        try:
            reader = pa.ipc.open_stream(source)
            batches = iter(reader)
            if stream_cut_short(f.path):  # its batches would read as the whole, those after the cut lost unsaid
                raise DataError(f"{f.name}: {CUT_SHORT}")
        except pa.ArrowInvalid:
            reader = pa.ipc.open_file(source)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        yield from (_batch_texts if texts else _rows)(f, reader.schema.names, batches, text_field, bad, label_field)
    except (pa.ArrowException, OSError) as err:
        raise unreadable(f.name, err, "Arrow IPC stream") from err


def _parquet(
    f: InputFile, text_field: str, bad: BadRecords, label_field: str | None, read: ReadCount | None, texts=False
):
    """The rows of a Parquet file, a batch of rows read at a time; `texts`: the texts of its batches instead."""
    import pyarrow.parquet as pq

    try:
        source = pq.ParquetFile(f.path)
        names = source.schema_arrow.names
        columns = [n for n in (text_field, label_field) if n is not None and n in names]
        batches = source.iter_batches(batch_size=COLUMNAR_ROWS if texts else BATCH_DOCS, columns=columns)
        if read is not None:  # the share of its rows read, in its bytes
            rows, size, done = source.metadata.num_rows, f.path.stat().st_size, [0]
            read.position = lambda: size * done[0] // max(rows, 1)
            batches = _counted(batches, done)
        yield from (_batch_texts if texts else _rows)(f, names, batches, text_field, bad, label_field)
    except (pa.ArrowException, OSError) as err:
        raise unreadable(f.name, err, "Parquet file") from err


def _batch_texts(f: InputFile, names: list[str], batches, text_field: str, bad: BadRecords, label_field: None):
    """The texts of a file's record batches in blocks of about JSON_BLOCK_BYTES of text (what a JSON-lines block
    holds, so preprocess tokenizes no more at a time, whatever a stored batch holds): as Arrow (large_string) where a
    batch's text column is text without a null and valid UTF-8 throughout, which is what _rows would give for it,
    without a Python string a row; any other batch through _rows, BATCH_DOCS rows at a time, naming each bad row."""
    if text_field not in names:
        raise _no_column(f, text_field, names)
    row = 0
    for batch in batches:
        column = _text_type(batch.column(text_field))
        if _plain_text(column):
            step = max(1, JSON_BLOCK_BYTES * len(column) // max(1, _value_bytes(column)))
            for start in range(0, len(column), step):
                yield column.slice(start, step)
        else:
            for start in range(0, len(batch), BATCH_DOCS):
                piece = batch.slice(start, BATCH_DOCS)
                yield [text for text, _ in _rows(f, names, [piece], text_field, bad, None, first_row=row + start)]
        row += len(batch)


def _text_type(column: pa.Array) -> pa.Array:
    """A column of text as large_string where it is text in another layout (string, a dictionary of strings as
    Parquet may store them, string_view); any other column as it is."""
    kind = column.type
    if pa.types.is_dictionary(kind) and (
        pa.types.is_string(kind.value_type) or pa.types.is_large_string(kind.value_type)
    ):
        column = column.dictionary_decode()
    elif not (pa.types.is_string(kind) or getattr(pa.types, "is_string_view", lambda _: False)(kind)):
        return column
    return column.cast(pa.large_string())


def _no_column(f: InputFile, name: str, names: list[str]) -> DataError:
    return DataError(f"{f.name} has no column {name!r}; its columns: {listed(names)}")


def _plain_text(column: pa.Array) -> bool:
    """A large_string column without nulls whose bytes are valid UTF-8 (Parquet's are not checked when read)."""
    if not pa.types.is_large_string(column.type) or column.null_count:
        return False
    try:
        column.validate(full=True)
    except pa.ArrowInvalid:
        return False
    return True


def _counted(batches: Iterator[pa.RecordBatch], done: list[int]) -> Iterator[pa.RecordBatch]:
    for batch in batches:
        yield batch
        done[0] += len(batch)


@dataclass(frozen=True)
class _Undecodable:
    """A row's text that is not valid UTF-8, and why."""

    reason: str


def _rows(
    f: InputFile, names: list[str], batches, text_field: str, bad: BadRecords, label_field: str | None, first_row=0
):
    """(text, class id) for the rows of a file's record batches (the first of them row `first_row` of the file); a
    null or undecodable text is a bad record, a null label refused."""
    for name in [text_field] + ([label_field] if label_field is not None else []):
        if name not in names:
            raise _no_column(f, name, names)
    row = first_row
    for batch in batches:
        texts = _texts(batch.column(text_field))
        labels = batch.column(label_field).to_pylist() if label_field is not None else [None] * len(texts)
        for text, label in zip(texts, labels, strict=True):
            if text is None:
                bad.reject(f.name, f"{text_field} is null", row=row)
            elif isinstance(text, _Undecodable):
                bad.reject(f.name, text.reason, row=row)
            elif not isinstance(text, str):
                raise DataError(f"{f.name}: row {row}: {text_field} is {type(text).__name__} {shown(text)}, not text")
            elif label_field is None:
                yield text, None
            elif label is None:
                raise DataError(f"{f.name}: row {row} has no {label_field!r} (null); every row needs a class id")
            else:
                yield text, class_id(label, f"{f.name}: row {row}", label_field)
            row += 1


def _texts(column: pa.Array) -> list:
    """A batch's texts as Python values, where one that is not valid UTF-8 stands as _Undecodable (found row by row:
    the rare case)."""
    try:
        return column.to_pylist()
    except UnicodeDecodeError:
        texts: list = []
        for value in column:
            try:
                texts.append(value.as_py())
            except UnicodeDecodeError as err:
                texts.append(_Undecodable(f"invalid UTF-8 ({clipped(err)})"))
        return texts


def _progress(items: Iterator, enabled: bool, unit: str) -> Iterator:
    if not enabled:
        return items
    from tqdm import tqdm

    return tqdm(items, unit=f" {unit}", mininterval=1.0, disable=None)


def _progress_bar(enabled: bool, unit: str):
    from tqdm import tqdm

    return tqdm(unit=unit, mininterval=1.0, disable=None if enabled else True)


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
