"""Megatron .bin/.idx token files written with numpy alone, streamed: one sequence a document, byte for byte what
megatron-core's IndexedDatasetBuilder writes (its _IndexWriter's layout; tests/test_data_parallel.py compares the two).
Workers need no torch for them, no list of every document's length is held, and parts join by concatenation.
"""

from __future__ import annotations

import os
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from trnrecipes.files.durable import rename_synced, sync_tree

HEADER = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1)  # megatron-core's _INDEX_HEADER, then its version, 1
DTYPE_CODES = {"uint16": 8, "int32": 4}  # megatron-core's DType codes of the token dtypes preprocess writes
COUNTS = struct.Struct("<BQQ")  # dtype code, sequence count, document count (documents + 1)
CHUNK = 1 << 22  # sequences handled at a time


def write_index(idx: Path, lengths: list[np.ndarray | Path], dtype: np.dtype) -> None:
    """The .idx of documents of `lengths` (in order, one sequence a document: int32 arrays, or the .idx files
    write_index wrote, each opened only while it is read, so thousands of parts never hold thousands of files open):
    the header, the dtype code and counts, then the sequence lengths (int32), their byte offsets into .bin (int64)
    and the document indices 0..n (int64). Written with file.write, not ndarray.tofile, whose failed write (a full
    disk) is an OSError without its errno."""
    n = sum(len(part) if isinstance(part, np.ndarray) else sequence_count(part) for part in lengths)
    with open(idx, "wb") as f:
        f.write(HEADER + COUNTS.pack(DTYPE_CODES[np.dtype(dtype).name], n, n + 1))
        for chunk in _chunks(lengths):
            f.write(chunk.astype(np.int32).tobytes())
        offset = 0
        for chunk in _chunks(lengths):
            sizes = chunk.astype(np.int64) * np.dtype(dtype).itemsize
            ends = np.cumsum(sizes) + offset
            f.write((ends - sizes).tobytes())
            offset = int(ends[-1])
        for start in range(0, n + 1, CHUNK):
            f.write(np.arange(start, min(start + CHUNK, n + 1), dtype=np.int64).tobytes())


def sequence_count(idx: Path) -> int:
    """The sequences of an .idx write_index wrote, from its header."""
    with open(idx, "rb") as f:
        head = f.read(len(HEADER) + COUNTS.size)
    if not head.startswith(HEADER) or len(head) < len(HEADER) + COUNTS.size:
        raise ValueError(f"{idx} is not a Megatron index")
    return COUNTS.unpack(head[len(HEADER) :])[1]


def index_lengths(idx: Path) -> np.ndarray:
    """The sequence lengths of an .idx write_index wrote (memory-mapped)."""
    n = sequence_count(idx)
    offset = len(HEADER) + COUNTS.size
    return np.memmap(idx, np.int32, "r", offset=offset, shape=(n,)) if n else np.empty(0, np.int32)


def join(prefixes: list[Path], out: Path, dtype: np.dtype) -> None:
    """The documents of several .bin/.idx pairs, in order, as out.bin/.idx (what megatron-core's add_index makes)."""
    with open(f"{out}.bin", "wb") as sink:
        for prefix in prefixes:
            with open(f"{prefix}.bin", "rb") as part:
                shutil.copyfileobj(part, sink, 1 << 24)
    write_index(Path(f"{out}.idx"), [Path(f"{p}.idx") for p in prefixes], dtype)


def _chunks(arrays: list[np.ndarray | Path]) -> Iterator[np.ndarray]:
    for source in arrays:
        array = source if isinstance(source, np.ndarray) else index_lengths(source)
        for start in range(0, len(array), CHUNK):
            yield array[start : start + CHUNK]
        del array  # a part's memory map (and its file) closed before the next is opened


def replace_pair(tmp: str | Path, out: str | Path, suffixes: tuple[str, ...]) -> None:
    """TMP.bin, TMP.idx and their other files (`suffixes` after .bin and .idx: the tokenizer record) put in place of
    OUT's, each on disk first. The old record and .idx go before anything is renamed, and the new record comes last:
    a process killed midway (a time limit during a rename) leaves a .bin without its .idx (refused as missing), or a
    whole pair without a record, never an old .idx beside a new .bin, nor a record naming another tokenizer."""
    for suffix in (".bin", ".idx", *suffixes):
        sync_tree(f"{tmp}{suffix}")  # the slow part (a TB .bin), before the old files go
    for suffix in (*suffixes, ".idx"):
        if os.path.lexists(f"{out}{suffix}"):
            os.unlink(f"{out}{suffix}")
    for suffix in (".bin", ".idx", *suffixes):
        rename_synced(f"{tmp}{suffix}", f"{out}{suffix}")
