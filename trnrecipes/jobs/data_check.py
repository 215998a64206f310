"""Before any node is allocated: the recipe's corpus and tokenizer exist where the job will read them, are what the
recipe says they are, and the tokenizer's vocabulary fits the model's embedding.

`trnrecipes sbatch` refuses a job whose data fails this (`--no-data-check` skips it on a host that cannot see the
cluster's file system); `trnrecipes plan` prints the same findings as warnings. Light: file magic and tokenizer.json
read as JSON (and a shard directory's manifest), no pyarrow or tokenizers needed (the render host may have only the
core install). Each finding is one
line naming the path, what is wrong, and the command that makes the file.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

from trnrecipes.config.families import family_spec
from trnrecipes.config.saved_recipe import init_from_problem
from trnrecipes.config.sections import Recipe, RecipeError
from trnrecipes.data import DataError, listed
from trnrecipes.data.arrow_marks import ARROW_FILE_MAGIC, ARROW_STREAM_MARKER, CUT_SHORT, stream_cut_short
from trnrecipes.data.inputs import ABOUT_A_DATASET, input_stem, kind_of, passed_over, splits_held
from trnrecipes.data.manifest import MANIFEST, read_manifest
from trnrecipes.data.sources import data_path
from trnrecipes.data.tokenized_with import tokenized_with, tokenizer_fingerprint
from trnrecipes.files.reach import blocked
from trnrecipes.schema import shell_word as _q  # a path in a command to paste: one shell word

TO_ARROW = "`trnrecipes data to-arrow"  # the start of each command below that converts a corpus

MEGATRON_IDX_MAGIC = b"MMIDIDX\x00\x00"  # megatron-core's IndexedDataset .idx header
BRING_YOUR_DATA = "docs/data.md, 'Bring your data'"
# Raw corpora by their first bytes: what `data to-arrow` reads (or will), named when a recipe points at one.
RAW_KINDS = ((b"PAR1", "Parquet"), (b"\x1f\x8b", "gzip-compressed (.jsonl.gz?)"),
             (b"\x28\xb5\x2f\xfd", "zstd-compressed (.jsonl.zst?)"))  # fmt: skip
# What `make setup` prepares offline (trnrecipes.data.demo and .corpora; a test holds these to their lists).
DEMO_FILES = ("data/demo/pythondocs.arrow", "data/tokenizers/gpt2", "data/tokenizers/demo-sp")
CLASSIFICATION_FILES = (
    "data/cls/imdb.arrow",
    "data/cls/rotten-tomatoes.arrow",
    "data/cls/amazon-snippets.arrow",
    "data/cls/bbc-news.arrow",
    "data/tokenizers/bert-uncased",
)


def _made_by(path: str, kind: str, tokenizer: str = "<tokenizer dir>", full: Path | None = None) -> str:
    """The command that makes a missing corpus or tokenizer (`path` as the recipe names it; the command names
    `full`, where the job looks: a relative path is the repository's, not the user's working directory's)."""
    where = full or path
    if path.rstrip("/") in DEMO_FILES:
        return "`make setup` (or `trnrecipes data prepare-demo`) makes it"
    if path.rstrip("/") in CLASSIFICATION_FILES:
        return "`make setup` (or `trnrecipes data prepare-classification`) makes it"
    if kind == "arrow":
        return (
            f"make it with `trnrecipes data to-arrow --in <your .jsonl(.gz/.zst)/.parquet files or folders, or a"
            f" datasets save_to_disk dir> --out {_q(where)}` ({BRING_YOUR_DATA})"
        )
    if kind == "megatron":
        return (
            f"make it with `trnrecipes data preprocess --in <your text> --tokenizer {_q(tokenizer)} --out {_q(where)}`"
            f" ({BRING_YOUR_DATA})"
        )
    if path.rstrip("/").endswith("llama2"):
        return (
            "Llama 2's tokenizer is gated on the Hugging Face Hub: download meta-llama/Llama-2-7b-hf's tokenizer.json"
            f" and tokenizer_config.json where you have access and copy them into {where} ({BRING_YOUR_DATA})"
        )
    return (
        f"put a Hugging Face tokenizer directory (tokenizer.json, tokenizer_config.json) there, or make one with"
        f" `trnrecipes tokenizer from-gpt2` / `trnrecipes tokenizer train` ({BRING_YOUR_DATA})"
    )


def _sniff_arrow(path: Path) -> str | None:
    """Why `path` is not an Arrow IPC file or stream, or None."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError as err:
        return f"cannot be read ({err.strerror or err})"
    if head.startswith(ARROW_STREAM_MARKER) and stream_cut_short(path):
        return f"is {CUT_SHORT}"
    if head.startswith(ARROW_FILE_MAGIC) or head.startswith(ARROW_STREAM_MARKER):
        return None
    if head.startswith(MEGATRON_IDX_MAGIC) or (path.suffix == ".bin" and _megatron_pair(path.with_suffix(""))):
        return f"is a Megatron {'index' if path.suffix == '.idx' else 'token file'}: {MEGATRON_NAMING}"
    kind = next((name for magic, name in RAW_KINDS if head.startswith(magic)), None)
    if kind is None and head.lstrip(b"\xef\xbb\xbf \t\r\n")[:1] in (b"{", b"["):  # a BOM or blank lines first
        kind = "JSON (lines)"
    named = kind_of(path.name, named=True)
    if kind is None and named not in (None, "arrow"):  # by its name: text, JSON lines (an .arrow is just broken)
        kind = {"lines": "text (a document a line)", "parquet": "Parquet"}.get(named, "JSON (lines)")
    if kind:  # a corpus as users hold it, named by a recipe before it was converted
        return f"is {kind}, not Arrow: {_convert(path)}"
    return f"is not an Arrow file (it starts with {head[:8]!r}, not {ARROW_FILE_MAGIC!r} or a stream's first message)"


# A Megatron pair is named by its prefix, and read with data.format megatron.
MEGATRON_NAMING = "name its prefix (without .bin/.idx) in data.path, with data.format megatron"


def _megatron_pair(prefix: Path) -> bool:
    """Whether PREFIX.bin and a PREFIX.idx of megatron-core's header are there."""
    try:
        with open(f"{prefix}.idx", "rb") as f:
            return f.read(len(MEGATRON_IDX_MAGIC)) == MEGATRON_IDX_MAGIC and Path(f"{prefix}.bin").is_file()
    except OSError:
        return False


def _convert(path: Path) -> str:
    """The command that converts raw files (a file or a folder) into the Arrow corpus data.path names: of a folder
    holding several splits (the Hub's layout, a DatasetDict), its train split, which to-arrow takes only named."""
    stem = input_stem(path.name) if path.is_file() else path.name
    arrow = path.is_file() and path.name.lower().endswith(".arrow")
    splits = splits_held(path) if path.is_dir() else []
    if len(splits) > 1:
        which = "its train split" if splits[0] == "train" else "the split to train on, e.g."
        return (
            f"it holds {len(splits)} splits ({listed(splits)}): convert {which} with `trnrecipes data to-arrow --in"
            f" {_q(path)} --split {_q(splits[0])} --out {_q(path.with_name(f'{stem}-{splits[0]}.arrow'))}` and name"
            f" that in data.path ({BRING_YOUR_DATA})"
        )
    out = path.with_name(f"{stem}-text.arrow" if arrow else f"{stem}.arrow")
    return (
        f"convert it with `trnrecipes data to-arrow --in {_q(path)} --out {_q(out)}` and name that in data.path"
        f" ({BRING_YOUR_DATA})"
    )


def _raw_folder(folder: Path, raw: Counter) -> str:
    """What a folder of files to convert is, in words."""
    if (folder / "dataset_dict.json").is_file():
        return "a datasets DatasetDict (DatasetDict.save_to_disk)"
    if (folder / "state.json").is_file() and any(folder.glob("data-*.arrow")):
        return "a datasets Dataset (Dataset.save_to_disk)"
    most = sorted(raw.items(), key=lambda held: (-held[1], held[0]))[:4]  # ties by name: not the listing's order
    held = ", ".join(f"{n:,} {suffix}" for suffix, n in most)
    what = "Arrow files without the corpus.json of a shard directory" if set(raw) == {".arrow"} else "raw files"
    return f"a folder of {what} ({held})"


def _raw_files(folder: Path, cap: int = 10_000) -> Counter:
    """The input files to-arrow would read in `folder` (walked, at most `cap` names looked at), by suffix."""
    found: Counter = Counter()
    seen = 0
    for _, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        beside = {*names, *dirs}
        for name in names:  # the walk's own rule (inputs.passed_over), so the counts are what to-arrow would read
            seen += 1
            about = Path(name).stem.upper() in ABOUT_A_DATASET
            if not about and not passed_over(name, beside) and kind_of(name, named=False) is not None:
                found[Path(name).suffix.lower()] += 1
        if seen >= cap:
            break
    return found


def _format(label: str, fmt: str) -> str:
    """The setting that says how the corpus `label` names is read: data.format, or a blend source's own format (a
    Megatron source among Arrow ones sets its own, not data.format, which every source without one takes)."""
    if label == "data.eval_path":
        return "data.eval_path is read as Arrow"
    return f"{label.removesuffix('.path')}.format {fmt}"


def check_corpus_file(label: str, path: str, fmt: str, tokenizer: str, repo_root: Path) -> list[str]:
    full = data_path(path, repo_root)
    files = [Path(f"{full}{ext}") for ext in (".bin", ".idx")] if fmt == "megatron" else [full]
    for f in files:
        if why := blocked(f):
            return [f"{label} {path}: cannot be reached: {why}"]
    if fmt == "megatron":
        missing = [f"{full}{ext}" for ext in (".bin", ".idx") if not Path(f"{full}{ext}").is_file()]
        if missing and full.suffix in (".bin", ".idx") and _megatron_pair(full.with_suffix("")):
            return [f"{label} {path}: names the pair's {full.suffix} file; data.path is its prefix: {path[:-4]}"]
        if missing:
            made_by = _made_by(path, fmt, str(data_path(tokenizer, repo_root)), full)
            return [f"{label} {path}: {' and '.join(missing)} missing; {made_by}"]
        try:
            with open(f"{full}.idx", "rb") as f:
                head = f.read(len(MEGATRON_IDX_MAGIC))
        except OSError as err:
            return [f"{label} {path}: {full}.idx cannot be read ({err.strerror or err})"]
        if head != MEGATRON_IDX_MAGIC:
            return [f"{label} {path}: {full}.idx is not a Megatron index (no MMIDIDX header); {_format(label, fmt)}"]
        return _check_tokenized_with(label, path, full, tokenizer, repo_root)
    if not full.exists() and _megatron_pair(full):
        pair = f"{label} {path}: names a Megatron pair ({full}.bin/.idx)"
        if label == "data.eval_path":  # a classification holdout: Arrow rows with their labels
            return [f"{pair}, but it is read as Arrow: {_made_by(path, 'arrow', full=full)}"]
        return [f"{pair}: set {_format(label, 'megatron')}"]
    if not full.exists():
        return [f"{label} {path}: {full} does not exist; {_made_by(path, 'arrow', full=full)}"]
    if full.is_dir():
        return _check_shards(label, path, full, fmt)
    if not full.is_file():
        return [f"{label} {path}: {full} is not a file (an Arrow file made by `trnrecipes data to-arrow`)"]
    problem = _sniff_arrow(full)
    return [f"{label} {path}: {full} {problem}; {_format(label, fmt)}"] if problem else []


def _check_shards(label: str, path: str, full: Path, fmt: str) -> list[str]:
    """A directory of Arrow shards (`data to-arrow --shard-bytes`): its manifest readable, every shard it lists there
    and an Arrow stream by its first bytes (their rows are counted by corpus_check). A folder of raw files (the
    corpus as a user holds it) is told how to convert."""
    if not (full / MANIFEST).is_file() and (raw := _raw_files(full)):
        return [f"{label} {path}: {full} is {_raw_folder(full, raw)}, not an Arrow corpus: {_convert(full)}"]
    try:
        manifest = read_manifest(full)
    except DataError as err:
        return [f"{label} {path}: {err}"]
    for shard in manifest.shards:
        f = full / shard.file
        if not f.is_file():
            return [
                f"{label} {path}: {f} is missing, yet {MANIFEST} lists it; write the corpus again with `trnrecipes"
                " data to-arrow`"
            ]
        if problem := _sniff_arrow(f):
            return [f"{label} {path}: {f} {problem}; {_format(label, fmt)}"]
    return []


def _check_tokenized_with(label: str, path: str, full: Path, tokenizer: str, repo_root: Path) -> list[str]:
    """Token ids made by another tokenizer than data.tokenizer (as `data preprocess` recorded) would train the
    model on other tokens' ids: in a blend, one source's ids would mean one thing and another's another."""
    made_by = tokenized_with(full)
    tok_file = data_path(tokenizer, repo_root) / "tokenizer.json"
    if made_by is None or blocked(tok_file) or not tok_file.is_file():  # unrecorded, or said with the tokenizer
        return []
    try:
        ours = tokenizer_fingerprint(tok_file.parent)
    except OSError:
        return []
    if made_by["sha256"] == ours:
        return []
    return [
        f"{label} {path}: tokenized with {made_by.get('tokenizer', 'another tokenizer')}, not data.tokenizer"
        f" {tokenizer} (their tokenizer.json differ): its ids would mean other tokens; re-make it with `trnrecipes"
        f" data preprocess --tokenizer {_q(tokenizer)} --out {_q(path)}` or use that tokenizer"
    ]


def tokenizer_vocab_size(tokenizer_json: Path) -> int:
    """The number of ids a tokenizer.json can produce: its largest id + 1, over the model's vocabulary and the added
    tokens (what `tokenizers`' get_vocab_size(with_added_tokens=True) counts for a dense vocabulary). ValueError if
    the file is not a tokenizer.json."""
    spec = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    model = spec.get("model") if isinstance(spec, dict) else None
    if not isinstance(model, dict) or "vocab" not in model:
        raise ValueError("no model.vocab")
    vocab = model["vocab"]
    if isinstance(vocab, dict):  # BPE, WordPiece, WordLevel: token -> id
        ids = list(vocab.values())
    elif isinstance(vocab, list):  # Unigram: [token, score] pairs, the id being the position
        ids = [len(vocab) - 1] if vocab else []
    else:
        raise ValueError("model.vocab is neither a mapping nor a list")
    added = spec.get("added_tokens") or []
    if not isinstance(added, list):
        raise ValueError("added_tokens is not a list")
    ids += [t["id"] for t in added if isinstance(t, dict) and isinstance(t.get("id"), int)]
    if not ids or not all(isinstance(i, int) for i in ids):
        raise ValueError("no integer ids in model.vocab")
    return max(ids) + 1


def _check_tokenizer(recipe: Recipe, repo_root: Path) -> list[str]:
    path = recipe.data.tokenizer
    full = data_path(path, repo_root)
    tok_file = full / "tokenizer.json"
    if full.is_file():  # named by its file (tokenizer.json), not its directory
        here = f" (here {Path(path).parent})" if (full.parent / "tokenizer.json").is_file() else ""
        return [f"data.tokenizer {path}: names a file; data.tokenizer is a directory holding tokenizer.json{here}"]
    if why := blocked(tok_file):
        return [f"data.tokenizer {path}: cannot be reached: {why}"]
    if not tok_file.is_file():
        where = f"{full} does not exist" if not full.exists() else f"{full} has no tokenizer.json"
        return [f"data.tokenizer {path}: {where}; {_made_by(path, 'tokenizer', full=full)}"]
    try:
        size = tokenizer_vocab_size(tok_file)
    except (OSError, UnicodeDecodeError, ValueError) as err:  # json.JSONDecodeError is a ValueError
        return [f"data.tokenizer {path}: {tok_file} is not a readable tokenizer.json ({err}); corrupt or truncated?"]
    limit = recipe.model.vocab_size
    if size > limit:
        return [
            f"data.tokenizer {path}: {size:,} ids, more than model.vocab_size {limit:,}: ids >= {limit:,} would index"
            f" past the embedding; use this model's tokenizer, or a model.vocab_size of at least {size:,}"
        ]
    if family_spec(recipe.model.family).objective != "classification":
        return []
    pad, want = _pad_id(full), getattr(recipe.model, "pad_token_id", None)  # parses tokenizer.json: classifiers only
    if pad is not None and pad != want:
        return [  # what training refuses at its start (data/sources.open_labelled)
            f"data.tokenizer {path}: pads with id {pad} but model.pad_token_id is {want}: the model would attend to"
            f" padding; set model.pad_token_id={pad}"
        ]
    return []


def _pad_id(tokenizer_dir: Path) -> int | None:
    """The id of the pad token tokenizer_config.json (or special_tokens_map.json under it) names, looked up in
    tokenizer.json as trnrecipes.data.tokenizer does, without the tokenizers library; None where none is named or
    it cannot be read (training says so)."""
    config = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        try:
            found = json.loads((tokenizer_dir / name).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            continue
        config |= found if isinstance(found, dict) else {}
    token = config.get("pad_token")
    token = token.get("content") if isinstance(token, dict) else token
    if not isinstance(token, str):
        return None
    try:
        spec = json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    for added in spec.get("added_tokens") or []:
        if isinstance(added, dict) and added.get("content") == token and isinstance(added.get("id"), int):
            return added["id"]
    vocab = (spec.get("model") or {}).get("vocab")
    if isinstance(vocab, dict) and isinstance(vocab.get(token), int):
        return vocab[token]
    if isinstance(vocab, list):  # Unigram: [piece, score] pairs, the id being the position
        return next((i for i, entry in enumerate(vocab) if isinstance(entry, list) and entry[:1] == [token]), None)
    return None


def tokenizer_warnings(recipe: Recipe, repo_root: Path) -> list[str]:
    """A tokenizer with fewer than half of model.vocab_size ids: most of the embedding would never be trained (likely
    another model's tokenizer). Padding the table to a multiple (Llama's 32,000 -> 32,768) is fine."""
    tok_file = data_path(recipe.data.tokenizer, repo_root) / "tokenizer.json"
    if blocked(tok_file) or not tok_file.is_file():
        return []  # said by data_problems
    try:
        size = tokenizer_vocab_size(tok_file)
    except (OSError, UnicodeDecodeError, ValueError):
        return []
    limit = recipe.model.vocab_size
    if size * 2 >= limit:
        return []
    return [
        f"data.tokenizer {recipe.data.tokenizer}: {size:,} ids, under half of model.vocab_size {limit:,}: the other"
        f" {limit - size:,} rows of the embedding would never be trained. This model's tokenizer, or model.vocab_size"
        f" {size:,} (or that rounded up to a multiple of 64 or 128)"
    ]


def data_problems(recipe: Recipe, repo_root: Path) -> list[str]:
    """Every problem with the recipe's data.path (or each of data.sources), data.eval_path (a classification
    holdout) and data.tokenizer as the job would see them from this host; [] when they are all there and fit."""
    d = recipe.data
    problems = []
    for i, source in enumerate(d.corpora()):
        label = f"data.sources[{i}].path" if d.sources else "data.path"
        problems += check_corpus_file(label, source.path, source.format, d.tokenizer, repo_root)
    if d.eval_path:
        problems += check_corpus_file("data.eval_path", d.eval_path, "arrow", d.tokenizer, repo_root)
    if family_spec(recipe.model.family).objective == "classification":  # the advice's to-arrow keeps the labels
        problems = [p.replace(TO_ARROW, f"{TO_ARROW} --label-field {_q(d.label_field)}") for p in problems]
    return problems + _check_tokenizer(recipe, repo_root) + _check_init_from(recipe, repo_root)


def _check_init_from(recipe: Recipe, repo_root: Path) -> list[str]:
    """train.init_from, the checkpoint a fine-tune or a long-context stage starts from: missing, the job would stop
    at its start, after the queue."""
    if recipe.train.init_from is None:
        return []
    path = Path(recipe.train.init_from)
    full = path if path.is_absolute() else repo_root / path
    if full.exists():
        try:  # what the trainer refuses of it at the job's start: its model, or 'keep' of weights only
            problem = init_from_problem(recipe, full)
        except RecipeError as err:
            problem = f"train.init_from {path}: {err}"
        except OSError as err:
            problem = f"train.init_from {path}: cannot be read ({err.strerror or err})"
        return [problem] if problem else []
    run = "point it at a trnrecipes checkpoint (a run's checkpoints/step_N)"
    if recipe.train.init_optimizer == "keep":  # a conversion holds no optimizer state to keep
        return [f"train.init_from {path}: {full} does not exist; {run}: train.init_optimizer 'keep' needs its moments"]
    if getattr(recipe.model, "head", None) == "mlp":  # no Hugging Face class has this head: nothing converts to it
        return [f"train.init_from {path}: {full} does not exist; {run} with this model.head 'mlp'"]
    return [
        f"train.init_from {path}: {full} does not exist; {run}, or make one with `trnrecipes convert from-hf --hf"
        f" <Hugging Face model dir> --out {_q(path)} --recipe {recipe.name}`"
    ]


EVAL_DATA_DIR = "data/eval"  # `trnrecipes eval run`'s default --data-dir, which eval.sbatch runs from the checkout


def eval_data_problem(repo_root: Path) -> str | None:
    """Why eval.sbatch (a causal LM's) would stop at its start, after the whole run: no offline eval data."""
    where = Path(repo_root) / EVAL_DATA_DIR
    if where.is_dir() and any(where.iterdir()):
        return None  # which tasks' files: eval run names any missing before it exports anything
    return (
        f"{where} (the evaluation's offline data) is missing: eval.sbatch would stop at its start, after the run;"
        f" `make data` builds it once (Python 3.11+), or `trnrecipes eval prepare-data --out {where}`"
    )
