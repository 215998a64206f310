"""Documents into the corpus training reads: one Arrow IPC stream, or (`--shard-bytes`) a directory of them with a
manifest (manifest.py). Each file is written in record batches of `rows_per_batch` rows from its start, whatever
batches come in, and shards are cut between documents by their bytes, so the bytes written depend on the documents
alone, not on how they were read (one process or several).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pyarrow as pa

from trnrecipes.data import OUTPUT_IN_PLACE, DataError, listed
from trnrecipes.data.arrow_marks import END_OF_STREAM
from trnrecipes.data.batch_bytes import Mapped, joinable, schema_bytes, write_all, write_joined
from trnrecipes.data.manifest import MANIFEST, Manifest, Shard, holds_only_shards, shard_name, write_manifest
from trnrecipes.data.work_dir import stale_temps, temp_path
from trnrecipes.files.durable import make_readable, rename_synced, sync_tree

OFFSET_BYTES = 8  # a large_string row's offset, and an int64 label: counted in a shard's bytes with its text


def corpus_schema(text_field: str, label_field: str | None = None) -> pa.Schema:
    fields = [pa.field(text_field, pa.large_string())]
    return pa.schema(fields + ([pa.field(label_field, pa.int64())] if label_field else []))


class CorpusWriter:
    """Writes record batches of `schema`, in order, to the file `target`, or with `shard_bytes` to shards in the
    directory `target` (each holding documents up to about that many bytes: text, offsets and labels; a larger
    document alone) and their manifest. Holds one output record batch in memory at most."""

    def __init__(self, target: Path, schema: pa.Schema, rows_per_batch: int, shard_bytes: int | None = None):
        self.target, self.schema = Path(target), schema
        self.rows_per_batch, self.shard_bytes = rows_per_batch, shard_bytes
        self.row_bytes = OFFSET_BYTES * len(schema)  # offsets, and the label where there is one
        self.held: list[tuple[pa.RecordBatch, Mapped | None]] = []
        self.held_rows = 0
        self.shards: list[Shard] = []
        self.shard_rows = self.shard_text = self.shard_size = 0
        self._sink = None

    def __enter__(self) -> CorpusWriter:
        return self

    def __exit__(self, kind, *_) -> None:
        try:
            if kind is None:
                self.close()
        finally:  # also where close() failed (a full disk at the last batch): a file deleted but still open holds
            if self._sink is not None:  # its blocks, and the parts kept for a rerun need them
                self._sink.close()
                self._sink = None

    def write(self, batch: pa.RecordBatch, mapped: Mapped | None = None) -> None:
        """`batch` added to the output; `mapped`: where it is memory-mapped from, to copy its texts file to file."""
        if self.shard_bytes is None:
            self._add(batch, mapped)
            return
        texts = _text_bytes(batch.column(0))
        costs = texts + self.row_bytes
        start = 0
        while start < len(batch):
            spent = np.cumsum(costs[start:])
            fit = int(np.searchsorted(spent, self.shard_bytes - self.shard_size, side="right"))
            if fit == 0 and self.shard_rows:
                self._close_shard()
                continue
            fit = max(fit, 1)  # a document larger than a shard: a shard of its own
            self._add(batch.slice(start, fit), mapped)
            self.shard_size += int(spent[fit - 1])
            self.shard_text += int(texts[start : start + fit].sum())
            start += fit
            if start < len(batch):
                self._close_shard()

    def close(self) -> None:
        if self.shard_bytes is None:
            self._flush()
            self._open()  # an empty corpus is still a stream with its schema
            self._close_file()
            return
        if self.shard_rows:
            self._close_shard()
        names = [f.name for f in self.schema]
        write_manifest(self.target, Manifest(names[0], tuple(names), tuple(self.shards)))

    def _add(self, batch: pa.RecordBatch, mapped: Mapped | None) -> None:
        while len(batch):
            take = min(len(batch), self.rows_per_batch - self.held_rows)
            self.held.append((batch.slice(0, take), mapped))
            self.held_rows += take
            self.shard_rows += take
            batch = batch.slice(take)
            if self.held_rows == self.rows_per_batch:
                self._flush()

    def _flush(self) -> None:
        if not self.held:
            return
        self._open()
        if joinable(self.schema, self.held):
            write_joined(self._sink, self.schema, self.held)
        else:  # a fresh copy of the rows, also of a lone slice: the IPC bytes of a slice depend on what it was cut from
            columns = [pa.concat_arrays([b.column(i) for b, _ in self.held]) for i in range(len(self.schema))]
            write_all(self._sink, pa.record_batch(columns, schema=self.schema).serialize())
        self.held, self.held_rows = [], 0

    def _open(self) -> None:
        if self._sink is None:
            path = self.target if self.shard_bytes is None else self.target / shard_name(len(self.shards))
            self._sink = open(path, "wb", buffering=0)
            write_all(self._sink, schema_bytes(self.schema))

    def _close_file(self) -> None:
        write_all(self._sink, END_OF_STREAM)
        self._sink.close()
        self._sink = None

    def _close_shard(self) -> None:
        self._flush()
        self._close_file()
        self.shards.append(Shard(shard_name(len(self.shards)), self.shard_rows, self.shard_text))
        self.shard_rows = self.shard_text = self.shard_size = 0


BYTE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_bytes(text: str, flag: str) -> int:
    """'1G' -> 1073741824, '512M', '4096': a size in bytes (K, M, G, T: powers of 1024); DataError for another."""
    number, unit = text.strip().upper().rstrip("IB") or "", ""
    if number and number[-1] in BYTE_UNITS:
        number, unit = number[:-1], number[-1]
    try:
        value = int(float(number) * BYTE_UNITS[unit])
    except (ValueError, OverflowError):
        value = 0
    if value < 1:
        raise DataError(f"{flag} {text!r} is not a size in bytes; give a positive number, e.g. 1G, 512M or 1000000")
    return value


def _text_bytes(column: pa.Array) -> np.ndarray:
    """Each row's text bytes, from the offsets (no text is read)."""
    width = np.int64 if pa.types.is_large_string(column.type) else np.int32
    offsets = np.frombuffer(column.buffers()[1], dtype=width)[column.offset : column.offset + len(column) + 1]
    return np.diff(offsets).astype(np.int64)


