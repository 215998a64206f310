"""What a corpus holds, checked before a job is submitted (sbatch), by the pre-flight (doctor) and by plan: enough
documents for the split and the data-parallel ranks, text in every row, token ids the model's embedding has, and
no corpus of a blend twice under two names. Each finding is one line naming the file and what would be valid.

Only file metadata is read: Megatron's .idx header, Arrow's record batch headers (with pyarrow; without it, one
line says the corpus was not checked), and a .bin of at most SCAN_BIN_BYTES scanned for its largest token id where
no tokenizer record says it (with numpy). Torch-free.
"""

from __future__ import annotations

import importlib.util
import math
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

from trnrecipes.config.families import family_spec
from trnrecipes.config.sections import Recipe
from trnrecipes.data.holdout import fewest_documents, held_out
from trnrecipes.data.sources import data_path, same_corpus, same_corpus_message
from trnrecipes.data.tokenized_with import tokenized_with
from trnrecipes.jobs.data_check import MEGATRON_IDX_MAGIC, check_corpus_file
from trnrecipes.plan.layout import compute_layout

SCAN_BIN_BYTES = 2 * 10**9  # a .bin without a tokenizer record is scanned for its largest id up to this size
CHECK_NOTICE_BYTES = 1 << 30  # say what is being checked for files larger than this (seconds per TB)
# megatron-core's DType codes -> (numpy dtype name, bytes)
MEGATRON_DTYPES = {1: ("uint8", 1), 2: ("int8", 1), 3: ("int16", 2), 4: ("int32", 4), 5: ("int64", 8),
                   6: ("float64", 8), 7: ("float32", 4), 8: ("uint16", 2)}  # fmt: skip
MEGATRON_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document indices


@dataclass(frozen=True)
class MegatronHeader:
    dtype: str  # numpy dtype name of the token ids
    itemsize: int
    sequences: int
    documents: int  # megatron-core stores one more document index than documents


def megatron_header(idx: Path) -> MegatronHeader | str | None:
    """The .idx header megatron-core's IndexedDatasetBuilder writes, or what is wrong with it (None: not a Megatron
    index at all, which data_check says)."""
    size = idx.stat().st_size
    with open(idx, "rb") as f:
        raw = f.read(MEGATRON_HEADER.size)
    if not raw.startswith(MEGATRON_IDX_MAGIC):
        return None
    if len(raw) < MEGATRON_HEADER.size:
        return f"{idx} is truncated: {size} bytes, less than the {MEGATRON_HEADER.size} of its header"
    _, _, code, sequences, doc_indices = MEGATRON_HEADER.unpack(raw)
    if code not in MEGATRON_DTYPES or MEGATRON_DTYPES[code][0].startswith("float"):
        return f"{idx}: dtype code {code} is not one of the integer token dtypes megatron-core writes"
    need = MEGATRON_HEADER.size + 12 * sequences + 8 * doc_indices  # lengths int32, pointers int64, documents int64
    if doc_indices < 1 or size < need:
        return f"{idx} is truncated: {size:,} bytes, but its {sequences:,} sequences and documents need {need:,}"
    return MegatronHeader(*MEGATRON_DTYPES[code], sequences, doc_indices - 1)


def corpus_problems(recipe: Recipe, repo_root: Path, scan: bool = True) -> tuple[list[str], list[str]]:
    """(problems, notes): what would fail the run after its allocation, and what could not be checked from here.
    Files that are missing or unreadable are left to data_check, which names them. `scan` False: no .bin is read
    for its token ids (the pre-flight on each node leaves that to sbatch and to training)."""
    d = recipe.data
    dp = compute_layout(recipe).dp
    sources = d.corpora()
    problems, notes = [], []
    if twice := same_corpus(sources, repo_root):
        problems.append(same_corpus_message(sources, *twice, repo_root))
    for i, s in enumerate(sources):
        label = f"data.sources[{i}].path {s.path}" if d.sources else f"data.path {s.path}"
        full = data_path(s.path, repo_root)
        if check_corpus_file(label, s.path, s.format, d.tokenizer, repo_root):  # missing, unreadable: said there
            continue
        try:
            count = _documents(s, full, label, recipe, problems, notes, scan)
        except OSError as err:
            problems.append(f"{label}: cannot be read ({err.strerror or err})")
            continue
        if count is not None:
            problems += _count_problems(label, count, recipe, dp)
            problems += _label_problems(label, full, recipe)
    if d.eval_path:
        label = f"data.eval_path {d.eval_path}"
        full = data_path(d.eval_path, repo_root)
        if not check_corpus_file(label, d.eval_path, "arrow", d.tokenizer, repo_root):
            if _arrow_documents(full, d.text_field, label, problems, notes) is not None:
                problems += _label_problems(label, full, recipe)
    return problems, notes


