"""Document orders that are never materialised: a seeded bijection on [0, n) evaluated per index.

At the scale of the 128-node Llama 2 post (about a billion documents, 32 ranks per node) one permutation array is
8 GB per rank; drawing one per epoch, per rank, would exhaust a node's host memory before step 1. Instead every
order here is a function: `Permutation(n, key)(i)` is a Feistel network over the smallest power of four >= n with
cycle walking (an index that lands outside [0, n) is encrypted again until it lands inside, which keeps it a
bijection on [0, n)). Evaluating a block of 64 indices costs microseconds and no memory that grows with n.

DATA_ORDER is the version of the order recorded in every checkpoint's state.json: a checkpoint from another
version resumes at the start of its next epoch (its position would index other documents), never at a wrong place.
Version 1 drew numpy permutations (before this module); version 2 is this one.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

DATA_ORDER = 2
ROUNDS = 6  # 4 rounds make a Feistel network a pseudo-random permutation (Luby-Rackoff); 6 for margin
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)  # splitmix64's finaliser


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a 64-bit avalanche (uint64 arithmetic wraps, as intended)."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


# The purpose word of a key: a split's and an epoch's permutations and a training step's random draws
# (trnrecipes/train/step_rng.py) never share keys.
SPLIT, EPOCH, STEP_RNG = 1, 2, 3


def derive_key(*words: int) -> np.ndarray:
    """ROUNDS 64-bit round keys from non-negative integers of any size (seed, purpose, epoch, source, ...), through
    numpy's SeedSequence: the same words, the same keys; any other words, independent ones."""
    return np.random.default_rng([int(w) for w in words]).integers(0, 2**64, size=ROUNDS, dtype=np.uint64)


class Permutation:
    """A seeded bijection on [0, n): `perm(indices)` maps an int array elementwise, no state, no O(n) memory."""

    def __init__(self, n: int, key: np.ndarray):
        if n < 1:
            raise ValueError(f"a permutation of {n} elements")
        self.n, self.key = int(n), np.asarray(key, dtype=np.uint64)
        self.half = max(1, (int(n - 1).bit_length() + 1) // 2)  # bits per half: 4**half >= n
        self.mask = np.uint64((1 << self.half) - 1)

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        h = np.uint64(self.half)
        left, right = x >> h, x & self.mask
        for k in self.key:
            left, right = right, left ^ (_mix(right ^ k) & self.mask)
        return (left << h) | right

    def __call__(self, indices: np.ndarray) -> np.ndarray:
        x = np.atleast_1d(np.asarray(indices, dtype=np.int64))  # arrays only: numpy scalars warn when they wrap
        if x.size and (x.min() < 0 or x.max() >= self.n):
            raise IndexError(f"index outside [0, {self.n})")
        out = self._encrypt(x.astype(np.uint64))
        outside = np.flatnonzero(out >= np.uint64(self.n))
        while outside.size:  # cycle walking: the domain is under 4n, so a few rounds at most on average
            out[outside] = self._encrypt(out[outside])
            outside = outside[out[outside] >= np.uint64(self.n)]
        return out.astype(np.int64)


class DocIds:
    """A list of document ids, evaluated per index: len(ids) and ids.take(positions) -> int64 ids."""

    def __len__(self) -> int:
        raise NotImplementedError

    def take(self, positions: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def __getitem__(self, item: slice) -> np.ndarray:
        if not isinstance(item, slice):
            raise TypeError("document ids are read by slices or take()")
        return self.take(np.arange(*item.indices(len(self)), dtype=np.int64))

    def __iter__(self) -> Iterator[int]:
        for start in range(0, len(self), 1 << 16):
            yield from self[start : start + (1 << 16)].tolist()

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        """All of them, materialised: for tests and small corpora only."""
        ids = self[:]
        return ids if dtype is None else ids.astype(dtype)


class ArrayIds(DocIds):
    """Ids held in an array (a caller's explicit list)."""

    def __init__(self, ids):
        self.ids = np.asarray(ids, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.ids)

    def take(self, positions: np.ndarray) -> np.ndarray:
        return self.ids[positions]


class PermutedRange(DocIds):
    """perm(offset + i) for i in [0, length): a contiguous piece of a permutation's image (a split's part)."""

    def __init__(self, perm: Permutation | None, offset: int, length: int):
        self.perm, self.offset, self.length = perm, int(offset), int(length)

    def __len__(self) -> int:
        return self.length

    def take(self, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64) + self.offset
        return positions if self.perm is None else self.perm(positions)


def as_doc_ids(ids) -> DocIds:
    return ids if isinstance(ids, DocIds) else ArrayIds(ids)


class RankOrder(DocIds):
    """Data-parallel rank r's documents of one epoch, in reading order: positions r, r + dp, r + 2 dp, ... of the
    epoch's order of `ids` (shuffled by `perm`, or as listed). The ranks' orders are disjoint and cover the epoch."""

    def __init__(self, ids: DocIds, perm: Permutation | None, dp_rank: int, dp_size: int):
        self.ids, self.perm, self.dp_rank, self.dp_size = ids, perm, dp_rank, dp_size

    def __len__(self) -> int:  # O(1): what ends an epoch, looked up after every sample that ends on a boundary
        return (len(self.ids) - self.dp_rank + self.dp_size - 1) // self.dp_size

    def take(self, positions: np.ndarray) -> np.ndarray:
        epoch_positions = self.dp_rank + np.asarray(positions, dtype=np.int64) * self.dp_size
        if self.perm is not None:
            epoch_positions = self.perm(epoch_positions)
        return self.ids.take(epoch_positions)


def split(num_docs: int, n_val: int, seed: int, source: int = 0) -> tuple[PermutedRange, PermutedRange]:
    """(train, validation) ids: the first n_val places of a seeded permutation of the corpus are held out. `source`:
    the corpus's place in a blend (each its own permutations)."""
    perm = Permutation(num_docs, derive_key(seed, SPLIT, source))
    return PermutedRange(perm, n_val, num_docs - n_val), PermutedRange(perm, 0, n_val)
