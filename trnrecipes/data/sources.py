"""Opening a recipe's data section: the documents (Arrow, Megatron .bin/.idx, or labelled Arrow for classification)
and the tokenizer, for the trainer."""

from __future__ import annotations

from pathlib import Path

from trnrecipes.data import DataError


def data_path(path: str | Path, root: Path) -> Path:
    """A recipe's data path as the job opens it: absolute, or relative to `root` (the repository); no ~ expansion.
    The trainer, sbatch's data checks and the doctor all resolve through this."""
    p = Path(path)
    return p if p.is_absolute() else root / p


def open_corpus(fmt: str, path: str | Path, tokenizer_dir: str | Path, text_field: str, root: Path):
    """(documents, tokenizer) for a recipe's data section; relative paths are taken from `root` (the repo)."""
    from trnrecipes.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(data_path(tokenizer_dir, root))
    if fmt == "arrow":
        from trnrecipes.data.arrow import ArrowDocuments

        return ArrowDocuments(data_path(path, root), tokenizer, text_field), tokenizer
    if fmt == "megatron":
        from trnrecipes.data.indexed import IndexedDocuments

        return IndexedDocuments(data_path(path, root)), tokenizer
    raise ValueError(f"unknown data format {fmt!r}; valid: arrow, megatron")


def open_labelled(recipe, root: Path):
    """(LabelledDocuments, tokenizer) for a classification recipe: its data.path's text and label columns as
    padded samples of batch.seq_len tokens (trnrecipes/data/classify.py)."""
    from trnrecipes.data.classify import LabelledDocuments
    from trnrecipes.data.tokenizer import load_tokenizer

    d, m = recipe.data, recipe.model
    tokenizer = load_tokenizer(data_path(d.tokenizer, root))
    if tokenizer.pad_id is not None and tokenizer.pad_id != m.pad_token_id:
        raise DataError(
            f"tokenizer {d.tokenizer} pads with id {tokenizer.pad_id} but model.pad_token_id is {m.pad_token_id}:"
            " the model would attend to padding; set model.pad_token_id to the tokenizer's"
        )
    path = data_path(d.path, root)
    documents = LabelledDocuments(
        path,
        tokenizer,
        text_field=d.text_field,
        label_field=d.label_field,
        num_labels=m.num_labels,
        seq_len=recipe.batch.seq_len,
        pad_id=m.pad_token_id,
    )
    return documents, tokenizer
