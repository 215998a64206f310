"""The files a conversion reads, from what the command line names: files, directories (walked in sorted path order),
datasets save_to_disk directories, shard directories to-arrow wrote (manifest.py) and `-` (standard input, JSON
lines). Splits are recognised by the Hugging Face Hub's file-name rules, and by the name of a folder given; a file
naming no split is train. One file named twice (also through a link) is refused.
"""

from __future__ import annotations

import os
import re
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from stat import S_ISREG

from trnrecipes.data import DataError, listed
from trnrecipes.data.manifest import MANIFEST, holds_only_shards, read_manifest
from trnrecipes.data.tokenized_with import TOKENIZED_WITH  # preprocess's record beside PREFIX.bin/.idx: no input

STDIN = "-"
TEXT_FILE_SUFFIXES = (".txt", ".md", ".rst")
# One JSON record a line, by how the file is compressed.
JSON_LINES_PLAIN = (".jsonl", ".json")
JSON_LINES_GZIP = (".jsonl.gz", ".json.gz")
JSON_LINES_ZSTD = (".jsonl.zst", ".json.zst")
JSON_LINES = (*JSON_LINES_PLAIN, *JSON_LINES_GZIP, *JSON_LINES_ZSTD)
# Every suffix that makes a file an input, the longest first (.jsonl.gz before .gz-less .jsonl).
INPUT_SUFFIXES = (*JSON_LINES_GZIP, *JSON_LINES_ZSTD, *JSON_LINES_PLAIN, ".parquet", ".arrow", *TEXT_FILE_SUFFIXES)
ACCEPTED_FILES = ".jsonl, .json (JSON lines; also .gz, .zst), .parquet, .arrow, .txt, .md, .rst (a document a line)"
# Names a datasets directory keeps beside its data: never records.
DATASETS_METADATA = ("dataset_info.json", "dataset_infos.json", "state.json", "dataset_dict.json")
# Files beside a dataset's data that say what it is (a Hub download's README.md and LICENSE): left out of a walk
# without a note, as text files beside records are.
ABOUT_A_DATASET = ("README", "LICENSE", "LICENCE", "COPYING", "NOTICE", "CITATION")
JOB = "job.json"  # a conversion's work dir's record (work_dir.py)
REJECTS_SUFFIX = ".rejects.jsonl"  # what `--on-bad-record skip` writes beside an output: a walk passes it over there

# The Hub's split keywords ("File names and splits", Hugging Face Hub docs): a word of a file or folder name,
# delimited by -, _, ., a space or digits; and data/<split>-00000-of-00003.* for a split of any name.
SPLIT_KEYWORDS = {
    "train": "train", "training": "train",
    "validation": "validation", "valid": "validation", "val": "validation", "dev": "validation",
    "test": "test", "testing": "test", "eval": "test", "evaluation": "test",
}  # fmt: skip
NAME_DELIMITERS = re.compile(r"[-._ 0-9]+")
SHARDED_SPLIT = re.compile(r"(.+?)-\d{5}-of-\d{5}\.")


@dataclass(frozen=True)
class InputFile:
    """One file to read: `kind` says how (jsonl, jsonl.gz, jsonl.zst, parquet, arrow, lines: a document a line,
    document: the whole file); `path` is None for standard input; `split` the split its path says (_split_of), if
    any."""

    path: Path | None
    kind: str
    split: str | None = None

    @property
    def name(self) -> str:
        return "<stdin>" if self.path is None else str(self.path)


