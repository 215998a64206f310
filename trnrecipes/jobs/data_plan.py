"""What the run reads of each corpus over train.max_steps: its share of the samples (data.sources' weights, or all
of data.path), the tokens that is, and how many epochs of it, for `plan` and `sbatch`.

A corpus's size in tokens: a Megatron .bin holds exactly its tokens (its size / the token width in the .idx header);
an Arrow corpus is tokenized online, so its tokens are estimated from its text bytes and a tokenized sample of 256
documents spread over the file (with pyarrow and tokenizers installed; with only the core install, at 4 bytes a
token), and printed with a ~. Only the files' metadata and those 256 documents are read: seconds for a TB corpus.
"""

from __future__ import annotations

import importlib.util
import struct
from dataclasses import dataclass
from pathlib import Path

from trnrecipes.config.families import family_spec
from trnrecipes.config.sections import Recipe
from trnrecipes.data import DataError
from trnrecipes.data.holdout import held_out
from trnrecipes.data.sources import data_path
from trnrecipes.plan.report import si

SAMPLE_DOCS = 256
BYTES_PER_TOKEN = 4.0  # without a tokenizer at hand: about what BPE tokenizers give on English text
MEGATRON_ITEMSIZE = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}  # megatron-core's DType codes -> bytes


@dataclass(frozen=True)
class SourcePlan:
    path: str
    share: float  # of the training samples
    samples: int  # over train.max_steps
    tokens: int  # read from it over train.max_steps (samples x (seq_len + 1))
    corpus_tokens: float | None  # in its training split; None when the file cannot be read from here
    exact: bool  # counted (Megatron without a validation split), not estimated
    looked: bool = True  # False: --no-data-check, no file read
    # Classification reads one document a sample, whatever its tokens: its epochs count documents (those in its
    # training split; None when they cannot be counted from here).
    documents: int | None = None
    classify: bool = False

    @property
    def epochs(self) -> float | None:
        if self.classify:
            return self.samples / self.documents if self.documents else None
        return self.tokens / self.corpus_tokens if self.corpus_tokens else None

    def to_dict(self) -> dict:
        return {**self.__dict__, "epochs": self.epochs}


def data_plan(recipe: Recipe, repo_root: Path, look: bool = True) -> list[SourcePlan]:
    """Each corpus's share, tokens and epochs over train.max_steps; `look` False: no file is read (no epochs)."""
    d, b = recipe.data, recipe.batch
    sources = d.corpora()
    total_weight = sum(s.weight for s in sources)
    all_samples = recipe.train.max_steps * b.global_batch
    classify = family_spec(recipe.model.family).objective == "classification"
    plans = []
    for s in sources:
        share = s.weight / total_weight
        samples = round(all_samples * share)
        size = _corpus_tokens(s, d.tokenizer, repo_root) if look and not classify else None
        corpus = size[0] * (1 - d.val_fraction) if size else None
        exact = bool(size and size[1]) and d.val_fraction == 0  # the split holds out documents, not tokens
        documents = _training_documents(s, d.val_fraction, repo_root) if look and classify else None
        tokens = samples * (b.seq_len + 1)
        plans.append(SourcePlan(s.path, share, samples, tokens, corpus, exact, look, documents, classify))
    return plans


def _training_documents(source, val_fraction: float, repo_root: Path) -> int | None:
    """The documents of an Arrow corpus's training split (a shard directory's from its manifest), or None."""
    full = data_path(source.path, repo_root)
    try:
        if full.is_dir():
            from trnrecipes.data.manifest import read_manifest

            count = read_manifest(full).rows
        elif importlib.util.find_spec("pyarrow") is not None and full.is_file():
            from trnrecipes.data.arrow import ArrowTexts

            count = len(ArrowTexts(full, source.text_field))
        else:
            return None
    except (OSError, ValueError, DataError):
        return None
    return count - held_out(count, val_fraction)


MANY_EPOCHS = 10  # more passes over a corpus than this in one run: a warning (memorised, not learned)


