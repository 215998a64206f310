"""Data: raw text -> one Arrow file (memory-mapped) or Megatron .bin/.idx -> tokens -> fixed-length packed samples.

Samples are numpy arrays; the training loop turns them into tensors. Only the Megatron reader (megatron-core)
imports torch.
"""

from __future__ import annotations

from pathlib import Path

from trnrecipes.recipe import RecipeError


class DataError(RecipeError):  # a user error: the CLI prints it, exit 2
    pass


def listed(names, limit: int = 10) -> str:
    names = [str(n)[:80] for n in list(names)[: limit + 1]]
    return ", ".join(names[:limit]) + (", ..." if len(names) > limit else "")


def open_corpus(fmt: str, path: str | Path, tokenizer_dir: str | Path, text_field: str, root: Path):
    """(documents, tokenizer) for a recipe's data section; relative paths are taken from `root` (the repo)."""
    from trnrecipes.data.tokenizer import load_tokenizer

    def resolve(p: str | Path) -> Path:
        p = Path(p)
        return p if p.is_absolute() else root / p

    tokenizer = load_tokenizer(resolve(tokenizer_dir))
    if fmt == "arrow":
        from trnrecipes.data.arrow import ArrowDocuments

        return ArrowDocuments(resolve(path), tokenizer, text_field), tokenizer
    if fmt == "megatron":
        from trnrecipes.data.indexed import IndexedDocuments

        return IndexedDocuments(resolve(path)), tokenizer
    raise ValueError(f"unknown data format {fmt!r}; valid: arrow, megatron")
