"""Stochastic rounding fp32 -> bf16 with counter-based noise: a hash of (seed, step, stream, element), no generator.

Why a hash and not torch.randint with a seeded generator (what this was until the optimizer step was compiled):
- A generator argument breaks torch.compile's graph (dynamo does not trace torch.Generator), so the compiled step
  graph-broke and recompiled per parameter group; a hash is a few integer ops that compile into the same kernel as
  the update (torch.compile, torch-xla and TorchNeuron's backend alike).
- The noise is a pure function of the step count, so a resumed run draws what an uninterrupted one would with no
  generator state in the checkpoint, and eager and compiled steps round bitwise alike.
- It is keyed by each element's place in its parameter group (not by chunk), so how the eager step cuts a group into
  passes does not change the noise.

The hash is the 32-bit integer mixer of Thomas Mueller (two multiply-xorshift rounds, good avalanche), evaluated in
int64 with every product below 2^59, so nothing relies on signed overflow wrapping (undefined in C, not promised by
every compiler backend). The low 16 bits of the mix are the noise added to the 16 bits bf16 drops.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # < 2^27: a 32-bit value times it stays below 2^59

# Streams of one parameter group: the weights and, with optim.state_dtype bf16, the two moments.
WEIGHTS, EXP_AVG, EXP_AVG_SQ = 0, 1, 2


def mix32(x):
    """A bijection of [0, 2^32), for Python ints and int64 tensors alike."""
    x = (((x >> 16) ^ x) * _MUL) & _M32
    x = (((x >> 16) ^ x) * _MUL) & _M32
    return (x >> 16) ^ x


def stream_constant(seed: int, group: int, stream: int) -> int:
    """The step-independent half of a stream's key: one per (seed, parameter group, stream)."""
    return mix32(mix32(seed & _M32) ^ ((group * 3 + stream) & _M32))


def stream_key(step_count: torch.Tensor, constant: int) -> torch.Tensor:
    """The key of a stream at a step (an int64 0-dim tensor on the step count's device): the step count stays a
    tensor, so a traced or compiled graph takes it as input data and every step runs the same graph."""
    return mix32(mix32(step_count.to(torch.int64)) ^ constant)


def noise16(numel: int, start: int, key: torch.Tensor) -> torch.Tensor:
    """int32 noise in [0, 2^16) for the elements start .. start + numel - 1 of a stream."""
    counter = torch.arange(start, start + numel, dtype=torch.int64, device=key.device)
    x = mix32((counter & _M32) ^ key)
    if start + numel > 1 << 32:  # a group of over 4G elements (a 7B model at TP 1): the high word mixed in too
        x = mix32(x ^ (counter >> 32))
    return (x & 0xFFFF).to(torch.int32)


def round_flat_(flat: torch.Tensor, start: int, key: torch.Tensor) -> torch.Tensor:
    """fp32 `flat` (1-D) rounded stochastically to values bf16 holds exactly, in place; returns it. Adding noise
    uniform in [0, 2^16) to the 16 bits bf16 drops and truncating rounds up with probability equal to the distance
    from the lower neighbour, so E[round(x)] = x; the result's low 16 bits are zero, so a copy to bf16 is exact."""
    bits = flat.view(torch.int32)
    bits.add_(noise16(flat.numel(), start, key)).bitwise_and_(-65536)  # -65536 == 0xFFFF0000
    return flat


def rounding_seed(seed: int, dims, tp_replicated: bool = False) -> int:
    """Seed of the stochastic-rounding noise: one per TP rank and pipeline stage (their tensors differ: the same noise
    at the same places of same-shaped layers would correlate their rounding), the same on every DP replica. The
    replicas apply the same averaged update to the same weights; different noise would round them apart, and nothing
    re-syncs them. Under ZeRO-1 or FSDP each row is rounded by one rank of the shard group (dp x cp) and then shared,
    so there each shard rank has its own noise too (its rows' counters start at 0 like every other rank's).
    `tp_replicated`: the seed of the parameters every TP rank holds whole (norms, a mixture of experts' router and
    experts): the same on every TP rank, for the same reason as across replicas: each applies the same update to
    the same copy, and noise of its own would round the copies apart."""
    shard = getattr(dims, "shard_rank", dims.dp_rank) if getattr(dims, "shards_moments", False) else 0
    tp = 0 if tp_replicated else dims.tp_rank
    return seed + tp + (getattr(dims, "pp_rank", 0) << 12) + (shard << 20)
