"""Corpora blended by weight (data.sources), as NeMo's weighted data_prefix does: sample i of the blend comes from
the source whose share lags its weight most, i.e. argmax_k(w_k * (i + 1) - n_k), n_k being the samples source k
has given so far (Megatron's BlendedDataset builds the same greedy index). Every source's realised share of the
samples, and so of the tokens (every sample is seq_len + 1 tokens), then stays within about one sample of its
weight (two sources: under one; up to seven, 1.16 at worst over 200 random weightings).

Each source is its own PackedStream: its own documents, train/validation split and epochs. The choice depends only
on the per-source counts, which the position records, so a resumed blend goes on with the same choices, and every
DP rank (reading its own slice of each source) makes the same ones.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from trnrecipes.data.pack import PackedStream, StreamPosition


@dataclass(frozen=True)
class BlendPosition:
    """Where each source's stream resumes; `samples` this rank has produced from the blend."""

    sources: tuple[StreamPosition, ...]
    samples: int = 0

    @property
    def epoch(self) -> int:  # the furthest any source has gone, for messages
        return max(p.epoch for p in self.sources)

    def to_dict(self) -> dict:
        return {"samples": self.samples, "sources": [p.to_dict() for p in self.sources]}

    @classmethod
    def from_dict(cls, d: dict) -> BlendPosition:
        return cls(tuple(StreamPosition.from_dict(p) for p in d["sources"]), int(d["samples"]))


DataPosition = StreamPosition | BlendPosition


def position_from_dict(d: dict, num_sources: int) -> StreamPosition | BlendPosition:
    """A saved data position, as the stream of `num_sources` sources reads it. ValueError if it is the other kind."""
    if num_sources == 1:
        if "sources" in d:
            raise ValueError("a blend's position, but data has one source")
        return StreamPosition.from_dict(d)
    if "sources" not in d or len(d["sources"]) != num_sources:
        raise ValueError(f"not a position of a blend of {num_sources} sources")
    return BlendPosition.from_dict(d)


def restart_position(saved: Sequence[dict], num_sources: int) -> StreamPosition | BlendPosition:
    """Where a stream starts when a saved position does not carry over: each source at the epoch after the furthest
    any rank reached (the rest of that epoch is skipped, nothing is read twice)."""
    per_source = [[int(p.get("epoch", 0)) for p in d["sources"]] if "sources" in d else [int(d.get("epoch", 0))]
                  for d in saved]  # fmt: skip
    if num_sources == 1 or any(len(e) != num_sources for e in per_source):  # another shape: one epoch for all
        epoch = max([max(e, default=-1) for e in per_source], default=-1) + 1
        epochs = [epoch] * num_sources
    else:
        epochs = [max((e[k] for e in per_source), default=-1) + 1 for k in range(num_sources)]
    if num_sources == 1:
        return StreamPosition(epoch=epochs[0])
    return BlendPosition(tuple(StreamPosition(epoch=e) for e in epochs))


def choose(weights: np.ndarray, counts: np.ndarray) -> int:
    """The source of the next sample: the one furthest behind its share (ties: the first)."""
    return int(np.argmax(weights * (counts.sum() + 1) - counts))


class BlendedStream:
    """Samples of several PackedStreams (one per source), interleaved by weight; (sample, BlendPosition after it)."""

    def __init__(self, streams: Sequence[PackedStream], weights: Sequence[float], samples: int = 0):
        if len(streams) != len(weights) or not streams:
            raise ValueError("one weight per stream")
        self.streams = list(streams)
        self.weights = np.asarray(weights, dtype=np.float64) / float(np.sum(weights))
        self.samples = samples

    def __iter__(self) -> Iterator[tuple[np.ndarray, BlendPosition]]:
        positions = [s.start for s in self.streams]
        counts = np.array([p.samples for p in positions], dtype=np.int64)
        samples = self.samples
        iterators = [iter(s) for s in self.streams]
        while True:
            k = choose(self.weights, counts)
            sample, positions[k] = next(iterators[k])
            counts[k] += 1
            samples += 1
            yield sample, BlendPosition(tuple(positions), samples)