def find_inputs(
    given: Sequence[str | Path | InputFile], split: str | None = None, log: Callable[[str], None] | None = None
) -> list[InputFile]:
    """The files to read for the inputs `given` (InputFiles are kept as they are), in command-line order, each
    directory's files in sorted path order; with `split`, only that split's files (where no file name says a split,
    every file is train, as on the Hub). Refuses an input that does not exist or holds nothing readable, files of
    several splits without `split`, and a file found twice. `log` is told of the files a directory holds that are
    not read."""
    notes: list[str] = []  # told once the inputs are accepted
    files = [
        f for item in given for f in ([item] if isinstance(item, InputFile) else _found(item, split, notes.append))
    ]
    files = _named_in_split_folders(files, given)
    # A file whose name says no split is train, also beside files that name one (the Hub leaves it out there: its
    # documents would be lost without a word), so that shards beside an eval.jsonl are two splits, not one.
    found = Counter(f.split or "train" for f in files)
    unnamed = sum(not f.split for f in files)
    if unnamed == len(files):
        said = "none: no file name says one, so every file is train"
    else:
        said = _counted(found) + ("; a file whose name says no split is train" if unnamed else "")
    if split is not None:
        files = [f for f in files if (f.split or "train") == canonical_split(split)]
        if not files:
            raise DataError(
                f"--split {split}: no file of split {canonical_split(split)!r} in {input_names(given)} (splits found:"
                f" {said})"
            )
    elif len(found) > 1:  # train with test or validation would leak the held-out sets into training
        example = "train" if "train" in found else max(found, key=lambda s: (found[s], s))
        raise DataError(
            f"{_holders(given)} files of {len(found)} splits ({said}); --split NAME takes one of them,"
            f" e.g. --split {example}"
        )
    _refuse_twice(files)
    for note in notes if log is not None else ():
        log(note)
    return files


def check_arrow_output(out: str | Path, given: Sequence[str | Path], shards: bool = False) -> None:
    """DataError where to-arrow's output would be read back as an input: named as another kind of input (a later
    walk would read its Arrow bytes as JSON lines or Parquet), or inside a directory given (a later conversion of
    it would read its documents again, and this same command, rerun, would find its output among its inputs). And
    a name ending in '/' for one file (`shards` False): it would be written as a file named like the directory."""
    if not shards and str(out).endswith(("/", os.sep)):
        raise DataError(
            f"--out {out}: names a directory, but to-arrow writes one Arrow file: name the file"
            f" (e.g. {Path(out) / 'corpus.arrow'}), or give --shard-bytes to write a shard directory there"
        )
    out = Path(out)
    if kind := kind_named(out.name, "arrow"):
        raise DataError(
            f"--out {out}: to-arrow writes an Arrow IPC stream, but the name says {kind}; name it .arrow"
            f" (e.g. {out.with_name(input_stem(out.name) + '.arrow')})"
        )
    where = out.resolve()
    folders = [Path(item).resolve() for item in given if str(item) != STDIN and Path(item).is_dir()]
    for item in given:
        folder = Path(item)
        if str(item) != STDIN and folder.is_dir() and folder.resolve() in where.parents:
            beside = Path(os.path.abspath(folder)).parent / out.name
            outside = all(f not in beside.resolve().parents for f in folders) and beside.parent != folder.resolve()
            raise DataError(
                f"--out {out} lies in the input directory {folder}: a later conversion of {folder} would read it back"
                f" as an input (its documents twice); write it outside{f', e.g. {beside}' if outside else ''}"
            )


def canonical_split(name: str) -> str:
    """A split name as the Hub counts it: valid, val and dev are validation; training is train; ..."""
    return SPLIT_KEYWORDS.get(name.lower(), name)


def input_names(given: Sequence[str | Path | InputFile]) -> str:
    """The inputs as a message names them: the first three."""
    return listed((item.name if isinstance(item, InputFile) else str(item) for item in given), 3)


def _holders(given: Sequence) -> str:
    return f"the inputs {input_names(given)} hold" if len(given) > 1 else f"{input_names(given)} holds"


def _counted(splits: Counter) -> str:
    return ", ".join(f"{s}: {n} file{'s' if n > 1 else ''}" for s, n in sorted(splits.items()))


