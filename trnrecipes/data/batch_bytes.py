"""A corpus's record batch written as the Arrow IPC bytes pyarrow's stream writer would write for the pieces it is
joined from, straight from their buffers: no joined copy in memory, and the text of a piece memory-mapped from a
file (a conversion's part) copied file to file by the kernel (copy_file_range). Texts and labels without nulls only.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from functools import cache

import numpy as np
import pyarrow as pa

ALIGNMENT = 8  # pyarrow's IPC writer pads each body buffer to this


@dataclass(frozen=True)
class Mapped:
    """Where a piece's buffers lie: memory-mapped from the file `path` at `base` (the address of its byte 0), `size`
    bytes long. A buffer outside that range (one pyarrow copied on reading) is written from memory instead."""

    path: str
    base: int
    size: int


def joinable(schema: pa.Schema, pieces: list[tuple[pa.RecordBatch, Mapped | None]]) -> bool:
    """Whether write_joined writes these pieces: a text column (large_string) and maybe an int64 one, no nulls."""
    types = [pa.large_string(), pa.int64()][: len(schema)]
    return schema.types == types and not any(column.null_count for batch, _ in pieces for column in batch.columns)


def write_joined(sink, schema: pa.Schema, pieces: list[tuple[pa.RecordBatch, Mapped | None]]) -> None:
    """The pieces' rows as one record batch message of `schema`, at the position of `sink` (a file opened for binary
    writing, unbuffered): the bytes pyarrow writes for their concatenation (tests/test_batch_bytes.py)."""
    rows = sum(len(batch) for batch, _ in pieces)
    offsets = np.empty(rows + 1, np.int64)
    offsets[0] = 0
    text, row = [], 0
    for batch, _ in pieces:
        ends = _offsets(batch.column(0))
        offsets[row + 1 : row + 1 + len(batch)] = ends[1:] - ends[0] + offsets[row]
        text.append((int(ends[0]), int(ends[-1] - ends[0])))
        row += len(batch)
    lengths = [0, offsets.nbytes, int(offsets[-1])] + ([0, rows * 8] if len(schema) == 2 else [])
    write_all(sink, _header(schema, rows, lengths))
    _write_padded(sink, offsets.data)
    for (batch, mapped), (start, size) in zip(pieces, text, strict=True):
        data = batch.column(0).buffers()[2]
        position = data.address - mapped.base + start if mapped is not None else -1
        inside = mapped is not None and 0 <= position and position + size <= mapped.size
        if not inside or not _copied(mapped, position, size, sink):
            write_all(sink, memoryview(data)[start : start + size])
    _pad(sink, lengths[2])
    if len(schema) == 2:
        for batch, _ in pieces:
            labels = batch.column(1)
            write_all(sink, memoryview(labels.buffers()[1])[labels.offset * 8 : (labels.offset + len(labels)) * 8])


def schema_bytes(schema: pa.Schema) -> bytes:
    """The stream's first message, as pyarrow's stream writer writes it."""
    return schema.serialize().to_pybytes()


def _offsets(column: pa.Array) -> np.ndarray:
    return np.frombuffer(column.buffers()[1], np.int64, len(column) + 1, column.offset * 8)


def _copied(mapped: Mapped, position: int, size: int, sink) -> bool:
    """Whether the kernel copied `size` bytes at `position` of the mapped file to `sink` (else nothing was written:
    a file system or kernel without copy_file_range between these files)."""
    done = 0
    try:
        with open(mapped.path, "rb", buffering=0) as source:
            while done < size:
                step = os.copy_file_range(source.fileno(), sink.fileno(), size - done, position + done)
                if step == 0:
                    raise OSError("copy_file_range copied nothing")
                done += step
    except OSError:
        if done:  # part of it written: take the rest from memory
            raise
        return False
    return True


def write_all(sink, data) -> None:
    """All of `data` written to an unbuffered file (a write of more than 2 GiB writes part of it)."""
    view = memoryview(data).cast("B")
    while view.nbytes:
        view = view[sink.write(view) :]


def _write_padded(sink, data) -> None:
    write_all(sink, data)
    _pad(sink, memoryview(data).nbytes)


def _pad(sink, size: int) -> None:
    if size % ALIGNMENT:
        write_all(sink, bytes(ALIGNMENT - size % ALIGNMENT))


def _header(schema: pa.Schema, rows: int, lengths: list[int]) -> bytes:
    """The message's prefix and metadata: a one-row batch's, serialized by pyarrow, with this batch's numbers."""
    template, places = _template(schema)
    header = bytearray(template)
    body = 0
    buffers = []
    for length in lengths:
        buffers += [body, length]
        body += -(-length // ALIGNMENT) * ALIGNMENT
    struct.pack_into("<q", header, places["rows"], rows)
    struct.pack_into("<q", header, places["body"], body)
    struct.pack_into(f"<{2 * len(schema)}q", header, places["nodes"], *[rows, 0] * len(schema))
    struct.pack_into(f"<{len(buffers)}q", header, places["buffers"], *buffers)
    return bytes(header)


@cache
def _template(schema: pa.Schema) -> tuple[bytes, dict[str, int]]:
    """A one-row batch's message prefix and metadata (a flatbuffer), and where in it are the numbers that change
    with the batch: its rows, its body's length, each column's (length, null count) and each buffer's (offset,
    length). Read from the flatbuffer's tables, not searched for by value."""
    columns = [pa.array(["x"], pa.large_string()), pa.array([1], pa.int64())][: len(schema)]
    message = pa.record_batch(columns, schema=schema).serialize().to_pybytes()
    (size,) = struct.unpack_from("<i", message, 4)
    meta = 8  # after the continuation marker and the metadata's length

    def u32(at: int) -> int:
        return struct.unpack_from("<I", message, at)[0]

    def fields(table: int) -> list[int]:
        vtable = table - struct.unpack_from("<i", message, table)[0]
        count = (struct.unpack_from("<H", message, vtable)[0] - 4) // 2
        return [table + struct.unpack_from("<H", message, vtable + 4 + 2 * k)[0] for k in range(count)]

    root = fields(meta + u32(meta))  # Message: version, header_type, header, bodyLength
    batch = fields(root[2] + u32(root[2]))  # RecordBatch: length, nodes, buffers
    nodes, buffers = (at + u32(at) for at in batch[1:3])
    if u32(nodes) != len(schema) or u32(buffers) != 3 + 2 * (len(schema) - 1):
        raise AssertionError(f"pyarrow {pa.__version__} lays out a record batch message otherwise than expected")
    places = {"rows": batch[0], "body": root[3], "nodes": nodes + 4, "buffers": buffers + 4}
    return message[: meta + size], places
