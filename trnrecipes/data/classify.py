"""Labelled text (an Arrow file with a text and an integer label column) -> fixed-shape classification samples.

A sample is one document: [CLS] text [SEP] (where the tokenizer has those specials; BERT's do), cut to seq_len
tokens and padded with the pad id, then its label: seq_len + 1 int64 values, the same shape as a language-model
sample, so batching, prefetching, the backends' loaders and the data position in checkpoints are shared with the
LLM path. Static shapes: every batch is [micro_batch, seq_len + 1] however long the texts are (XLA compiles one
graph). The attention mask is `tokens != pad_id`: a tokenizer never emits the pad id for text.

Data-parallel ranks read disjoint slices of each epoch's seeded order (PackedStream.order), one sample per
document, and the position after each sample (epoch, document) lets training resume exactly where it stopped.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa

from trnrecipes.data import DataError, listed
from trnrecipes.data.arrow import read_naming_bad_row, read_table
from trnrecipes.data.pack import TOKENIZE_BLOCK, PackedStream, StreamPosition


def encode_texts(tokenizer, texts: list[str], seq_len: int, pad_id: int) -> np.ndarray:
    """[len(texts), seq_len] int64: each text as [CLS] ids [SEP] (the specials the tokenizer has), cut to fit and
    padded with `pad_id`. The same for training, validation, predict and embed."""
    head = [tokenizer.cls_id] if tokenizer.cls_id is not None else []
    tail = [tokenizer.sep_id] if tokenizer.sep_id is not None else []
    room = seq_len - len(head) - len(tail)
    if room < 1:
        raise DataError(f"batch.seq_len {seq_len} leaves no room for text between the [CLS] and [SEP] tokens")
    out = np.full((len(texts), seq_len), pad_id, dtype=np.int64)
    for row, ids in enumerate(tokenizer.encode_batch(texts)):
        ids = np.concatenate([head, ids[:room], tail]).astype(np.int64)
        out[row, : len(ids)] = ids
    return out


def attention_mask(tokens, pad_id: int):
    """1 where a token is text or a special, 0 on padding (numpy or torch, whichever `tokens` is)."""
    return tokens != pad_id


def read_labels(path: Path, label_field: str, num_labels: int) -> np.ndarray:
    """The label column of an Arrow file as int64, every value checked to be a class id in [0, num_labels); a bool
    column is read as 0/1, as to-arrow and predict read bool labels (trnrecipes.data.arrow.class_id)."""
    table = read_table(path)
    if label_field not in table.schema.names:
        raise DataError(
            f"{path} has no label column {label_field!r} (data.label_field); its columns: {listed(table.schema.names)}"
        )
    column = table.column(label_field)
    if pa.types.is_boolean(column.type):
        column = column.cast(pa.int64())
    if not pa.types.is_integer(column.type):
        raise DataError(
            f"{path}: column {label_field!r} holds {column.type}, not integer class ids; `trnrecipes data to-arrow"
            " --label-field` writes them"
        )
    if column.null_count:
        first = column.is_null().to_numpy(zero_copy_only=False).argmax()
        raise DataError(f"{path}: {column.null_count} row(s) have no {label_field!r} (the first: row {first})")
    labels = column.to_numpy()  # checked before the cast to int64, which would wrap a uint64 beyond it
    bad = np.flatnonzero((labels < 0) | (labels >= num_labels))
    if len(bad):
        raise DataError(
            f"{path}: row {bad[0]} has {label_field} {labels[bad[0]]}, outside [0, {num_labels}) (model.num_labels"
            f" {num_labels}); {len(bad)} row(s) in all"
        )
    return labels.astype(np.int64)


class LabelledDocuments:
    """The documents of an Arrow file with a text and a label column, as classification samples (tokenized on
    demand, like ArrowDocuments)."""

    def __init__(
        self, path: Path, tokenizer, *, text_field: str, label_field: str, num_labels: int, seq_len: int, pad_id: int
    ):
        from trnrecipes.data.arrow import ArrowTexts

        self.path, self.tokenizer, self.seq_len, self.pad_id = Path(path), tokenizer, seq_len, pad_id
        self.texts = ArrowTexts(self.path, text_field)
        self.labels = read_labels(self.path, label_field, num_labels)
        self.num_docs = len(self.texts)

    def samples(self, doc_ids: Sequence[int]) -> np.ndarray:
        """[len(doc_ids), seq_len + 1]: the padded tokens, then the label."""
        tokens = read_naming_bad_row(self.path, list(doc_ids), self._tokens)
        return np.concatenate([tokens, self.labels[np.asarray(doc_ids, dtype=np.int64)][:, None]], axis=1)

    def _tokens(self, doc_ids: Sequence[int]) -> np.ndarray:
        texts = self.texts.take(list(doc_ids))
        return encode_texts(self.tokenizer, texts, self.seq_len, self.pad_id)

    def class_counts(self, doc_ids: Sequence[int]) -> np.ndarray:
        return np.bincount(self.labels[np.asarray(doc_ids, dtype=np.int64)], minlength=int(self.labels.max()) + 1)


class ClassificationStream(PackedStream):
    """One sample per document, in PackedStream's seeded per-epoch order split over DP ranks, forever."""

    def __init__(self, source: LabelledDocuments, doc_ids: np.ndarray, *args, **kwargs):
        super().__init__(source, doc_ids, source.seq_len, *args, **kwargs)

    def __iter__(self) -> Iterator[tuple[np.ndarray, StreamPosition]]:
        """(sample [seq_len + 1] int64, position after it)."""
        epoch, doc, samples = self.start.epoch, self.start.doc, self.start.samples
        while True:
            order = self.order(epoch)  # evaluated per block (order.py)
            for block in range(doc, len(order), TOKENIZE_BLOCK):
                ids = order[block : block + TOKENIZE_BLOCK]
                for i, sample in enumerate(self.source.samples(ids.tolist())):
                    samples += 1
                    after = (epoch, block + i + 1) if block + i + 1 < len(order) else (epoch + 1, 0)
                    yield sample, StreamPosition(*after, 0, samples)
            epoch, doc = epoch + 1, 0
