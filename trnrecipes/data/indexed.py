"""Megatron / NeMo .bin/.idx token files, written and read with megatron-core's IndexedDataset (the NeoX/Pythia on
Trainium post).

`preprocess` writes one sequence per document, EOS appended (Megatron's preprocess_data.py --append-eod), so the
reader uses documents as stored. Documents made of several sequences (sentence-split data) are concatenated.
"""

from __future__ import annotations

import os
import struct
import sys
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from trnrecipes.data.arrow import ConversionStats, DataError, no_documents, read_documents, rejects_listed
from trnrecipes.data.bad_records import BadRecords, rejects_of
from trnrecipes.data.inputs import InputFile
from trnrecipes.data.megatron_files import replace_pair
from trnrecipes.data.tokenized_with import TOKENIZED_WITH, write_tokenized_with
from trnrecipes.schema import clipped

DTYPES = {"uint16": np.uint16, "int32": np.int32}


def _megatron():
    # megatron.core's package import warns about missing Apex / Transformer Engine, irrelevant to token files.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            from megatron.core.datasets import indexed_dataset
        except ModuleNotFoundError as err:  # a login-node install (pyproject's login extra) has neither
            missing = "megatron-core" if (err.name or "").startswith("megatron") else err.name
            raise DataError(
                f"Megatron .bin/.idx files are written and read with megatron-core, which imports torch: {missing} is"
                f" not installed in {sys.executable}. Run this with the job's Python (srun on a node: its venv has"
                " requirements/neuron.txt) or the full install (make setup with Python 3.11+), or use an Arrow corpus"
                " instead (`trnrecipes data to-arrow`; training tokenizes it)"
            ) from None
    return indexed_dataset


def token_dtype(vocab_size: int, requested: str = "auto") -> type[np.number]:
    if requested == "auto":
        return np.uint16 if vocab_size <= 65536 else np.int32
    if requested not in DTYPES:
        raise DataError(f"token dtype {requested!r} is not one of: auto, {', '.join(DTYPES)}")
    dtype = DTYPES[requested]
    if vocab_size - 1 > np.iinfo(dtype).max:
        raise DataError(
            f"the tokenizer's vocabulary ({vocab_size} ids) does not fit in {requested}"
            f" (max id {np.iinfo(dtype).max}); use int32 or auto"
        )
    return dtype


def preprocess(
    inputs: Sequence[str | Path | InputFile],
    tokenizer,
    out_prefix: Path,
    text_field: str = "text",
    dtype: str = "auto",
    on_bad_record: str = "error",
    progress: bool = True,
    block: int = 256,
    max_bad_records: int | None = None,
    split: str | None = None,
) -> tuple[ConversionStats, int]:
    """Tokenize every document of `inputs` into out_prefix.bin/.idx. Returns (stats, tokens written). Bad records
    as to_arrow's, the skipped ones listed in out_prefix.rejects.jsonl; nothing is left under the final names unless
    every file is complete."""
    indexed_dataset = _megatron()
    np_dtype = token_dtype(tokenizer.vocab_size, dtype)
    stats, total, top = ConversionStats(), 0, -1
    bad = BadRecords(on_bad_record, max_bad_records, rejects_of(out_prefix))
    docs = read_documents(inputs, text_field, bad, progress, split)
    out_prefix = Path(out_prefix)
    out_prefix.parent.mkdir(parents=True, exist_ok=True)
    tmp_prefix = out_prefix.with_name(f".{out_prefix.name}.tmp{os.getpid()}")
    builder = indexed_dataset.IndexedDatasetBuilder(f"{tmp_prefix}.bin", dtype=np_dtype)
    try:
        with rejects_listed(bad):
            for texts in _blocks(docs, block, stats):
                for ids in tokenizer.encode_batch(texts):
                    doc = np.append(ids, tokenizer.eos_id)
                    builder.add_document(doc, [len(doc)])  # numpy is fine: it calls numpy.array(doc, dtype)
                    top = max(top, int(doc.max()))
                    total += len(doc)
                    stats.documents += 1
            builder.finalize(f"{tmp_prefix}.idx")
            stats.rejected = bad.count
            if stats.documents == 0:
                raise no_documents(inputs, stats, bad)
            # sbatch refuses a blend of other tokenizers' ids, and ids past model.vocab_size
            write_tokenized_with(tmp_prefix, tokenizer.path, max_token_id=top)
            replace_pair(tmp_prefix, out_prefix, (TOKENIZED_WITH,))
    finally:
        for suffix in (".bin", ".idx", TOKENIZED_WITH):
            if os.path.exists(f"{tmp_prefix}{suffix}"):
                os.unlink(f"{tmp_prefix}{suffix}")
    return stats, total


def _blocks(docs: Iterator[str], size: int, stats: ConversionStats) -> Iterator[list[str]]:
    block: list[str] = []
    for text in docs:
        if not text.strip():
            stats.skipped_empty += 1
            continue
        block.append(text)
        if len(block) == size:
            yield block
            block = []
    if block:
        yield block


class IndexedDocuments:
    """Pre-tokenized documents of a .bin/.idx pair, memory-mapped by megatron-core."""

    def __init__(self, prefix: Path, vocab_size: int | None = None):
        prefix = Path(prefix)
        self.vocab_size = vocab_size  # a stored id at or above it is refused when its document is read
        for suffix in (".bin", ".idx"):
            if not Path(f"{prefix}{suffix}").is_file():
                raise DataError(
                    f"Megatron data {prefix}{suffix} does not exist (`trnrecipes data preprocess` makes it)"
                )
        self.path = prefix
        megatron = _megatron()

        class Dataset(megatron.IndexedDataset):
            def __del__(self):  # megatron's raises (printing a traceback) for a dataset whose files did not open
                self.__dict__.pop("bin_reader", None)
                self.__dict__.pop("index", None)

        try:
            if Path(f"{prefix}.bin").stat().st_size == 0:  # megatron's reader fails on it with noise
                raise ValueError("the .bin file is empty")
            self.dataset = Dataset(str(prefix))
        except (AssertionError, ValueError, OSError, struct.error) as err:
            raise DataError(
                f"Megatron data {prefix}.bin/.idx: not readable ({clipped(err)}); corrupt or truncated?"
                " `trnrecipes data preprocess` writes them"
            ) from None
        self.doc_starts = np.asarray(self.dataset.document_indices)
        self.num_docs = len(self.doc_starts) - 1

    def tokens(self, doc_ids: list[int]) -> list[np.ndarray]:
        out = []
        for d in doc_ids:
            first, last = int(self.doc_starts[d]), int(self.doc_starts[d + 1])
            seqs = [self.dataset[i] for i in range(first, last)]
            ids = np.concatenate(seqs).astype(np.int64) if seqs else np.empty(0, np.int64)
            if self.vocab_size is not None and ids.size and int(ids.max()) >= self.vocab_size:
                # On the host, before the embedding: on a device the lookup would fail on every rank, or read past
                # the table, and the job would be taken for a node failure.
                raise DataError(
                    f"{self.path}.bin: document {d} holds token id {int(ids.max()):,}, at or above model.vocab_size"
                    f" {self.vocab_size:,}: made by another tokenizer? Re-make it with `trnrecipes data preprocess`"
                    " and this model's tokenizer"
                )
            out.append(ids)
        return out