def _label_problems(label: str, path: Path, recipe: Recipe) -> list[str]:
    """A classification corpus's labels, as the trainer (and eval.sbatch's holdout accuracy) reads them: one Arrow
    file with an integer class-id column whose every value is below model.num_labels."""
    if family_spec(recipe.model.family).objective != "classification":
        return []
    if path.is_dir():
        return [
            f"{label}: {path} is a shard directory; a classification corpus is one Arrow file (its labels are read"
            " whole): convert it again without --shard-bytes"
        ]
    from trnrecipes.data import DataError
    from trnrecipes.data.classify import read_labels

    try:
        read_labels(path, recipe.data.label_field, recipe.model.num_labels)
    except DataError as err:
        said = str(err)
        return [f"{label}: {said[len(str(path)) :].lstrip(': ') if said.startswith(str(path)) else said}"]
    return []


def _documents(
    s, full: Path, label: str, recipe: Recipe, problems: list[str], notes: list[str], scan: bool
) -> int | None:
    if s.format == "megatron":
        header = megatron_header(Path(f"{full}.idx"))
        if not isinstance(header, MegatronHeader):
            problems += [f"{label}: {header}; re-make it with `trnrecipes data preprocess`"] if header else []
            return None
        size = Path(f"{full}.bin").stat().st_size
        if size % header.itemsize:
            problems.append(f"{label}: {full}.bin holds {size:,} bytes, not a whole number of {header.dtype} ids")
            return None
        problems += _token_id_problems(label, full, header, recipe.model.vocab_size, notes, scan)
        return header.documents
    return _arrow_documents(full, s.text_field, label, problems, notes)


def _arrow_documents(path: Path, text_field: str, label: str, problems: list[str], notes: list[str]) -> int | None:
    """Rows of an Arrow corpus, with its text column checked (present, text, no nulls); None if not known."""
    if importlib.util.find_spec("pyarrow") is None:
        notes.append(f"{label}: its documents not checked (pyarrow is not installed here; the pre-flight checks them)")
        return None
    from trnrecipes.data import DataError
    from trnrecipes.data.arrow import ArrowTexts

    if path.is_dir() or path.stat().st_size > CHECK_NOTICE_BYTES:  # a walk over every record batch's header
        print(f"[trnrecipes] checking {path}'s documents ...", file=sys.stderr, flush=True)
    try:
        texts = ArrowTexts(path, text_field)
        texts.check()  # every shard of a shard directory: its text column, and the rows its manifest says
        return len(texts)
    except DataError as err:
        problems.append(f"{label}: {str(err).removeprefix(f'{path}: ')}")
        return None


