"""Opening a recipe's data section: the documents (Arrow, Megatron .bin/.idx, or labelled Arrow for classification)
and the tokenizer, for the trainer."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from trnrecipes.config.sections import DataSource
from trnrecipes.data import DataError


def data_path(path: str | Path, root: Path) -> Path:
    """A recipe's data path as the job opens it: absolute, or relative to `root` (the repository); no ~ expansion.
    The trainer, sbatch's data checks and the doctor all resolve through this."""
    p = Path(path)
    return p if p.is_absolute() else root / p


@dataclass(frozen=True)
class OpenedSource:
    """One corpus of the run (data.path, or one of data.sources), opened, with its own train/validation split."""

    path: str  # as the recipe names it
    weight: float
    documents: object  # ArrowDocuments or IndexedDocuments: num_docs, tokens(ids)
    train: object  # DocIds (trnrecipes/data/order.py)
    val: object


def corpus_file(source, root: Path) -> Path:
    """The file that is a corpus (data.path or one of data.sources): the Arrow file, or a Megatron pair's .bin."""
    full = data_path(source.path, root)
    return Path(f"{full}.bin") if source.format == "megatron" else full


def _files(source, root: Path) -> dict[tuple[int, int], Path]:
    """(device, inode) -> path of every file that holds the source's documents: its Arrow file or .bin, or each
    shard a shard directory's manifest lists (with the directory itself)."""
    path = corpus_file(source, root)
    try:
        info = os.stat(path)
    except OSError:  # missing or unreachable: said where it is opened
        return {}
    found = {(info.st_dev, info.st_ino): path}
    if path.is_dir():
        from trnrecipes.data.manifest import read_manifest

        try:
            shards = [path / shard.file for shard in read_manifest(path).shards]
        except (DataError, OSError):  # said where it is opened
            shards = []
        for shard in shards:
            try:
                info = os.stat(shard)
            except OSError:
                continue
            found[info.st_dev, info.st_ino] = shard
    return found


def same_corpus(sources, root: Path) -> tuple[int, int] | None:
    """(i, j), i < j, where sources i and j hold the same file: one file under two names (a link, a hard link,
    another spelling of the path), or a shard directory and one of its shards. Each would be split with its own
    held-out documents, so what one holds out the other trains on."""
    seen: dict[tuple[int, int], int] = {}
    for j, source in enumerate(sources):
        files = _files(source, root)
        for key in files:
            if key in seen:
                return seen[key], j
        seen.update(dict.fromkeys(files, j))
    return None


def same_corpus_message(sources, i: int, j: int, root: Path) -> str:
    theirs, mine = _files(sources[i], root), _files(sources[j], root)
    shared = next((theirs[key] for key in mine if key in theirs), corpus_file(sources[i], root))
    whole = [corpus_file(s, root) for s in (sources[i], sources[j])]
    if os.path.samefile(*whole):  # the source itself, a file or a shard directory, under two names
        how, shared = "under another name", whole[0]
    elif whole[0].is_dir() != whole[1].is_dir():
        how = "in part (a shard directory and its shard)"
    else:
        how = "in part (they share a shard)"
    return (
        f"data.sources[{j}].path {sources[j].path} is data.sources[{i}].path {sources[i].path} {how} (the same file"
        f" {shared.resolve()}): each name would be split with its own held-out documents, so documents held out from"
        " one would be trained on from the other; give each corpus once, weighted"
    )


def eval_path_trains(data, root: Path) -> str | None:
    """A warning where data.eval_path (a classification holdout, eval.sbatch's accuracy) is a file the run trains
    on: its "holdout" accuracy would be measured on training documents."""
    if not data.eval_path:
        return None
    held = _files(DataSource(data.eval_path, 1.0, "arrow"), root)
    for i, source in enumerate(data.corpora()):
        if shared := [held[key] for key in _files(source, root) if key in held]:
            name = f"data.sources[{i}].path" if data.sources else "data.path"
            return (
                f"data.eval_path {data.eval_path} is {name} {source.path} (the same file {shared[0].resolve()}): the"
                " accuracy eval.sbatch reports would be measured on documents the run trains on; name a held-out file"
            )
    return None


def open_sources(data, root: Path, seed: int, vocab_size: int | None = None) -> tuple[list[OpenedSource], object]:
    """(every corpus of a recipe's data section, opened and split by `seed`; the tokenizer). `vocab_size`: the
    model's, which a stored token id must be below (Megatron files hold ids made elsewhere)."""
    from trnrecipes.data.pack import split_documents
    from trnrecipes.data.tokenizer import load_tokenizer

    if twice := same_corpus(data.corpora(), root):
        raise DataError(same_corpus_message(data.corpora(), *twice, root))
    tokenizer = load_tokenizer(data_path(data.tokenizer, root))
    opened = []
    for index, source in enumerate(data.corpora()):
        documents = open_documents(source.format, source.path, tokenizer, source.text_field, root, vocab_size)
        train, val = split_documents(documents.num_docs, data.val_fraction, seed, source=source.path, index=index)
        opened.append(OpenedSource(source.path, source.weight, documents, train, val))
    return opened, tokenizer


def data_stream(sources, part: str, seq_len: int, seed: int, dp_rank: int, dp: int, start=None):
    """The packed samples of `part` ("train" or "val") for one DP rank: one source's PackedStream, or the sources'
    streams blended by weight (BlendedStream), from `start` (a StreamPosition, or a BlendPosition for a blend)."""
    from trnrecipes.data.blend import BlendedStream
    from trnrecipes.data.pack import PackedStream

    if len(sources) == 1:
        return PackedStream(sources[0].documents, getattr(sources[0], part), seq_len, seed, dp_rank, dp, True, start)
    starts = start.sources if start is not None else [None] * len(sources)
    streams = [
        PackedStream(s.documents, getattr(s, part), seq_len, seed, dp_rank, dp, True, at, index=k)
        for k, (s, at) in enumerate(zip(sources, starts, strict=True))
    ]
    return BlendedStream(streams, [s.weight for s in sources], start.samples if start is not None else 0)


def open_corpus(fmt: str, path: str | Path, tokenizer_dir: str | Path, text_field: str, root: Path):
    """(documents, tokenizer) for one corpus; relative paths are taken from `root` (the repo)."""
    from trnrecipes.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(data_path(tokenizer_dir, root))
    return open_documents(fmt, path, tokenizer, text_field, root), tokenizer


def open_documents(fmt: str, path: str | Path, tokenizer, text_field: str, root: Path, vocab_size: int | None = None):
    """One corpus's documents, tokenized by `tokenizer` (Arrow) or as stored (Megatron .bin/.idx, whose ids must be
    below `vocab_size` where given)."""
    if fmt == "arrow":
        from trnrecipes.data.arrow import ArrowDocuments

        return ArrowDocuments(data_path(path, root), tokenizer, text_field)
    if fmt == "megatron":
        from trnrecipes.data.indexed import IndexedDocuments

        return IndexedDocuments(data_path(path, root), vocab_size)
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
