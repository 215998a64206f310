"""Documents -> one token stream (EOS after each document) -> fixed samples of seq_len + 1 tokens.

Static shapes only: every sample has exactly seq_len + 1 tokens (inputs = s[:-1], labels = s[1:]); a document that
does not fit continues in the next sample, and what is left at the end of an epoch continues into the next one,
so no token is dropped or repeated. Data-parallel ranks take disjoint slices of each epoch's document order
(rank r: documents r, r + dp, r + 2*dp, ...), which together cover it. Everything is a function of
(seed, epoch, dp_rank, dp_size), and the position (epoch, document, token offset) after each sample is reported
with it, so training resumes exactly where it stopped. No order is materialised (order.py): a rank's next block of
documents is computed from its position, so nothing here grows with the corpus.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Protocol

import numpy as np

from trnrecipes.data import DataError
from trnrecipes.data.holdout import held_out
from trnrecipes.data.order import EPOCH, DocIds, Permutation, RankOrder, as_doc_ids, derive_key, split

TOKENIZE_BLOCK = 64  # documents per encode_batch call


class DocumentSource(Protocol):
    """Token ids per document, each ending with EOS."""

    num_docs: int

    def tokens(self, doc_ids: Sequence[int]) -> list[np.ndarray]: ...


@dataclass(frozen=True)
class StreamPosition:
    """Where the next sample starts: document `doc` (index into this rank's order of `epoch`), token `offset`."""

    epoch: int = 0
    doc: int = 0
    offset: int = 0
    samples: int = 0  # samples this rank has produced so far

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> StreamPosition:
        return cls(**{k: int(d[k]) for k in ("epoch", "doc", "offset", "samples")})


def split_documents(
    num_docs: int, val_fraction: float, seed: int, source: object = "the corpus", index: int = 0
) -> tuple[DocIds, DocIds]:
    """(train, validation) document ids: a seeded choice of round(val_fraction * n) documents (at least 1) is held
    out. Fixed by the seed alone, so every rank and every restart agrees; evaluated per index, never listed.
    `source` names the corpus in errors; `index` is its place in a blend (each source its own permutations)."""
    if num_docs < 1:
        raise DataError(f"{source} has no documents")
    if not 0 <= val_fraction < 1:
        raise DataError(f"data.val_fraction must be in [0, 1), got {val_fraction}")
    n_val = held_out(num_docs, val_fraction)
    if n_val >= num_docs:
        raise DataError(
            f"{source} has {num_docs} document(s): too few to hold out {n_val} for validation"
            f" (data.val_fraction {val_fraction}) and train on the rest; use a bigger corpus or data.val_fraction=0"
        )
    return split(num_docs, n_val, seed, index)


class PackedStream:
    def __init__(
        self,
        source: DocumentSource,
        doc_ids: DocIds | np.ndarray,
        seq_len: int,
        seed: int = 0,
        dp_rank: int = 0,
        dp_size: int = 1,
        shuffle: bool = True,
        start: StreamPosition | None = None,
        index: int = 0,  # the source's place in a blend: each its own epoch permutations
    ):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is not in [0, {dp_size})")
        if len(doc_ids) < dp_size:
            raise DataError(
                f"{getattr(source, 'path', 'the corpus')}: {len(doc_ids)} document(s) to read cannot be shared by"
                f" {dp_size} data-parallel ranks; use a corpus with more documents"
            )
        self.source, self.doc_ids, self.sample_len = source, as_doc_ids(doc_ids), seq_len + 1
        self.seed, self.dp_rank, self.dp_size, self.shuffle = seed, dp_rank, dp_size, shuffle
        self.start, self.index = start or StreamPosition(), index
        # This rank's documents in every epoch (the same count whatever the shuffle): what _after compares with.
        self.docs_per_epoch = len(RankOrder(self.doc_ids, None, dp_rank, dp_size))

    def order(self, epoch: int) -> RankOrder:
        """This rank's documents for `epoch`, in reading order (evaluated per block, never listed)."""
        perm = Permutation(len(self.doc_ids), derive_key(self.seed, EPOCH, epoch, self.index)) if self.shuffle else None
        return RankOrder(self.doc_ids, perm, self.dp_rank, self.dp_size)

    def _documents(self) -> Iterator[tuple[int, int, int, np.ndarray]]:
        """(epoch, doc, offset, tokens from offset) from the start position on, forever."""
        epoch, doc, offset = self.start.epoch, self.start.doc, self.start.offset
        while True:
            order = self.order(epoch)
            for block in range(doc, len(order), TOKENIZE_BLOCK):
                for i, tokens in enumerate(self.source.tokens(order[block : block + TOKENIZE_BLOCK].tolist())):
                    yield epoch, block + i, offset, tokens[offset:]
                    offset = 0
            epoch, doc = epoch + 1, 0

    def __iter__(self) -> Iterator[tuple[np.ndarray, StreamPosition]]:
        """(sample [seq_len + 1] int64, position after it)."""
        n = self.sample_len
        pieces: deque[list] = deque()  # [epoch, doc, offset, tokens]: the not yet emitted rest of each document
        have, samples = 0, self.start.samples
        for epoch, doc, offset, tokens in self._documents():
            if len(tokens) == 0:
                continue
            pieces.append([epoch, doc, offset, tokens])
            have += len(tokens)
            while have >= n:
                sample = np.empty(n, dtype=np.int64)
                filled = 0
                while filled < n:
                    piece = pieces[0]
                    take = min(n - filled, len(piece[3]))
                    sample[filled : filled + take] = piece[3][:take]
                    filled += take
                    if take == len(piece[3]):
                        pieces.popleft()
                    else:
                        piece[2], piece[3] = piece[2] + take, piece[3][take:]
                have -= n
                samples += 1
                if pieces:
                    nxt = StreamPosition(pieces[0][0], pieces[0][1], pieces[0][2], samples)
                else:  # the sample ended exactly at a document boundary
                    nxt = self._after(epoch, doc, samples)
                yield sample, nxt

    def _after(self, epoch: int, doc: int, samples: int) -> StreamPosition:
        if doc + 1 < self.docs_per_epoch:  # no order drawn: a sample ending on a boundary costs nothing
            return StreamPosition(epoch, doc + 1, 0, samples)
        return StreamPosition(epoch + 1, 0, 0, samples)


def batches(stream: PackedStream, micro_batch: int) -> Iterator[tuple[np.ndarray, StreamPosition]]:
    """[micro_batch, seq_len + 1] arrays (always full: static shapes) and the position after each."""
    rows: list[np.ndarray] = []
    for sample, position in stream:
        rows.append(sample)
        if len(rows) == micro_batch:
            yield np.stack(rows), position
            rows = []


class Prefetcher:
    """Runs an iterator in a background thread, `depth` items ahead, so the step never waits on tokenization
    (tokenizers releases the GIL while it encodes). Errors surface in the consumer; close() stops the thread."""

    _DONE = object()

    def __init__(self, items: Iterator, depth: int = 8):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._finished = False
        self._thread = threading.Thread(target=self._run, args=(items,), daemon=True, name="trnrecipes-prefetch")
        self._thread.start()

    def _run(self, items: Iterator) -> None:
        try:
            for item in items:
                if not self._put(item):
                    return
            self._put(self._DONE)
        except BaseException as err:
            self._put(err)

    def _put(self, item: object) -> bool:
        """Block until there is room, but give up (False) once close() is called."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self):
        if self._finished:
            raise StopIteration
        item = self._queue.get()
        if item is self._DONE:
            self._finished = True
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