def _found(given: str | Path, split: str | None, log: Callable[[str], None] | None = None) -> list[InputFile]:
    if str(given) == STDIN:
        if sys.stdin is None:  # closed (`<&-`), as a daemon's or some schedulers' jobs start
            raise DataError("--in -: standard input is closed; pipe the JSON lines in (... | trnrecipes data --in -)")
        return [InputFile(None, "jsonl")]
    path = Path(given)
    if not path.exists():
        raise DataError(f"input {path} does not exist")
    if path.is_file():
        kind = kind_of(path.name, named=True)
        if kind is None:
            raise DataError(
                f"{path}: unknown input type; expected {ACCEPTED_FILES}, a directory, or - (JSON lines on standard"
                " input)"
            )
        return [InputFile(path, kind, _split_of(path, path.parent))]
    if not path.is_dir():
        raise DataError(f"input {path} is neither a file nor a directory; to read a pipe, give - and pipe it in")
    saved = sorted(path.glob("data-*.arrow"))
    if saved:  # datasets.save_to_disk; one split of a DatasetDict's is named by its folder, whatever the name
        named = Path(os.path.abspath(path))  # `.` named, links not followed: the name the user sees
        own = canonical_split(named.name) if (named.parent / "dataset_dict.json").is_file() else _folder_split(path)
        return [InputFile(f, "arrow", own) for f in saved]
    if (path / "dataset_dict.json").is_file():  # a DatasetDict.save_to_disk: one directory per split
        return _dataset_dict_split(path, split)
    if holds_only_shards(os.listdir(path), hidden_ok=True):  # to-arrow --shard-bytes: read in its manifest's order
        return _shards(path)
    return _walked(path, _folder_split(path), log)


def _shards(path: Path) -> list[InputFile]:
    shards = read_manifest(path).shards
    missing = [s.file for s in shards if not (path / s.file).is_file()]
    if not shards or missing:
        what = f"lacks {listed(missing, 3)}, which it lists" if missing else "lists no shard"
        raise DataError(f"{path / MANIFEST}: the shard directory {what}; write it again with to-arrow --shard-bytes")
    return [InputFile(path / s.file, "arrow", _folder_split(path)) for s in shards]


def _named_in_split_folders(files: list[InputFile], given: Sequence) -> list[InputFile]:
    """The files named on the command line in folders named for different splits (`--in pile/train/00.jsonl.zst
    pile/test/00.jsonl.zst`, as a shell glob names them, or beside a split's folder: `--in pile/train
    pile/val/00.jsonl`) take those folders' splits, where their own names say none; elsewhere the folder a file
    lies in says nothing (a scratch test/ or dev/ beside other folders, or the working directory)."""
    named = {Path(item) for item in given if not isinstance(item, InputFile) and str(item) != STDIN}
    folders = {
        k: _folder_split(f.path.parent)
        for k, f in enumerate(files)
        if f.path is not None and f.split is None and f.path in named and f.path.is_file()
    }
    said = {  # a split folder given (pile/train) says its files' split; a file's own name or folder does not here
        _folder_split(Path(item)) for item in given if not isinstance(item, InputFile) and Path(item).is_dir()
    } - {None}
    if len({s for s in folders.values() if s is not None} | said) < 2:
        return files
    return [InputFile(f.path, f.kind, folders[k]) if folders.get(k) else f for k, f in enumerate(files)]


def _dataset_dict_split(path: Path, split: str | None) -> list[InputFile]:
    splits = dataset_dict_splits(path)
    named = None if split is None else canonical_split(split)  # --split val takes a DatasetDict's validation too
    chosen = split if split in splits else next((s for s in splits if canonical_split(s) == named), None)
    if chosen is None:
        raise DataError(
            f"{path} is a datasets DatasetDict (splits: {listed(splits) or 'none'})"
            + (f" without a split {split!r}" if split is not None else "")
            + f"; --split NAME takes one, e.g. --split {next(iter(_train_first(splits)), 'train')}"
        )
    return [InputFile(f, "arrow", canonical_split(chosen)) for f in sorted((path / chosen).glob("data-*.arrow"))]


