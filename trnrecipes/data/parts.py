"""One unit of a conversion (an input file, or a run of small ones) into its part in OUT.parts/: the part (an Arrow
stream of its documents, or Megatron .bin/.idx of their tokens), the bad records met (JSON lines, in order) and,
written last, its record (part_N.json: the counts, each input file's size and times as read, and the boot).
A part is reused while its input files are unchanged and the machine has not restarted since: the part is not
synced (a killed process loses nothing the kernel holds; the output is synced once whole, and syncing the parts too
would wait for every byte to reach the disk twice), so after a crash or on another machine it is converted again.
This runs in the worker processes (parallel.py).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from trnrecipes.data import CannotWrite, DataError
from trnrecipes.data.arrow import (
    ConversionStats,
    ReadCount,
    Texts,
    document_blocks,
    file_texts,
    record_batch,
    unreadable,
)
from trnrecipes.data.bad_records import BadRecords
from trnrecipes.data.corpus_writer import corpus_schema
from trnrecipes.data.inputs import InputFile
from trnrecipes.data.megatron_files import write_index
from trnrecipes.data.work_dir import atomic_file, temp_path
from trnrecipes.files.durable import boot_id, fsync_path
from trnrecipes.files.storage_errors import storage_problem

BOOT = boot_id()  # None where the kernel does not say: then each part is synced before its record is written
UNIT_BYTES = 32 << 20  # consecutive files smaller than this are one unit, up to about this many bytes


@dataclass(frozen=True)
class Task:
    """What a worker needs to convert unit `unit`: its files, where its part goes (`part` + suffixes), the fields,
    and how many bad records it skips before it stops (0: the first stops it; the parent applies the policy)."""

    unit: int
    files: tuple[InputFile, ...]
    part: str
    text_field: str
    label_field: str | None
    limit: int | None
    tokenizer: str | None = None  # preprocess: the tokenizer directory, and the token ids' numpy dtype
    dtype: str | None = None


def part_name(unit: int) -> str:
    return f"part_{unit:06d}"


def plan_units(files: list[InputFile]) -> list[list[int]]:
    """The files (by index, in order) cut into units: one of UNIT_BYTES or more alone, smaller ones with their
    neighbours until the unit holds about that many bytes (a folder of small text files is not a part per file)."""
    units: list[list[int]] = []
    run, size = [], 0
    for i, f in enumerate(files):
        bytes_ = f.path.stat().st_size
        if bytes_ >= UNIT_BYTES:
            units += [run, [i]] if run else [[i]]
            run, size = [], 0
            continue
        run.append(i)
        size += bytes_
        if size >= UNIT_BYTES:
            units.append(run)
            run, size = [], 0
    return units + ([run] if run else [])


def input_stats(files: tuple[InputFile, ...]) -> list[list]:
    """[path, size, mtime_ns, ctime_ns] of each file: a part made from them is reused while these are the same. The
    change time as well as the modification time: `cp -p`, `rsync -a` and `touch -r` put a changed file's
    modification time back, not its change time (set by any write, and by a copy renamed over it), so a part of the
    old text is never taken for the new one's. (Not the inode: a FUSE mount of an object store numbers files anew on
    each mount, so a requeue on another node would convert everything again.)"""
    try:
        return [[str(f.path.resolve()), (s := f.path.stat()).st_size, s.st_mtime_ns, s.st_ctime_ns] for f in files]
    except FileNotFoundError as err:
        raise unreadable(str(err.filename), err) from None


def convert_unit(task: Task, tick: Callable[..., None]) -> dict:
    """The unit's part and its record; returns the outcome: status done, error (a DataError's message: a file that
    cannot be read, a label that is no class id, a part the storage refuses) or stopped (more bad records than
    task.limit), the counts, and the file listing its bad records in order (`rejects`, in the part's directory)."""
    try:
        inputs, gone = input_stats(task.files), None  # before reading: a file changed as it is read is read again
    except DataError as err:  # removed since the inputs were listed: the unit's error, told as any other
        inputs, gone = [], err
    stats, bad = ConversionStats(), BadRecords("skip", task.limit)
    rejects = temp_path(Path(f"{task.part}.rejects.jsonl"))
    outcome: dict = {"unit": task.unit, "status": "done", "error": None, "inputs": inputs, "boot": BOOT}
    part = None
    try:
        # Every write of the unit's goes through _writing (the part, its rejects, its record): what reads the inputs
        # raises DataErrors for them (arrow.unreadable), so an OSError here is a write's.
        with _writing(task):
            part = _TokenPart(task) if task.tokenizer else _ArrowPart(task)
            with open(rejects, "w", encoding="utf-8") as sink:
                bad.sink = sink
                try:
                    if gone is not None:
                        raise gone
                    sizes = [stat[1] for stat in inputs]
                    for texts, labels in document_blocks(_blocks(task, sizes, bad, tick), stats):
                        part.write(texts, labels)
                except DataError as err:
                    if isinstance(err, CannotWrite):
                        raise
                    stopped = task.limit is not None and bad.count > task.limit
                    outcome.update(status="stopped" if stopped else "error", error=None if stopped else str(err))
        labels = sorted(stats.labels.items())
        outcome.update(documents=stats.documents, skipped_empty=stats.skipped_empty, rejected=bad.count, labels=labels)
        outcome.update(part.counts)
        if outcome["status"] != "done":
            part.abort()
            outcome["rejects"] = rejects.name  # the parent replays them, then removes the file
            return outcome
        with _writing(task):
            outcome["files"] = part.finish()
            outcome["rejects"] = None
            if bad.count:
                listed = Path(f"{task.part}.rejects.jsonl")
                os.replace(rejects, listed)
                outcome["rejects"] = listed.name
                outcome["files"][listed.name] = listed.stat().st_size
            after = input_stats(task.files)
            if [stat[:3] for stat in after] == [stat[:3] for stat in inputs]:  # not written to while read: the change
                outcome["inputs"] = after  # time as it is now (a lazy restore, as Lustre HSM's from S3, moves it)
            with atomic_file(Path(f"{task.part}.json")) as f:
                f.write(json.dumps(outcome) + "\n")
        return outcome
    except BaseException as err:
        if part is not None:
            part.abort()
        rejects.unlink(missing_ok=True)
        if not isinstance(err, CannotWrite):
            raise
        outcome.update(status="error", error=str(err), rejects=None)
        return outcome
    finally:
        if outcome["status"] == "done":
            rejects.unlink(missing_ok=True)


@contextlib.contextmanager
def _writing(task: Task) -> Iterator[None]:
    """CannotWrite for an OSError of a storage that refuses writes (full, read-only, ...), naming the unit."""
    try:
        yield
    except OSError as err:
        if (problem := storage_problem(err)) is None:
            raise
        raise CannotWrite(
            f"cannot write the part of {task.files[0].name} in {Path(task.part).parent}: {problem}, or convert to"
            " an --out elsewhere"
        ) from err


def _blocks(task: Task, sizes: list[int], bad: BadRecords, tick) -> Iterator[tuple[Texts, list[int] | None]]:
    """The unit's documents in blocks, in order; `tick` is told the bytes read so far after each block."""
    before = 0
    for f, size in zip(task.files, sizes, strict=True):
        read = ReadCount()
        for block in file_texts(f, task.text_field, bad, task.label_field, read):
            yield block
            tick(before + min(read.bytes, size))
        before += size
        tick(before)
    tick(before, final=True)


class _ArrowPart:
    """The unit's documents as an Arrow stream, in blocks as they come (the parent re-batches them)."""

    def __init__(self, task: Task):
        self.path = Path(f"{task.part}.arrow")
        self.tmp = temp_path(self.path)
        self.schema = corpus_schema(task.text_field, task.label_field)
        self.sink = pa.OSFile(str(self.tmp), "wb")
        try:
            self.writer = pa.ipc.new_stream(self.sink, self.schema)
        except BaseException:
            self.abort()
            raise
        self.counts: dict = {}

    def write(self, texts: Texts, labels: list[int] | None) -> None:
        self.writer.write_batch(record_batch(self.schema, texts, labels))

    def finish(self) -> dict[str, int]:
        self.writer.close()
        self.sink.close()
        if BOOT is None:
            fsync_path(self.tmp)
        os.replace(self.tmp, self.path)
        return {self.path.name: self.path.stat().st_size}

    def abort(self) -> None:
        with contextlib.suppress(OSError):  # what is left to write may fail as the write did (a full disk)
            self.sink.close()
        self.tmp.unlink(missing_ok=True)


_TOKENIZERS: dict[str, object] = {}  # a worker loads each tokenizer once, for all the units it converts


def remember_tokenizer(tokenizer) -> None:
    """The parent's tokenizer, for the units it converts itself (one worker): not loaded twice."""
    _TOKENIZERS[str(tokenizer.path)] = tokenizer


class _TokenPart:
    """The unit's documents tokenized, EOS appended, as Megatron .bin/.idx (megatron_files.py: no torch in the
    worker; the lengths stream to a temp file, not a list in memory)."""

    def __init__(self, task: Task):
        from trnrecipes.data.tokenizer import load_tokenizer

        if task.tokenizer not in _TOKENIZERS:
            _TOKENIZERS[task.tokenizer] = load_tokenizer(task.tokenizer)
        self.tokenizer, self.dtype = _TOKENIZERS[task.tokenizer], np.dtype(task.dtype)
        self.paths = [Path(f"{task.part}{suffix}") for suffix in (".bin", ".idx")]
        self.tmps = [temp_path(p) for p in self.paths]
        self.lengths_path = temp_path(Path(f"{task.part}.lengths"))
        self.bin = open(self.tmps[0], "wb")
        try:
            self.lengths = open(self.lengths_path, "wb")
        except BaseException:
            self.bin.close()
            self.tmps[0].unlink(missing_ok=True)
            raise
        self.counts = {"tokens": 0, "top": -1}

    def write(self, texts: Texts, labels: None) -> None:
        texts = texts.to_pylist() if isinstance(texts, pa.Array) else texts
        eos = self.tokenizer.eos_id
        docs = [np.append(ids, eos).astype(self.dtype) for ids in self.tokenizer.encode_batch(texts)]
        # file.write, not ndarray.tofile: tofile's failed write (a full disk) is an OSError without its errno
        self.bin.write(b"".join(doc.tobytes() for doc in docs))
        self.lengths.write(np.array([len(d) for d in docs], np.int32).tobytes())
        self.counts["top"] = max([self.counts["top"], *(int(d.max()) for d in docs)])
        self.counts["tokens"] += sum(len(d) for d in docs)

    def finish(self) -> dict[str, int]:
        self.bin.close()
        self.lengths.close()
        size = self.lengths_path.stat().st_size
        lengths = np.memmap(self.lengths_path, np.int32, "r") if size else np.empty(0, np.int32)
        write_index(self.tmps[1], [lengths], self.dtype)
        for tmp, path in zip(self.tmps, self.paths, strict=True):
            if BOOT is None:
                fsync_path(tmp)
            os.replace(tmp, path)
        self.lengths_path.unlink()
        return {p.name: p.stat().st_size for p in self.paths}

    def abort(self) -> None:
        for f in (self.bin, self.lengths):
            with contextlib.suppress(OSError):  # its buffer's flush may fail as the write did (a full disk)
                f.close()
        for tmp in (*self.tmps, self.lengths_path):
            tmp.unlink(missing_ok=True)