def is_shard_dir(path: Path) -> bool:
    """A directory to-arrow wrote with --shard-bytes: its manifest and shard files, nothing else."""
    path = Path(path)
    if path.is_symlink() or not path.is_dir() or not (path / MANIFEST).is_file():
        return False
    return holds_only_shards(os.listdir(path), hidden_ok=False)


def check_shard_output(out: Path) -> None:
    """DataError unless `out` is free for a shard directory: absent, empty, or one to-arrow wrote (it is replaced)."""
    out = Path(out)
    if out.is_dir() and any(out.iterdir()) and not is_shard_dir(out):
        held = listed(sorted(p.name for p in out.iterdir()), 5)
        raise DataError(
            f"--out {out} is a directory that holds other files than a sharded corpus ({held}): --shard-bytes"
            " replaces its output directory, so it writes only a new one or one it made; choose another --out"
        )


@contextmanager
def shard_dir_output(out: Path, work: Path | None = None) -> Iterator[Path]:
    """A temp directory (in `work`, else beside `out`) that replaces `out` when the block ends without an error:
    a reader never sees a directory half-written. An `out` there before (check_shard_output) is removed after."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_old_copies(out)
    tmp = temp_path((work or out.parent) / out.name)
    tmp.mkdir()
    try:
        yield tmp
        make_readable(tmp)
        sync_tree(tmp)  # its shards and manifest on disk before the name says it is whole, and before the old goes
        old = temp_path(out) if out.exists() else None
        if old is not None:
            os.rename(out, old)
        try:
            rename_synced(tmp, out)
        except BaseException:
            if old is not None and not out.exists():
                os.rename(old, out)
            raise
        OUTPUT_IN_PLACE.set()  # what is left is clearing up (cli._stops_raise), as the old copy's removal
        if old is not None:
            shutil.rmtree(old)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def _remove_old_copies(out: Path) -> None:
    """An earlier output of `out` moved aside to be removed (.OUT.PID-xxxx.tmp), left by a process killed while it
    removed it (a time limit): a whole corpus's size, hidden, that nothing else would ever remove. Only a complete
    shard directory of a process no longer running here is removed; one being written has no manifest yet."""
    for old in stale_temps(out):
        if is_shard_dir(old):
            shutil.rmtree(old, ignore_errors=True)