def dataset_dict_splits(path: Path) -> list[str]:
    """A DatasetDict.save_to_disk directory's splits, by name."""
    return sorted(p.name for p in path.iterdir() if (p / "dataset_info.json").is_file())


def _train_first(splits) -> list[str]:
    """The splits by name, a train split first: the one to suggest converting for training."""
    return sorted(splits, key=lambda s: (canonical_split(s) != "train", s))


def splits_held(folder: Path, cap: int = 10_000) -> list[str]:
    """The splits a folder to convert holds, train first: a DatasetDict's, or its record files' by the Hub's naming
    rules (where there are several, to-arrow needs --split); [] where none says one. Of the first `cap` names met,
    a folder's own before its subfolders': a folder of millions of files on a shared file system is not walked whole
    (sbatch's advice calls this)."""
    if (folder / "dataset_dict.json").is_file():
        return _train_first(dataset_dict_splits(folder))
    own, found, seen = _folder_split(folder), set(), 0
    for here, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        beside = {*names, *dirs}
        for name in names:  # all of a folder's: which of them come first is the file system's order
            if not passed_over(name, beside) and kind_of(name, named=False) not in (None, "document"):
                found.add(_split_of(Path(here, name), folder, own) or "train")
        seen += len(names)
        if seen >= cap:
            break
    return _train_first(found) if found != {"train"} else []


def _walked(root: Path, own_split: str | None = None, log: Callable[[str], None] | None = None) -> list[InputFile]:
    """The record files under `root` (recursively, links followed once, hidden names skipped) in sorted path order,
    folder by folder (a/b/c.jsonl before a/c.jsonl); where there are none, its text files, a document each. A
    directory of neither names what it holds; `log` is told how many files of what kinds are left out (a corpus of
    .jsonl.bz2 shards beside one .jsonl would otherwise be one file's documents, without a word)."""
    records: list[Path] = []
    texts: list[Path] = []
    other: Counter = Counter()
    odd = 0  # names of an input kind that are no regular file: a FIFO (read, it would hang), a socket, a broken link
    seen_dirs: set[tuple[int, int]] = set()
    for folder, dirs, names in os.walk(root, onerror=_unreadable, followlinks=True):
        here = os.stat(folder)
        if (here.st_dev, here.st_ino) in seen_dirs:  # a link back up the tree
            dirs.clear()
            continue
        seen_dirs.add((here.st_dev, here.st_ino))
        # hidden names, and a conversion's work dir (an output's OUT.parts/ beside it: its parts are no input)
        dirs[:] = [
            d for d in dirs if not d.startswith(".") and not (d.endswith(".parts") and Path(folder, d, JOB).is_file())
        ]
        manifest = holds_only_shards(names, hidden_ok=True)
        beside = {*names, *dirs}
        for name in names:
            if passed_over(name, beside):
                continue
            if manifest and name == MANIFEST:  # a shard directory's: its shards are walked in its order
                continue
            kind = kind_of(name, named=False)
            if kind is None and Path(name).stem.upper() not in ABOUT_A_DATASET:
                other["".join(Path(name).suffixes[-1:]) or "no suffix"] += 1
            if kind is None:
                continue
            if not os.path.isfile(Path(folder, name)):
                odd += 1
                continue
            (texts if kind == "document" else records).append(Path(folder, name))

    def in_order(paths: list[Path]) -> list[Path]:
        return sorted(paths, key=lambda p: p.relative_to(root).parts)

    texts_left = Counter(f.suffix.lower() for f in texts if f.stem.upper() not in ABOUT_A_DATASET) if records else {}
    if log is not None and (other or texts_left or odd) and (records or texts):
        left = sum(other.values()) + sum(texts_left.values()) + odd
        kinds = other + Counter(texts_left) + Counter({"not regular files": odd})
        why = f"not of an input kind ({ACCEPTED_FILES})" if other else ""
        if texts_left:  # a book among JSON lines is not read: a folder of text is one, a document a file
            why += ("; " if why else "") + "text files are read only from a folder of text alone, a document each"
        if odd:
            why += ("; " if why else "") + "a FIFO, a socket, a device or a broken link is no file to read"
        log(f"[trnrecipes] {root}: left out {left} file{'s' * (left > 1)} ({_kinds_held(kinds)}), {why}; reading the"
            f" other {len(records or texts)}")  # fmt: skip
    _refuse_converted_beside(records, root)
    if records:
        return [
            InputFile(f, str(kind_of(f.name, named=False)), _split_of(f, root, own_split)) for f in in_order(records)
        ]
    if texts:
        return [InputFile(f, "document") for f in in_order(texts)]
    held = _kinds_held(other + Counter({"not regular files": odd})) if other or odd else "no files"
    raise DataError(
        f"directory {root} holds no input to read ({held}); accepted: {ACCEPTED_FILES} files, a datasets save_to_disk"
        " directory, or .txt, .md, .rst files (a document each)"
    )


