"""Where a shard sits in its full tensor: the one rule that building, ZeRO-1, saving and loading all use.

A parameter of full shape F is split over TP along one dim (or not at all), torch.chunk style: chunk c = ceil(n/parts),
part i holds [i*c, min((i+1)*c, n)) (DTensor's Shard(d) and NxD's partition_dim, which needs n % tp == 0, agree).
Under ZeRO-1 the TP-local tensor's dim 0 is split the same way over the data-parallel ranks, for optimizer states.
A region is (start, size) per dim of the full tensor. Torch-free: plain integers.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Region:
    start: tuple[int, ...]
    size: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.size:
            n *= s
        return n

    def intersect(self, other: Region) -> Region | None:
        starts = tuple(max(a, b) for a, b in zip(self.start, other.start, strict=True))
        stops = tuple(
            min(a + s, b + t) for a, s, b, t in zip(self.start, self.size, other.start, other.size, strict=True)
        )
        if any(stop <= start for start, stop in zip(starts, stops, strict=True)):
            return None
        return Region(starts, tuple(stop - start for start, stop in zip(starts, stops, strict=True)))

    def slices_within(self, outer: Region) -> tuple[slice, ...]:
        """This region as index slices into a tensor that holds `outer` (which contains it)."""
        return tuple(slice(a - o, a - o + s) for a, s, o in zip(self.start, self.size, outer.start, strict=True))


def chunk_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of part `index` of `n` items split torch.chunk style (trailing parts may be short or empty)."""
    if parts < 1 or not 0 <= index < parts:
        raise ValueError(f"part {index} of {parts}: not a valid split")
    chunk = -(-n // parts) if n else 0
    start = min(n, index * chunk)
    return start, min(n, start + chunk)


def shard_region(
    full_shape: tuple[int, ...],
    tp_dim: int | None,
    tp: int,
    tp_rank: int,
    dp: int = 1,
    dp_rank: int = 0,
    experts: tuple[int, int] = (1, 0),
) -> Region:
    """The part of a full tensor held by TP rank `tp_rank` (split along tp_dim, None = replicated) and, when dp > 1,
    by DP rank `dp_rank` of that TP-local tensor's dim 0 (ZeRO-1's optimizer-state slice). `experts` (ep, ep_rank):
    stacked experts' dim 0 split first over the expert-parallel ranks."""
    start, size = [0] * len(full_shape), list(full_shape)
    if experts[0] > 1:
        a, b = chunk_range(full_shape[0], *experts)
        start[0], size[0] = a, b - a
    if tp_dim is not None and tp > 1:
        a, b = chunk_range(full_shape[tp_dim], tp, tp_rank)
        start[tp_dim], size[tp_dim] = a, b - a
    if dp > 1 and full_shape:
        a, b = chunk_range(size[0], dp, dp_rank)
        start[0], size[0] = start[0] + a, b - a
    return Region(tuple(start), tuple(size))
