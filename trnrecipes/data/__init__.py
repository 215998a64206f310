"""Data: raw text -> one Arrow file or a directory of shards (memory-mapped) or Megatron .bin/.idx, converted in worker
processes (conversion.py) -> tokens -> fixed-length packed samples.

Samples are numpy arrays; the training loop turns them into tensors. Only the Megatron reader (megatron-core)
imports torch. Imports config/ and trnrecipes.schema only; opening a recipe's data section: sources.py.
"""

from __future__ import annotations

from trnrecipes.config.sections import RecipeError


class DataError(RecipeError):  # a user error: the CLI prints it, exit 2
    pass


def listed(names, limit: int = 10) -> str:
    names = [str(n)[:80] for n in list(names)[: limit + 1]]
    return ", ".join(names[:limit]) + (", ..." if len(names) > limit else "")