def passed_over(name: str, beside: set[str]) -> bool:
    """A walk's names that are no input (`beside`: the names in the same folder): hidden ones, datasets' metadata
    (its dataset_info(s).json wherever they are: a Hub download or datasets' cache holds them beside the data, and
    they are pretty-printed JSON, no records; a state.json in a folder save_to_disk wrote), and our own rejects
    lists and tokenizer records beside their outputs. Elsewhere a state.json or NAME.rejects.jsonl is read as its
    kind says: it may be a user's records."""
    if name.startswith("."):
        return True
    if name == "state.json":
        return "dataset_dict.json" in beside or any(n.startswith("data-") and n.endswith(".arrow") for n in beside)
    if name in DATASETS_METADATA:
        return True
    if name.endswith(REJECTS_SUFFIX):  # OUT.rejects.jsonl beside OUT (a file or shard directory), PREFIX's beside .bin
        out = name.removesuffix(REJECTS_SUFFIX)
        return out in beside or f"{out}.bin" in beside
    if name.endswith(TOKENIZED_WITH):  # PREFIX.tokenizer.json beside PREFIX.bin/.idx
        return bool({f"{name.removesuffix(TOKENIZED_WITH)}{ext}" for ext in (".bin", ".idx")} & beside)
    return False


def _refuse_converted_beside(records: list[Path], root: Path) -> None:
    """DataError where an .arrow file lies beside a raw file of its name (web.arrow beside web.jsonl: converted from
    it, as sbatch's advice names it): walked together, its documents would be read twice."""
    raw = {(f.parent, input_stem(f.name)): f for f in records if not f.name.lower().endswith(".arrow")}
    for f in records:
        source = raw.get((f.parent, input_stem(f.name))) if f.name.lower().endswith(".arrow") else None
        if source is not None:
            raise DataError(
                f"{f} lies beside {source.name}, the file it was likely converted from: walking {root} would read"
                f" their documents twice; move {f.name} out of {root}, or name the files to read"
            )


def input_stem(name: str) -> str:
    """A file's name without its input suffix (web.jsonl.gz: web)."""
    suffix = next((x for x in INPUT_SUFFIXES if name.lower().endswith(x)), "")
    return name[: len(name) - len(suffix)]


def _kinds_held(other: Counter) -> str:
    most = sorted(other.items(), key=lambda kind: (-kind[1], kind[0]))[:5]
    return ", ".join(f"{n} {suffix}" for suffix, n in most) + (", ..." if len(other) > 5 else "")


def _unreadable(err: OSError) -> None:
    raise DataError(f"cannot read directory {err.filename} ({err.strerror})") from err