def _count_problems(label: str, count: int, recipe: Recipe, dp: int) -> list[str]:
    """Enough documents: after the validation split, one to train on per data-parallel rank, and one to validate
    on when validation is on (data.val_fraction > 0); under FSDP one to validate on per rank too."""
    f = recipe.data.val_fraction
    val = held_out(count, f)
    train, need = count - val, fewest_documents(dp, f)
    if count == 0:
        return [f"{label}: has no documents; a corpus needs at least {need} at this layout"]
    if train < dp:
        split = f"; data.val_fraction {f} holds out {val} for validation, leaving {train} to train on" if f else ""
        return [
            f"{label}: {count} document(s){split}, but each of the {dp} data-parallel ranks reads its own: it needs"
            f" at least {need} documents" + (" (or data.val_fraction=0)" if f and count >= dp else "")
        ]
    if recipe.layout.fsdp and 0 < val < dp:  # FSDP's forward gathers over DP: every rank runs validation
        return [
            f"{label}: data.val_fraction {f} holds out {val} validation document(s) for {dp} data-parallel ranks;"
            " under layout.fsdp each rank needs one: raise data.val_fraction"
        ]
    if val and family_spec(recipe.model.family).objective == "classification":  # the trainer's rule (train/loop.py)
        val_dp = min(dp, val)  # one sample a document: batches past the documents would count some twice
        per_rank, wanted = val // val_dp, recipe.train.val_batches * recipe.batch.micro_batch
        if wanted > per_rank:
            return [
                f"{label}: train.val_batches {recipe.train.val_batches} x batch.micro_batch {recipe.batch.micro_batch}"
                f" = {wanted} validation examples per data-parallel rank, but data.val_fraction {f} holds out {val}"
                f" of its {count:,} documents, {per_rank} for each of {val_dp} rank(s): {_enough(wanted * dp, count)}"
            ]
    return []


def _enough(documents: int, count: int) -> str:
    """What holds out `documents` of `count` (every rank's share, once there are as many as ranks): the smallest
    data.val_fraction that does (to 4 places), else a larger corpus; or fewer validation batches."""
    fraction = math.ceil(documents / count * 10_000) / 10_000 if count else 1.0
    while fraction < 1 and held_out(count, fraction) < documents:
        fraction = round(fraction + 0.0001, 4)
    more = f"raise data.val_fraction to {fraction:g}" if fraction < 1 else "use a larger corpus"
    return f"{more}, or lower train.val_batches"


def _token_id_problems(
    label: str, prefix: Path, header: MegatronHeader, vocab: int, notes: list[str], scan: bool
) -> list[str]:
    """Token ids at or above model.vocab_size (or below 0) would index past the embedding on every rank: from the
    tokenizer record `data preprocess` writes, else by scanning a .bin of at most SCAN_BIN_BYTES."""
    record = tokenized_with(prefix)
    top = record.get("max_token_id") if record else None
    how = "as its tokenizer record says"
    bin_path = Path(f"{prefix}.bin")
    if not isinstance(top, int) or isinstance(top, bool):
        if record is not None or not scan:  # made by data.tokenizer (data_check refuses another one): its ids fit
            return []
        size = bin_path.stat().st_size
        if size > SCAN_BIN_BYTES:
            notes.append(
                f"{label}: token ids not checked against model.vocab_size ({size / 1e9:.0f} GB .bin without a"
                " tokenizer record; training refuses the first document with an id past the vocabulary)"
            )
            return []
        if importlib.util.find_spec("numpy") is None:
            notes.append(f"{label}: token ids not checked against model.vocab_size (numpy is not installed here)")
            return []
        if size > CHECK_NOTICE_BYTES:
            print(f"[trnrecipes] reading {bin_path}'s token ids ...", file=sys.stderr, flush=True)
        low, top = _id_range(bin_path, header)
        how = "found in it"
        if low is not None and low < 0:
            return [f"{label}: token id {low:,} in {bin_path}: negative ids are not token ids; corrupt?"]
    if top is None or top < vocab:
        return []
    return [
        f"{label}: token id {top:,} ({how}) is at or above model.vocab_size {vocab:,}: made by another tokenizer than"
        f" this model's? Re-make it with `trnrecipes data preprocess --tokenizer <this model's tokenizer>` or set"
        f" model.vocab_size above {top:,}"
    ]


def _id_range(bin_path: Path, header: MegatronHeader) -> tuple[int | None, int | None]:
    """(smallest, largest) token id in a .bin, read 64M ids at a time (bounded memory, whatever the file)."""
    import numpy as np

    tokens = np.memmap(bin_path, dtype=header.dtype, mode="r") if bin_path.stat().st_size else np.empty(0)
    step = 1 << 26
    parts = [(int(tokens[i : i + step].min()), int(tokens[i : i + step].max())) for i in range(0, len(tokens), step)]
    return (min(p[0] for p in parts), max(p[1] for p in parts)) if parts else (None, None)