def epoch_warnings(plans: list[SourcePlan], recipe: Recipe) -> list[str]:
    """A warning for each corpus the run would read more than MANY_EPOCHS times over train.max_steps."""
    out = []
    for p in plans:
        epochs = p.epochs
        if epochs is not None and epochs > MANY_EPOCHS:
            fewer = max(1, int(recipe.train.max_steps * MANY_EPOCHS / epochs))
            size = (
                f"{p.documents:,} documents" if p.classify else f"{'' if p.exact else '~'}{si(p.corpus_tokens)} tokens"
            )
            out.append(
                f"{p.path}: train.max_steps {recipe.train.max_steps:,} reads it {epochs:,.1f} times (its training split"
                f" is {size}): the model would memorise it. Use a bigger corpus"
                f"{', a smaller weight' if len(plans) > 1 else ''}, or train.max_steps <= {fewer:,} for"
                f" {MANY_EPOCHS} epochs"
            )
    return out


def format_data_plan(plans: list[SourcePlan], max_steps: int, width: int = 11) -> list[str]:
    """Lines in the plan summary's column: one per corpus."""
    head = f"{'data':<{width}}  " + (
        f"{len(plans)} sources blended by weight over {max_steps:,} steps"
        if len(plans) > 1
        else f"over {max_steps:,} steps"
    )
    lines = [head]
    for p in plans:
        if not p.looked:
            epochs = "epochs not looked up (--no-data-check)"
        elif p.epochs is None and p.classify:
            epochs = "epochs unknown (its documents cannot be counted from here: pyarrow, or the file, is missing)"
        elif p.epochs is None:
            epochs = "epochs unknown (the corpus or tokenizer cannot be read from here; sbatch's data check says why)"
        elif p.classify:
            epochs = f"{p.epochs:,.2f} epochs of {p.documents:,} documents (a sample each)"
        else:
            about = "" if p.exact else "~"
            epochs = f"{about}{p.epochs:,.2f} epochs of {about}{si(p.corpus_tokens)} tokens"
        read = f"{p.samples:>14,} samples" if p.classify else f"{p.tokens:>14,} tokens"
        lines.append(f"{'':<{width}}  {p.share:6.1%}  {read}  {epochs}  {p.path}")
    return lines


def _corpus_tokens(source, tokenizer: str, repo_root: Path) -> tuple[float, bool] | None:
    """(tokens, exact) of one corpus, or None if it cannot be read from here."""
    full = data_path(source.path, repo_root)
    try:
        if source.format == "megatron":
            with open(f"{full}.idx", "rb") as f:
                header = f.read(18)
            itemsize = MEGATRON_ITEMSIZE.get(struct.unpack("<B", header[17:18])[0]) if len(header) == 18 else None
            size = Path(f"{full}.bin").stat().st_size
            return (size / itemsize, True) if itemsize else None
        if not (full.is_file() or full.is_dir()):  # a shard directory's manifest gives its text bytes
            return None
        return _arrow_tokens(full, source.text_field, data_path(tokenizer, repo_root))
    except (OSError, ValueError):
        return None


def _arrow_tokens(path: Path, text_field: str, tokenizer_dir: Path) -> tuple[float, bool] | None:
    if importlib.util.find_spec("pyarrow") is None:
        return _arrow_bytes(path) / BYTES_PER_TOKEN, False
    from trnrecipes.data.arrow import ArrowTexts

    try:
        texts = ArrowTexts(path, text_field)
    except DataError:
        return None  # sbatch's data check says why
    n = len(texts)
    text_bytes = texts.text_bytes()
    if n == 0:
        return None
    bytes_per_token = BYTES_PER_TOKEN
    if importlib.util.find_spec("tokenizers") is not None and (tokenizer_dir / "tokenizer.json").is_file():
        from trnrecipes.data.tokenizer import load_tokenizer

        rows = sorted({i * n // SAMPLE_DOCS for i in range(min(n, SAMPLE_DOCS))})
        sample = texts.take(rows)
        ids = load_tokenizer(tokenizer_dir).encode_batch(sample)
        sampled_bytes, sampled_tokens = sum(len(t.encode()) for t in sample), sum(len(i) for i in ids)
        if sampled_tokens:
            bytes_per_token = sampled_bytes / sampled_tokens
    return text_bytes / bytes_per_token + n, False  # + one EOS per document


def _arrow_bytes(path: Path) -> int:
    """An Arrow corpus's size on disk: the file's, or the shards' a shard directory lists."""
    if not path.is_dir():
        return path.stat().st_size
    from trnrecipes.data.manifest import read_manifest

    return sum((path / shard.file).stat().st_size for shard in read_manifest(path).shards)
