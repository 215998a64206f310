"""Data: raw text -> one Arrow file or a directory of shards (memory-mapped) or Megatron .bin/.idx, converted in worker
processes (conversion.py) -> tokens -> fixed-length packed samples.

Samples are numpy arrays; the training loop turns them into tensors. Only the Megatron reader (megatron-core)
imports torch. Imports config/ and trnrecipes.schema only; opening a recipe's data section: sources.py.
"""

from __future__ import annotations

import threading

from trnrecipes.config.sections import RecipeError

# Set once a conversion's output has its name (conversion.py): the CLI's Ctrl-C and SIGTERM then let the command end
# as done, removing its work dir, not as failed (a requeue would convert it all again; cli._stops_raise).
OUTPUT_IN_PLACE = threading.Event()


class DataError(RecipeError):  # a user error: the CLI prints it, exit 2
    pass


class CannotWrite(DataError):
    """The storage refused a write of a conversion's (full, read-only, ...: files/storage_errors.py), told in one
    line: the input's fault no more than a bug's."""


def listed(names, limit: int = 10) -> str:
    names = [_shortened(str(n)) for n in list(names)[: limit + 1]]
    return ", ".join(names[:limit]) + (", ..." if len(names) > limit else "")


def _shortened(name: str, width: int = 80) -> str:
    """`name`, or its start and its end around "...": a path's file name is at its end (cut at the end instead, a
    long /dir/a.jsonl once read a.json, another file)."""
    if len(name) <= width:
        return name
    keep = (width - 3) // 2
    return name[:keep] + "..." + name[-(width - 3 - keep) :]
