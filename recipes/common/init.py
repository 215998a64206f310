"""Weight initialisation that gives the same full model however it is sharded, filling only the part asked for.

A parameter's random values are drawn in fixed blocks of rows of the FULL tensor, each block from its own generator
seeded by (seed, parameter name, block index). Any rectangle of the full tensor (a TP shard along rows or columns,
a ZeRO slice, the whole tensor) is filled by drawing only the blocks it touches, so:
- the same seed gives bitwise the same full weights at TP 1, 2, 4, ... (a block is always drawn whole, with the same
  generator state and size, so the same kernel path produces it), and
- a rank never holds more than its shard plus one block (BLOCK_ELEMENTS values) while it initialises.

The model code says, per parameter, what to draw (`init_rules()`: normal with a std, ones or zeros); this module says
how. Plain PyTorch, no trnrecipes import: model.py uses it for single-device init_weights().
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

# Values drawn per block (4 MB of fp32): bounds the temporary memory of a fill. Part of the init's definition:
# another block size draws other values (the same for every layout still).
BLOCK_ELEMENTS = 1 << 20


@dataclass(frozen=True)
class Init:
    kind: str  # "normal", "ones" or "zeros"
    std: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("normal", "ones", "zeros"):
            raise ValueError(f"init kind must be normal, ones or zeros, not {self.kind!r}")


def standard_init_rules(
    model: torch.nn.Module, std: float, scaled_outputs: tuple[str, ...] = (), num_layers: int = 1
) -> dict[str, Init]:
    """The rules every family here uses: biases zero, norm weights one, every other weight normal(0, std), except
    the weights whose names end with one of `scaled_outputs` (the output projections, which write into the residual
    stream 2 * num_layers times), drawn with std / sqrt(2 * num_layers) so the residual's variance does not grow
    with depth (GPT-2 / Megatron scaled init, the 128-node Llama 2 post)."""
    out_std = std / math.sqrt(2 * num_layers)
    rules = {}
    for name, _ in model.named_parameters():
        if name.endswith("bias"):
            rules[name] = Init("zeros")
        elif "norm" in name:
            rules[name] = Init("ones")
        else:
            rules[name] = Init("normal", out_std if scaled_outputs and name.endswith(scaled_outputs) else std)
    return rules


def block_seed(seed: int, name: str, block: int) -> int:
    """A generator seed per (run seed, parameter, block): stable across processes and Python versions (no hash())."""
    digest = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def fill_region(
    out: torch.Tensor, full_shape: tuple[int, ...], start: tuple[int, ...], rule: Init, seed: int, name: str
) -> None:
    """Fill `out` (any device and dtype) with the part of parameter `name`'s full initial value that begins at
    `start` (one offset per dim) and has out's shape. Values are drawn in fp32 and rounded once into out's dtype."""
    if len(full_shape) != out.dim() or len(start) != out.dim():
        raise ValueError(f"{name}: region start {start} / full shape {full_shape} do not match a {out.dim()}-d tensor")
    with torch.no_grad():
        if rule.kind != "normal":
            out.fill_(1.0 if rule.kind == "ones" else 0.0)
            return
        if out.numel() == 0 or out.is_meta:  # meta: shapes only, nothing to fill
            return
        if out.dim() > 2 and tuple(out.shape[1:]) != tuple(full_shape[1:]):
            raise ValueError(f"{name}: only row and column regions can be filled, not {tuple(out.shape)}")
        rows_full, cols_full = (full_shape[0], math.prod(full_shape[1:])) if full_shape else (1, 1)
        row0, rows = (start[0], out.shape[0]) if out.dim() else (0, 1)
        col0 = start[1] if out.dim() > 1 else 0  # only a matrix's column shard is narrower than its full rows
        dest = out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
        flat = dest.view(rows, -1)
        block_rows = max(1, BLOCK_ELEMENTS // max(1, cols_full))
        for block in range(row0 // block_rows, (row0 + rows - 1) // block_rows + 1):
            b0, b1 = block * block_rows, min(rows_full, (block + 1) * block_rows)
            generator = torch.Generator().manual_seed(block_seed(seed, name, block))
            values = torch.empty(b1 - b0, cols_full, dtype=torch.float32, device="cpu").normal_(
                0.0, rule.std, generator=generator
            )
            lo, hi = max(b0, row0), min(b1, row0 + rows)
            # copy_ converts dtype and device: values are rounded once into the parameter's dtype.
            flat[lo - row0 : hi - row0].copy_(values[lo - b0 : hi - b0, col0 : col0 + flat.shape[1]])
        if dest is not out:
            out.copy_(dest)


def init_full(model: torch.nn.Module, rules: dict[str, Init], seed: int) -> None:
    """Initialise every parameter of an unsharded model: the same values a sharded build gives, gathered."""
    params = dict(model.named_parameters())
    if missing := sorted(set(params) - set(rules)):
        raise ValueError(f"no init rule for parameter(s) {missing[:3]}")
    for name, p in params.items():
        fill_region(p.data, tuple(p.shape), (0,) * p.dim(), rules[name], seed, name)