def kind_named(name: str, writes: str) -> str | None:
    """The input kind an output's name says where it is not what the output holds (`writes`: "arrow", or "jsonl"
    for plain JSON lines), else None: a later read takes a file by its name (Arrow named .jsonl, JSON named .gz)."""
    kind = kind_of(name, named=True)
    if writes == "arrow":
        return kind if kind not in (None, "arrow") else None
    if kind in ("jsonl.gz", "jsonl.zst", "parquet", "arrow"):
        return kind
    return "compressed" if name.lower().endswith((".gz", ".zst", ".bz2")) else None


def kind_of(name: str, named: bool) -> str | None:
    """How a file of this name is read (its suffix in any case: .JSONL, .Parquet): a text file named on the command
    line is a document a line, one found in a directory a document."""
    name = name.lower()
    if name.endswith(JSON_LINES_PLAIN):
        return "jsonl"
    if name.endswith(JSON_LINES_GZIP):
        return "jsonl.gz"
    if name.endswith(JSON_LINES_ZSTD):
        return "jsonl.zst"
    if name.endswith((".parquet", ".arrow")):
        return name.rsplit(".", 1)[1]
    if name.endswith(TEXT_FILE_SUFFIXES):
        return "lines" if named else "document"
    return None


def _split_of(f: Path, root: Path, own: str | None = None) -> str | None:
    """The split a file belongs to by the Hub's rules: data/<split>-00000-of-00003.*, a keyword in a folder name
    below `root`, or one in the file name; else `own`, the split the name of the folder given says (_folder_split).
    """
    if (sharded := SHARDED_SPLIT.match(f.name)) and f.parent.name == "data":
        return canonical_split(sharded.group(1))
    for name in [*f.relative_to(root).parts[:-1], f.name]:
        for word in NAME_DELIMITERS.split(name.lower()):
            if word in SPLIT_KEYWORDS:
                return SPLIT_KEYWORDS[word]
    return own


def _stdin_file() -> os.stat_result | None:
    """Standard input's file where it is one redirected (`< a.jsonl`), else None (a pipe, a terminal, closed)."""
    try:
        stat = os.fstat(0)
    except OSError:
        return None
    return stat if S_ISREG(stat.st_mode) else None


def _folder_split(folder: Path) -> str | None:
    """The split a folder given (or holding files named: _named_in_split_folders) is named for: `train/`, `val/`,
    `test-0/`, so that `--in pile/train pile/test` is refused as `--in pile` is. The whole name, not a word of it
    as below the folder given: the folder a corpus lies in (`test_runs/`, `eval-sets/`) is no split."""
    name = os.path.basename(os.path.abspath(folder)).lower()
    word = NAME_DELIMITERS.sub("", name)
    return SPLIT_KEYWORDS[word] if word in SPLIT_KEYWORDS and name.startswith(word) else None


def _refuse_twice(files: list[InputFile]) -> None:
    """A file read twice would repeat its documents: the same path, or the same file by another name (a symbolic or
    hard link), by device and inode."""
    seen: dict[tuple[int, int], InputFile] = {}
    for f in files:
        stat = f.path.stat() if f.path is not None else _stdin_file()
        key = (stat.st_dev, stat.st_ino) if stat is not None else (-1, -1)
        if key not in seen:
            seen[key] = f
            continue
        first = seen[key]
        if f.path is None or first.path is None:
            named = first if f.path is None else f
            if named.path is not None:  # standard input is that file, redirected (`--in - a.jsonl < a.jsonl`)
                raise DataError(f"- (standard input) is {named.name}, also given: each input is read once")
            raise DataError("- is given twice: standard input is read once")
        if os.path.abspath(f.path) == os.path.abspath(first.path):
            raise DataError(f"{f.name} is given twice (or also inside a directory given): each input is read once")
        raise DataError(
            f"{first.name} and {f.name} are the same file (a symbolic or hard link): each input is read once; give"
            " one of them"
        )
