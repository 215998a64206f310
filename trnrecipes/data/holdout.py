"""How many documents of a corpus are held out for validation: one rule for the trainer's split (pack.py) and the
checks made before a job is submitted (jobs/corpus_check.py). Standard library only."""

from __future__ import annotations


def held_out(num_docs: int, val_fraction: float) -> int:
    """round(val_fraction * n) documents, at least 1 when val_fraction > 0."""
    return max(1, round(val_fraction * num_docs)) if val_fraction > 0 else 0


def fewest_documents(train_needed: int, val_fraction: float) -> int:
    """The smallest corpus that leaves `train_needed` training documents (and one to validate on when
    val_fraction > 0) after the split."""
    n = max(1, train_needed + (1 if val_fraction > 0 else 0))
    if val_fraction > 0:
        n = max(n, int((train_needed - 1) / (1 - val_fraction)))  # below it, n - held_out(n) < train_needed
    while n - held_out(n, val_fraction) < train_needed:
        n += 1
    return n
