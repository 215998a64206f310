"""`data to-arrow` and `data preprocess` read corpora as they ship (docs/data.md, "Inputs"): folders of JSON-lines
shards walked in sorted order, .jsonl.zst, standard input, the Hub's split layout, each file once; and one policy for
bad records (error where met, or skip listed in OUT.rejects.jsonl, up to --max-bad-records)."""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import REPO

from trnrecipes.cli import main
from trnrecipes.data import listed

GPT2 = REPO / "data/tokenizers/gpt2"


def lines(*records) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in records)


def docs(*texts: str) -> bytes:
    return lines(*({"text": t} for t in texts))


def write(path: Path, data: bytes) -> Path:
    """`data` at `path`, compressed by its name (.gz, or .zst with pyarrow's zstd stream)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.name.endswith(".zst"):
        with pa.output_stream(str(path), compression="zstd") as f:
            f.write(data)
    elif path.name.endswith(".gz"):
        path.write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)
    return path


def parquet(path: Path, texts: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": pa.array(texts, pa.string())}), path)
    return path


def texts_of(path: Path) -> list[str]:
    return pa.ipc.open_stream(pa.memory_map(str(path))).read_all().column("text").to_pylist()


def texts_of_field(path: Path, field: str) -> list[str]:
    return pa.ipc.open_stream(pa.memory_map(str(path))).read_all().column(field).to_pylist()


def to_arrow(capsys, *argv: str | Path) -> tuple[int, str, str]:
    """`trnrecipes data to-arrow ARGV` through the CLI's own entry: (exit code, stdout, stderr)."""
    capsys.readouterr()
    code = main(["data", "to-arrow", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def left_in(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# ---------------------------------------------------------------- inputs


def test_a_folder_of_shards_is_walked_in_sorted_path_order_and_gives_the_same_bytes(tmp_path, capsys):
    def shards(root: Path, reverse: bool) -> Path:
        made = [
            ("b/2.jsonl", docs("b2")),
            ("b/10.jsonl.zst", docs("b10-1", "b10-2")),  # 10 sorts before 2: shard numbers are zero-padded
            ("a.jsonl.gz", docs("a")),
            ("b/c/0.json", docs("bc0")),  # compared name by name: b/2.jsonl, then b/c/0.json
            (".cache/x.jsonl", b"not read: hidden"),
            ("README.md", b"not read: the folder holds records"),
        ]
        for name, data in reversed(made) if reverse else made:
            write(root / name, data)
        return root

    one, other = shards(tmp_path / "one", False), shards(tmp_path / "other", True)
    assert to_arrow(capsys, "--in", one, "--out", tmp_path / "one.arrow")[:2] == (
        0,
        f"wrote {tmp_path}/one.arrow: 5 documents\n",
    )
    assert texts_of(tmp_path / "one.arrow") == ["a", "b10-1", "b10-2", "b2", "bc0"]
    assert to_arrow(capsys, "--in", other, "--out", tmp_path / "other.arrow")[0] == 0
    assert (tmp_path / "one.arrow").read_bytes() == (tmp_path / "other.arrow").read_bytes()
    # Files named on the command line are read in that order.
    assert to_arrow(capsys, "--in", one / "b/2.jsonl", one / "a.jsonl.gz", "--out", tmp_path / "named.arrow")[0] == 0
    assert texts_of(tmp_path / "named.arrow") == ["b2", "a"]


def test_a_corrupt_zst_file_is_one_line_naming_it(tmp_path, capsys):
    whole = write(tmp_path / "whole.jsonl.zst", docs(*[f"document {i}" for i in range(2000)]))
    cut = tmp_path / "cut.jsonl.zst"
    cut.write_bytes(whole.read_bytes()[:200])
    code, _, err = to_arrow(capsys, "--in", cut, "--out", tmp_path / "o.arrow")
    assert code == 2 and err.startswith(f"error: {cut}: not a readable zstd file (") and err.count("\n") == 1, err
    assert left_in(tmp_path) == ["cut.jsonl.zst", "whole.jsonl.zst"]


def test_standard_input_is_json_lines(tmp_path):
    write(tmp_path / "more.jsonl", docs("from a file"))

    def run(*argv: str, stdin: bytes | Path) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "trnrecipes", "data", "to-arrow", *argv]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        if isinstance(stdin, Path):  # redirected from a file: `< FILE`
            with open(stdin, "rb") as f:
                return subprocess.run(command, stdin=f, capture_output=True, cwd=tmp_path, env=env, timeout=60)
        return subprocess.run(command, input=stdin, capture_output=True, cwd=tmp_path, env=env, timeout=60)

    done = run("--in", "-", "more.jsonl", "--out", "o.arrow", stdin=docs("piped 1", "piped 2"))
    assert done.returncode == 0 and done.stdout == b"wrote o.arrow: 3 documents\n", done.stderr
    assert texts_of(tmp_path / "o.arrow") == ["piped 1", "piped 2", "from a file"]
    done = run("--in", "-", "--out", "bad.arrow", stdin=docs("fine") + b"{broken\n")
    assert done.returncode == 2 and done.stderr.decode().startswith("error: <stdin>:2: not valid JSON ("), done.stderr
    assert not (tmp_path / "bad.arrow").exists()
    done = run("--in", "-", "--out", "bad.arrow", stdin=gzip.compress(docs("piped")))  # a .gz piped as it is
    assert done.returncode == 2 and done.stderr.decode() == (
        "error: <stdin>: gzip-compressed data, not JSON lines; decompress it in the pipe (zcat FILE | trnrecipes data"
        " ... --in -), or name the file with --in (.gz and .zst files are read as they are)\n"
    )
    done = run("--in", "-", "more.jsonl", "--out", "bad.arrow", stdin=tmp_path / "more.jsonl")
    assert done.returncode == 2 and done.stderr == b"error: - (standard input) is more.jsonl, also given: each input" \
                                                   b" is read once\n"  # fmt: skip
    assert not (tmp_path / "bad.arrow").exists()


def test_a_zst_file_of_a_window_over_the_readers_says_how_to_read_it(tmp_path, capsys):
    """zstd --long=31 on a stream (a window of 2 GiB) is valid zstd pyarrow's codec refuses: the line says so and
    how to read it, not "corrupt or truncated?". The frame is made by hand: one raw block, a window of 2^31."""
    line = docs("a")
    frame = b"\x28\xb5\x2f\xfd" + bytes([0, 21 << 3]) + ((len(line) << 3) | 1).to_bytes(3, "little") + line
    long, small = tmp_path / "long.jsonl.zst", tmp_path / "small.jsonl.zst"  # written as they are (not by write())
    long.write_bytes(frame)
    code, _, err = to_arrow(capsys, "--in", long, "--out", tmp_path / "o.arrow")
    assert code == 2 and err.endswith(
        "its window is larger than this reader takes (made with zstd --long); decompress it in a pipe: zstd -dc"
        f" --long=31 {long} | trnrecipes data ... --in -\n"
    ), err
    small.write_bytes(frame[:5] + bytes([10 << 3]) + frame[6:])  # a window of 1 KiB
    assert to_arrow(capsys, "--in", small, "--out", tmp_path / "o.arrow")[0] == 0
    assert texts_of(tmp_path / "o.arrow") == ["a"]


@pytest.fixture
def hub(tmp_path) -> Path:
    """A dataset as the Hub holds it: data/<split>-NNNNN-of-NNNNN.parquet, a dataset card, a hidden cache."""
    root = tmp_path / "hub"
    parquet(root / "data/train-00000-of-00002.parquet", ["train 0", "train 1"])
    parquet(root / "data/train-00001-of-00002.parquet", ["train 2"])
    parquet(root / "data/validation-00000-of-00001.parquet", ["validation 0"])
    write(root / "README.md", b"# a dataset card\n")
    write(root / ".cache/huggingface/download/data/train-00000-of-00002.parquet.metadata", b"x\n")
    return root


def test_files_of_several_splits_are_refused_unless_split_names_one(hub, tmp_path, capsys):
    out = tmp_path / "o.arrow"
    code, _, err = to_arrow(capsys, "--in", hub, "--out", out)
    assert code == 2 and err == (
        f"error: {hub} holds files of 2 splits (train: 2 files, validation: 1 file); --split NAME takes one of them,"
        " e.g. --split train\n"
    )
    shards = sorted((hub / "data").glob("*.parquet"))  # as a shell glob names them: data/*.parquet
    code, _, err = to_arrow(capsys, "--in", *shards, "--out", out)
    assert code == 2 and "hold files of 2 splits (train: 2 files, validation: 1 file); --split NAME" in err, err
    assert not out.exists()
    assert to_arrow(capsys, "--in", hub, "--split", "train", "--out", out)[0] == 0
    assert texts_of(out) == ["train 0", "train 1", "train 2"]
    assert to_arrow(capsys, "--in", *shards, "--split", "dev", "--out", out)[0] == 0  # dev, val, valid: validation
    assert texts_of(out) == ["validation 0"]
    code, _, err = to_arrow(capsys, "--in", hub, "--split", "test", "--out", out)
    assert code == 2 and err.startswith(
        f"error: --split test: no file of split 'test' in {hub} (splits found: train: 2 files, validation: 1 file)"
    )


def test_split_folders_and_a_datasets_dict(tmp_path, capsys):
    pile = tmp_path / "pile"
    write(pile / "train/00.jsonl.zst", docs("t0"))
    write(pile / "train/01.jsonl.zst", docs("t1"))
    write(pile / "val.jsonl.zst", docs("v"))
    out = tmp_path / "o.arrow"
    assert to_arrow(capsys, "--in", pile, "--split", "train", "--out", out)[0] == 0
    assert texts_of(out) == ["t0", "t1"]
    datasets = pytest.importorskip("datasets")
    splits = {
        "train": datasets.Dataset.from_dict({"text": ["a", "b"]}),
        "test": datasets.Dataset.from_dict({"text": ["c"]}),
        "validation": datasets.Dataset.from_dict({"text": ["v"]}),
    }
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "dd"))
    code, _, err = to_arrow(capsys, "--in", tmp_path / "dd", "--out", out)
    assert (code, err) == (
        2,
        f"error: {tmp_path / 'dd'} is a datasets DatasetDict (splits: test, train, validation); --split NAME takes"
        " one, e.g. --split train\n",  # the split to train on, not the first by name: test
    )
    assert to_arrow(capsys, "--in", tmp_path / "dd", "--split", "test", "--out", out)[0] == 0
    assert texts_of(out) == ["c"]
    assert to_arrow(capsys, "--in", tmp_path / "dd", "--split", "val", "--out", out)[0] == 0  # as the Hub's names
    assert texts_of(out) == ["v"]


def test_the_splits_of_a_folder_for_advice_look_at_a_bounded_number_of_names(tmp_path):
    """sbatch's advice for a raw folder names its splits (inputs.splits_held): of the names met first, the folder's
    own before its subfolders', not a walk of millions of files on a shared file system."""
    from trnrecipes.data.inputs import splits_held

    for k in range(4):
        write(tmp_path / f"pile/{k:02d}.jsonl", docs("t"))
    write(tmp_path / "pile/eval.jsonl", docs("e"))
    write(tmp_path / "pile/test/00.jsonl", docs("x"))
    (tmp_path / "pile/dataset_info.json").write_text("{}")  # datasets' metadata: no input, no split
    assert splits_held(tmp_path / "pile") == ["train", "test"]
    assert splits_held(tmp_path / "pile", cap=3) == ["train", "test"]  # eval.jsonl is the folder's own: met first
    (tmp_path / "pile/eval.jsonl").unlink()
    assert splits_held(tmp_path / "pile", cap=3) == [] and splits_held(tmp_path / "pile") == ["train", "test"]


def test_split_folders_given_one_by_one_and_files_naming_no_split_are_splits_too(tmp_path, capsys):
    """A split is said by the folder given as by a folder below it: `--in pile/train pile/test` (or the files in
    them, as a shell glob names them) is refused as `--in pile` is, and `--in pile/test --split train` converts
    nothing; a DatasetDict's split folders given alone are their splits. Files whose names say no split are train
    also beside files that name one: shards beside an eval.jsonl are two splits, and --split train takes the shards."""
    pile, out = tmp_path / "pile", tmp_path / "o.arrow"
    write(pile / "train/00.jsonl.zst", docs("train doc"))
    write(pile / "test-0/00.jsonl.zst", docs("TEST DOC"))
    refused = "files of 2 splits (test: 1 file, train: 1 file); --split NAME takes one of them, e.g. --split train\n"
    beside = [pile / "train", pile / "test-0/00.jsonl.zst"]  # a split's folder, and a file of another's: was train
    for given in ([pile], [pile / "train", pile / "test-0"], sorted(pile.glob("*/*.jsonl.zst")), beside):
        code, _, err = to_arrow(capsys, "--in", *given, "--out", out)
        assert code == 2 and err.endswith(refused), err
    assert to_arrow(capsys, "--in", *beside, "--split", "train", "--out", out)[0] == 0
    assert texts_of(out) == ["train doc"]
    named = write(tmp_path / "sp/wiki_train.jsonl", docs("named train"))  # its name says train; a scratch dev/ beside
    extra = write(tmp_path / "sp/dev/extra.jsonl", docs("scratch extra"))  # says nothing: both are train
    assert to_arrow(capsys, "--in", named, extra, "--out", out)[0] == 0
    assert texts_of(out) == ["named train", "scratch extra"]
    code, _, err = to_arrow(capsys, "--in", pile / "test-0", "--split", "train", "--out", out)
    assert (
        code == 2
        and err.startswith("error: --split train: no file of split 'train' in ")
        and err.endswith("test-0 (splits found: test: 1 file)\n")
    )
    assert to_arrow(capsys, "--in", pile / "train", pile / "test-0", "--split", "test", "--out", out)[0] == 0
    assert texts_of(out) == ["TEST DOC"]
    mine = tmp_path / "test_runs"  # the folder a corpus lies in says no split unless named for one alone
    write(mine / "shard_00.jsonl", docs("train 0"))
    write(mine / "shard_01.jsonl", docs("train 1"))
    write(mine / "eval.jsonl", docs("HELD OUT"))
    code, _, err = to_arrow(capsys, "--in", mine, "--out", out)
    assert code == 2 and err.endswith(
        "test_runs holds files of 2 splits (test: 1 file, train: 2 files; a file whose name says no split is train);"
        " --split NAME takes one of them, e.g. --split train\n"
    )
    assert to_arrow(capsys, "--in", mine, "--split", "train", "--out", out)[0] == 0
    assert texts_of(out) == ["train 0", "train 1"]
    scratch = write(tmp_path / "dev/a.jsonl", docs("scratch"))  # a lone dev/ or test/ folder of a file named: no split
    assert to_arrow(capsys, "--in", scratch, mine / "shard_00.jsonl", "--out", out)[0] == 0
    assert texts_of(out) == ["scratch", "train 0"]
    datasets = pytest.importorskip("datasets")
    splits = {"train": ["t"], "unsupervised": ["u"], "validation": ["VALIDATION DOC"]}
    dd = tmp_path / "dd"
    datasets.DatasetDict({k: datasets.Dataset.from_dict({"text": v}) for k, v in splits.items()}).save_to_disk(dd)
    code, _, err = to_arrow(capsys, "--in", dd / "train", dd / "validation", "--out", out)
    assert code == 2 and "(train: 1 file, validation: 1 file); --split NAME" in err, err
    assert to_arrow(capsys, "--in", dd / "unsupervised", "--split", "unsupervised", "--out", out)[0] == 0
    assert texts_of(out) == ["u"]


def test_an_output_that_would_be_read_back_or_replace_a_special_file_is_refused(tmp_path, capsys):
    """--out inside a directory given (rerun, the same command would read its own output; a later conversion of the
    directory its documents twice), named as another input kind (a walk would read Arrow bytes as JSON lines), or
    naming a FIFO or device (the rename would replace it: as root, /dev/null): one line, exit 2, nothing written."""
    src = write(tmp_path / "d/x.jsonl", docs("a", "b"))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    refused = {
        tmp_path / "d/o.arrow": f"--out {tmp_path / 'd/o.arrow'} lies in the input directory {tmp_path / 'd'}: a later"
        f" conversion of {tmp_path / 'd'} would read it back as an input (its documents twice); write it outside,"
        f" e.g. {tmp_path / 'o.arrow'}",
        tmp_path / "raw.jsonl": f"--out {tmp_path / 'raw.jsonl'}: to-arrow writes an Arrow IPC stream, but the name"
        f" says jsonl; name it .arrow (e.g. {tmp_path / 'raw.arrow'})",
        fifo: f"--out {fifo} is a FIFO (named pipe), not a regular file: the output is written under a temp name and"
        " renamed onto its name, which would replace it; give a new path",
    }
    for out, said in refused.items():
        code, _, err = to_arrow(capsys, "--in", tmp_path / "d", "--out", out)
        assert (code, err) == (2, f"error: {said}\n")
    assert fifo.is_fifo() and sorted(p.name for p in tmp_path.iterdir()) == ["d", "fifo"]
    assert sorted(p.name for p in src.parent.iterdir()) == ["x.jsonl"]


def test_a_shard_directory_is_an_input_read_in_its_manifests_order(tmp_path, capsys):
    """What --shard-bytes wrote (training reads it as one corpus) converts again, named or inside a directory walked:
    its shards in order, its manifest no JSON lines."""
    write(tmp_path / "in/x.jsonl", docs(*[f"document {i} " + "word " * 40 for i in range(12)]))
    shards = tmp_path / "corpora/shards"
    assert to_arrow(capsys, "--in", tmp_path / "in", "--out", shards, "--shard-bytes", "1K")[0] == 0
    assert len(list(shards.glob("shard_*.arrow"))) > 2
    (shards / ".nfs0001").write_bytes(b"")  # a hidden file beside them (NFS leaves some) changes nothing
    for given in (shards, shards.parent):
        assert to_arrow(capsys, "--in", given, "--out", tmp_path / "again.arrow")[0] == 0
        assert texts_of(tmp_path / "again.arrow") == [f"document {i} " + "word " * 40 for i in range(12)]
    (shards / "shard_000001.arrow").unlink()
    code, _, err = to_arrow(capsys, "--in", shards, "--out", tmp_path / "again.arrow")
    assert (code, err) == (2, f"error: {shards / 'corpus.json'}: the shard directory lacks shard_000001.arrow, which"
                              " it lists; write it again with to-arrow --shard-bytes\n")  # fmt: skip
    mine = tmp_path / "mine"  # a corpus.json of JSON lines beside other files is JSON lines
    write(mine / "corpus.json", docs("c"))
    write(mine / "more.jsonl", docs("m"))
    assert to_arrow(capsys, "--in", mine, "--out", tmp_path / "again.arrow")[0] == 0
    assert texts_of(tmp_path / "again.arrow") == ["c", "m"]


def test_suffixes_in_any_case_are_read_and_files_left_out_are_told(tmp_path, capsys):
    """.JSONL and .jsonl.GZ are JSON lines; files of no input kind in a directory walked (bz2 shards, .ndjson), and
    text files beside records, are left out with a line saying how many and of what kinds, not without a word (a
    README or a LICENSE, and preprocess's tokenizer record, without one)."""
    d = tmp_path / "d"
    write(d / "a.jsonl", docs("a"))
    write(d / "b.JSONL", docs("b"))
    write(d / "c.jsonl.GZ", gzip.compress(docs("c")))
    for name in ("e.jsonl.bz2", "f.ndjson", "README.md", "LICENSE", "notes.txt", "o.tokenizer.json", "o.bin", "o.idx"):
        write(d / name, b"x\n")
    code, stdout, err = to_arrow(capsys, "--in", d, "--out", tmp_path / "o.arrow")
    assert (code, stdout) == (0, f"wrote {tmp_path / 'o.arrow'}: 3 documents\n"), err
    assert texts_of(tmp_path / "o.arrow") == ["a", "b", "c"]
    assert err.startswith(f"[trnrecipes] {d}: left out 5 files (1 .bin, 1 .bz2, 1 .idx, 1 .ndjson, 1 .txt), not of an"
                          " input kind (")  # fmt: skip
    assert err.endswith("; text files are read only from a folder of text alone, a document each; reading the other"
                        " 3\n") and err.count("\n") == 1, err  # fmt: skip


def test_a_walk_leaves_out_what_is_no_regular_file_and_reads_files_named_as_metadata_away_from_it(tmp_path, capsys):
    """A FIFO in a folder walked was read (its first writer's lines used up by the --text-field check, then lost) or
    hung the conversion; a broken link was a traceback. Both are left out, told. A state.json or x.rejects.jsonl of
    records was passed over everywhere, its documents lost without a word: only a datasets folder's metadata and a
    rejects list or tokenizer record beside its output are."""
    d = tmp_path / "d"
    write(d / "a.jsonl", docs("a"))
    os.mkfifo(d / "b.jsonl")
    (d / "c.jsonl").symlink_to(tmp_path / "gone.jsonl")
    for name in ("state.json", "x.rejects.jsonl", "y.tokenizer.json"):
        write(d / name, docs(name))
    (d / "dataset_infos.json").write_text('{\n  "default": {}\n}\n')  # a Hub download's: no records wherever it is
    write(d / "z.rejects.jsonl", b'{"file": "z", "line": 1, "reason": "r"}\n')  # beside its output z: passed over
    write(d / "z", b"")
    code, stdout, err = to_arrow(capsys, "--in", d, "--out", tmp_path / "o.arrow")
    assert (code, stdout) == (0, f"wrote {tmp_path / 'o.arrow'}: 4 documents\n"), err
    assert texts_of(tmp_path / "o.arrow") == ["a", "state.json", "x.rejects.jsonl", "y.tokenizer.json"]
    assert "left out 3 files (2 not regular files, 1 no suffix)" in err, err
    assert "a FIFO, a socket, a device or a broken link is no file to read; reading the other 4\n" in err, err


def test_a_misnamed_text_field_under_skip_stops_before_reading_the_corpus(tmp_path, capsys):
    """Under skip, a --text-field no record has would reject every record: the whole corpus read (hours at TB scale)
    and listed as rejects before "no documents". The first records of the first JSON-lines file show it at once;
    a corpus where only some records lack the field is converted, those skipped."""
    src = write(tmp_path / "in/a.jsonl.gz", b'{"body": "x"}\n' + b"{broken\n" + docs("a", "b"))
    code, _, err = to_arrow(capsys, "--in", src, "--out", tmp_path / "o.arrow", "--text-field", "body",
                            "--on-bad-record", "skip")  # fmt: skip
    assert code == 0 and texts_of_field(tmp_path / "o.arrow", "body") == ["x"], err
    code, _, err = to_arrow(capsys, "--in", src.parent, "--out", tmp_path / "o2.arrow", "--text-field", "content",
                            "--on-bad-record", "skip")  # fmt: skip
    assert (code, err) == (2, f"error: --text-field content: none of the first records of {src} has it (they have:"
                              " body, text); name the field that holds the text\n")  # fmt: skip
    assert left_in(tmp_path) == ["in", "o.arrow", "o.arrow.rejects.jsonl"]


def test_an_arrow_file_beside_the_raw_file_it_was_made_from_is_refused_in_a_walk(tmp_path, capsys):
    """sbatch's advice converts raw/web.jsonl into raw/web.arrow; a later walk of raw/ would read both, its
    documents twice, without a word: refused, naming the pair. Named one by one, each is read as given."""
    raw = tmp_path / "raw"
    write(raw / "web.jsonl.gz", docs("a", "b"))
    assert to_arrow(capsys, "--in", raw / "web.jsonl.gz", "--out", raw / "web.arrow")[0] == 0
    code, _, err = to_arrow(capsys, "--in", raw, "--out", tmp_path / "o.arrow")
    assert (code, err) == (2, f"error: {raw / 'web.arrow'} lies beside web.jsonl.gz, the file it was likely converted"
                              f" from: walking {raw} would read their documents twice; move web.arrow out of {raw}, or"
                              " name the files to read\n")  # fmt: skip
    assert to_arrow(capsys, "--in", raw / "web.arrow", "--out", tmp_path / "o.arrow")[0] == 0


@pytest.mark.parametrize("how", ["symlink", "hardlink", "inside a directory given"])
def test_the_same_file_twice_is_refused(tmp_path, capsys, how):
    shard = write(tmp_path / "in/a.jsonl", docs("once"))
    if how == "symlink":
        os.symlink(shard, tmp_path / "link.jsonl")
        second, expected = tmp_path / "link.jsonl", f"{shard} and {tmp_path / 'link.jsonl'} are the same file"
    elif how == "hardlink":
        os.link(shard, tmp_path / "hard.jsonl")
        second, expected = tmp_path / "hard.jsonl", f"{shard} and {tmp_path / 'hard.jsonl'} are the same file"
    else:
        second, expected = tmp_path / "in", f"{shard} is given twice (or also inside a directory given)"
    code, _, err = to_arrow(capsys, "--in", shard, second, "--out", tmp_path / "o.arrow")
    assert code == 2 and err.startswith(f"error: {expected}") and err.count("\n") == 1, err
    assert not (tmp_path / "o.arrow").exists()


def test_a_folder_with_nothing_to_read_names_what_it_holds_and_what_is_accepted(tmp_path, capsys):
    for name in ("a.csv", "b.csv", "notes"):
        write(tmp_path / "in" / name, b"x\n")
    code, _, err = to_arrow(capsys, "--in", tmp_path / "in", "--out", tmp_path / "o.arrow")
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: directory {tmp_path / 'in'} holds no input to read (2 .csv, 1 no suffix); accepted:")
    assert ".jsonl, .json (JSON lines; also .gz, .zst), .parquet, .arrow" in err


# ---------------------------------------------------------------- bad records


def bad_inputs(root: Path) -> dict[str, tuple[Path, str, str]]:
    """kind -> (a file with one bad record among good ones, its place, the reason's start)."""
    nulls = pa.table({"text": pa.array(["good", None, "good"], pa.large_string())})
    with pa.OSFile(str(root / "nulls.arrow"), "wb") as sink, pa.ipc.new_stream(sink, nulls.schema) as writer:
        writer.write_table(nulls)
    made = {
        "malformed JSON": (write(root / "json.jsonl", docs("good") + b'{"text": "cut\n'), ":2", "not valid JSON ("),
        "null text": (
            write(root / "null.jsonl.gz", docs("good") + lines({"text": None})),
            ":2",
            "field 'text' is null",
        ),
        "no text field": (
            write(root / "field.jsonl", docs("good") + lines({"body": "b"})),
            ":2",
            "no field 'text' (has: body)",
        ),
        "null Parquet row": (parquet(root / "null.parquet", ["good", "good", None]), ": row 2", "text is null"),
        "null Arrow row": (root / "nulls.arrow", ": row 1", "text is null"),
        "invalid UTF-8": (write(root / "utf8.txt", b"good\n\xff\xfe bad\n"), ":2", "invalid UTF-8 ("),
        "invalid UTF-8 in JSON": (write(root / "u.jsonl.zst", b'{"text": "\xff"}\n'), ":1", "invalid UTF-8 ("),
        "nesting too deep for json": (
            write(root / "deep.jsonl", docs("good") + b'{"text": "a", "n": ' + b"[" * 5000 + b"]" * 5000 + b"}\n"),
            ":2",
            "JSON nested too deep for Python's json module to read (maximum recursion depth exceeded",
        ),
        "a lone surrogate escape": (
            write(root / "surrogate.json", docs("good") + b'{"text": "cut \\ud83d"}\n'),
            ":2",
            "field 'text' holds an unpaired surrogate escape (\\ud83d): not encodable as UTF-8",
        ),
    }
    return {kind: (path, f"{path}{place}", reason) for kind, (path, place, reason) in made.items()}


@pytest.mark.parametrize(
    "kind",
    ["malformed JSON", "null text", "no text field", "null Parquet row", "null Arrow row", "invalid UTF-8",
     "invalid UTF-8 in JSON", "nesting too deep for json", "a lone surrogate escape"],
)  # fmt: skip
def test_a_bad_record_is_an_error_naming_its_place_when_it_is_met(tmp_path, capsys, kind):
    (tmp_path / "in").mkdir()
    path, place, reason = bad_inputs(tmp_path / "in")[kind]
    later = write(tmp_path / "in/later.parquet", b"PAR1 and nothing a Parquet reader can read")  # never opened
    out = tmp_path / "out/o.arrow"
    code, _, err = to_arrow(capsys, "--in", path, later, "--out", out)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: {place}: {reason}"), err
    assert err.endswith(f"; --on-bad-record skip skips such records and lists them in {out}.rejects.jsonl\n"), err
    assert left_in(tmp_path / "out") == []


def test_skip_lists_each_rejected_record_with_place_and_reason_and_prints_the_count(tmp_path, capsys):
    root = tmp_path / "in"
    root.mkdir()
    bad = bad_inputs(root)
    files = [path for path, _, _ in bad.values()]
    out, rejects = tmp_path / "o.arrow", tmp_path / "o.arrow.rejects.jsonl"
    code, stdout, _ = to_arrow(capsys, "--in", *files, "--out", out, "--on-bad-record", "skip")
    assert code == 0 and stdout == f"wrote {out}: 10 documents, rejected 9 bad records (listed in {rejects})\n"
    assert texts_of(out) == ["good"] * 10
    listed = [json.loads(line) for line in rejects.read_text().splitlines()]
    by_place = {f"{r['file']}{':' + str(r['line']) if 'line' in r else ': row ' + str(r['row'])}": r for r in listed}
    assert sorted(by_place) == sorted(place for _, place, _ in bad.values())
    for _, place, reason in bad.values():
        assert by_place[place]["reason"].startswith(reason) and set(by_place[place]) in (
            {"file", "line", "reason"},
            {"file", "row", "reason"},
        )
    # A later run that meets no bad record (error, the default) removes the list: it described the output replaced.
    clean = write(root / "clean.jsonl", docs("clean"))
    assert to_arrow(capsys, "--in", clean, "--out", out)[:2] == (0, f"wrote {out}: 1 document\n")
    assert not rejects.exists()


@pytest.mark.parametrize("kind", ["parquet", "arrow"])
def test_columnar_batches_stay_arrow_where_plain_and_go_row_by_row_where_not(tmp_path, capsys, monkeypatch, kind):
    """A Parquet or Arrow file's batches of plain text are taken as Arrow whole, the others row by row: the same
    documents as the row-by-row reader gives (trnrecipes.data.arrow.file_records), blank ones left out, and its bad
    rows (a null, invalid UTF-8) named by their row in the file, batches after them counted on. Batches of 4 rows."""
    from trnrecipes.data import arrow
    from trnrecipes.data.bad_records import BadRecords
    from trnrecipes.data.inputs import find_inputs

    monkeypatch.setattr(arrow, "COLUMNAR_ROWS", 4)
    plain = [f"document {i}" for i in range(4)]
    invalid = pa.Array.from_buffers(
        pa.string(), 1, [None, pa.py_buffer(b"\0\0\0\0\2\0\0\0"), pa.py_buffer(b"\xff\xfe")]
    )
    batches = [
        pa.array(plain, pa.string()),
        pa.array(["a", None, "  ", "b"], pa.string()),  # a null (row 5) and a blank document (row 6)
        pa.concat_arrays([pa.array(["c", "d", "e"], pa.string()), invalid]),  # invalid UTF-8 (row 11)
        pa.array(["last", "\u00e9t\u00e9", "\t", "end"], pa.string()),
    ]
    path = tmp_path / f"in.{kind}"
    table = pa.Table.from_batches([pa.record_batch([b], names=["text"]) for b in batches])
    if kind == "parquet":
        pq.write_table(table, path, row_group_size=4)
    else:
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    (f,) = find_inputs([path])
    rows = [text for text, _ in arrow.file_records(f, "text", BadRecords("skip", None), None)]
    blocks = [texts for texts, _ in arrow.file_texts(f, "text", BadRecords("skip", None), None)]
    assert [isinstance(b, pa.Array) for b in blocks] == [True, False, False, True]  # the plain batches stay Arrow
    out, rejects = tmp_path / "o.arrow", tmp_path / "o.arrow.rejects.jsonl"
    code, stdout, _ = to_arrow(capsys, "--in", path, "--out", out, "--on-bad-record", "skip")
    assert code == 0 and texts_of(out) == [t for t in rows if t.strip()], stdout
    assert texts_of(out)[:4] == plain and texts_of(out)[-1] == "end"
    listed = [json.loads(line) for line in rejects.read_text().splitlines()]
    assert [(r["row"], r["reason"].split(" (")[0]) for r in listed] == [(5, "text is null"), (11, "invalid UTF-8")]


def test_a_large_stored_batch_comes_in_blocks_of_about_a_json_block_of_text(tmp_path, monkeypatch):
    """One record batch of 3,000 documents (an Arrow file's batch can hold millions: ours hold 131,072) comes in
    blocks of about JSON_BLOCK_BYTES of text, as JSON lines do, so preprocess tokenizes no more at a time; a
    dictionary-encoded column (as Parquet may store text) is text too."""
    from trnrecipes.data import arrow
    from trnrecipes.data.bad_records import BadRecords
    from trnrecipes.data.inputs import find_inputs

    monkeypatch.setattr(arrow, "JSON_BLOCK_BYTES", 1000)
    texts = [f"document number {i:05d}" for i in range(3000)]  # 21 bytes each: 47 a block
    path = tmp_path / "big.arrow"
    table = pa.table({"text": pa.array(texts, pa.string()).dictionary_encode()})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    (f,) = find_inputs([path])
    blocks = [b for b, _ in arrow.file_texts(f, "text", BadRecords("error", None), None)]
    assert all(isinstance(b, pa.Array) and len(b) == 47 for b in blocks[:-1]) and len(blocks) == -(-3000 // 47)
    assert [t for b in blocks for t in b.to_pylist()] == texts


def test_max_bad_records_stops_once_more_are_met_and_writes_nothing(tmp_path, capsys):
    src = write(tmp_path / "in/c.jsonl", docs("a") + b"x\n" + docs("b") + b"y\n" + b"z\n" + docs("c"))
    out = tmp_path / "out/o.arrow"
    code, _, err = to_arrow(capsys, "--in", src, "--out", out, "--on-bad-record", "skip", "--max-bad-records", "2")
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: {src}:5: not valid JSON (") and "bad record 3, more than --max-bad-records 2" in err
    assert f"(the first: {src}:2: not valid JSON (" in err and left_in(tmp_path / "out") == []
    code, stdout, _ = to_arrow(capsys, "--in", src, "--out", out, "--on-bad-record", "skip", "--max-bad-records", "3")
    assert code == 0 and ", rejected 3 bad records" in stdout and texts_of(out) == ["a", "b", "c"]
    code, _, err = to_arrow(capsys, "--in", src, "--out", out, "--max-bad-records", "3")
    assert code == 2 and err.startswith("error: --max-bad-records 3 applies to --on-bad-record skip"), err


def test_on_bad_utf8_is_an_alias_with_a_deprecation_note(tmp_path, capsys):
    src = write(tmp_path / "t.txt", b"good\n\xff bad\n")
    out = tmp_path / "o.arrow"
    code, stdout, err = to_arrow(capsys, "--in", src, "--out", out, "--on-bad-utf8", "skip")
    assert code == 0 and err.startswith("note: --on-bad-utf8 is deprecated: it is now --on-bad-record skip")
    assert "rejected 1 bad record (" in stdout and '"line": 2' in Path(f"{out}.rejects.jsonl").read_text()
    code, _, err = to_arrow(capsys, "--in", src, "--out", out, "--on-bad-utf8", "fail")
    assert code == 2 and f"error: {src}:2: invalid UTF-8 (" in err


def test_the_rejects_file_goes_through_the_output_guard(tmp_path, capsys):
    src = write(tmp_path / "c.jsonl", docs("a") + b"x\n")
    out = tmp_path / "o.arrow"
    os.symlink(src, f"{out}.rejects.jsonl")  # writing it would overwrite the input through the link
    code, _, err = to_arrow(capsys, "--in", src, "--out", out, "--on-bad-record", "skip")
    assert code == 2 and err.startswith(f"error: the rejects file {out}.rejects.jsonl is a symbolic link"), err
    assert src.read_bytes() == docs("a") + b"x\n" and not out.exists()


# ---------------------------------------------------------------- preprocess


def test_preprocess_reads_the_same_inputs_with_the_same_policies(tmp_path, capsys, hub):
    parquet(hub / "data/train-00001-of-00002.parquet", ["train 2", None])  # a null row in the second train shard
    prefix = tmp_path / "out/tok"
    argv = ["data", "preprocess", "--in", str(hub), "--tokenizer", str(GPT2), "--out", str(prefix)]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {hub} holds files of 2 splits (train: 2 files, validation: 1 file); --split NAME")
    assert main([*argv, "--split", "train"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {hub}/data/train-00001-of-00002.parquet: row 1: text is null; --on-bad-record skip")
    assert not (tmp_path / "out").exists() or left_in(tmp_path / "out") == []  # nothing partial, no temp files
    assert main([*argv, "--split", "train", "--on-bad-record", "skip"]) == 0
    rejects = tmp_path / "out/tok.rejects.jsonl"
    assert capsys.readouterr().out.startswith(
        f"wrote {prefix}.bin/.idx: 3 documents, rejected 1 bad record (listed in {rejects})"
    )
    assert [json.loads(line) for line in rejects.read_text().splitlines()] == [
        {"file": f"{hub}/data/train-00001-of-00002.parquet", "row": 1, "reason": "text is null"}
    ]
    assert left_in(tmp_path / "out") == ["tok.bin", "tok.idx", "tok.rejects.jsonl", "tok.tokenizer.json"]


# ---------------------------------------------------------------- docs/data.md


def documented_commands() -> list[str]:
    """The commands of docs/data.md's recipes by corpus shape."""
    text = (REPO / "docs/data.md").read_text()
    block = text.split("Recipes by corpus shape", 1)[1].split("```", 2)[1]
    return [line for line in block.splitlines() if line and not line.startswith("#")]


def test_the_documented_recipes_run(tmp_path, capsys, monkeypatch):
    datasets = pytest.importorskip("datasets")
    fsx = tmp_path / "fsx"
    write(fsx / "pile/train/00.jsonl.zst", docs("pile 0", "pile 1"))
    write(fsx / "pile/train/01.jsonl.zst", docs("pile 2"))
    write(fsx / "pile/val.jsonl.zst", docs("pile val"))
    write(fsx / "pile/test.jsonl.zst", docs("pile test"))
    parquet(fsx / "hub/dataset/data/train-00000-of-00001.parquet", ["hub 0", "hub 1"])
    parquet(fsx / "hub/dataset/data/validation-00000-of-00001.parquet", ["hub val"])
    write(fsx / "c4/en/c4-train.00000-of-01024.json.gz", docs("c4 0"))
    write(fsx / "c4/en/c4-validation.00000-of-00008.json.gz", docs("c4 val"))
    splits = {
        "train": datasets.Dataset.from_dict({"text": ["saved"]}),
        "test": datasets.Dataset.from_dict({"text": ["x"]}),
    }
    datasets.DatasetDict(splits).save_to_disk(str(fsx / "datasets/my_corpus"))
    write(fsx / "books/a.txt", b"book a\nits second line")
    write(fsx / "books/more/b.md", b"book b")
    write(fsx / "crawl/0.jsonl", docs("crawl 0") + b"<html>\n" + docs("crawl 1"))
    expected = {"pile-train": ["pile 0", "pile 1", "pile 2"], "hub-train": ["hub 0", "hub 1"], "c4-train": ["c4 0"],
                "my_corpus": ["saved"], "books": ["book a\nits second line", "book b"], "crawl": ["crawl 0", "crawl 1"],
                "pile-val": ["pile val"]}  # fmt: skip
    monkeypatch.chdir(REPO)  # data/tokenizers/gpt2, as the docs name it
    commands = documented_commands()
    assert len(commands) == 8
    for command in commands:
        piped, _, command = command.rpartition(" | ")
        argv = shlex.split(command.replace("/fsx/", f"{fsx}/"))
        assert argv[:2] == ["trnrecipes", "data"], command
        if piped:  # zstdcat FILE: what it would print, on standard input
            zst = Path(shlex.split(piped.replace("/fsx/", f"{fsx}/"))[1])
            stdin = pa.input_stream(str(zst), compression="zstd").read()
            monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
        capsys.readouterr()
        assert main(argv[1:]) == 0, (command, capsys.readouterr().err)
        out = argv[argv.index("--out") + 1]
        if argv[2] == "to-arrow":
            assert texts_of(Path(out)) == expected[Path(out).stem], command
        else:
            assert re.match(rf"wrote {re.escape(out)}\.bin/\.idx: 3 documents", capsys.readouterr().out), command


def test_a_long_path_in_a_message_keeps_its_file_name():
    """Messages list names cut to 80 characters: a path keeps its end, where a.jsonl cut at the end read a.json."""
    long = "/fsx/" + "d" * 100 + "/a.jsonl"
    shown = listed([long, "b.jsonl"])
    first = shown.split(", ")[0]
    assert len(first) == 80 and first.startswith("/fsx/ddd") and first.endswith("ddd/a.jsonl") and "..." in first
    assert shown.endswith(", b.jsonl")


def test_inputs_in_shapes_a_user_may_not_see_are_read_or_refused_in_one_line(tmp_path, capsys, monkeypatch):
    """From a hostile pass over odd inputs: a UTF-8 BOM (Windows tools write one) is no part of the first record or
    document (it made line 1 a bad record, and stayed in a text); a .json holding one JSON array is told so, not
    rejected a line at a time; an Arrow stream cut short at a batch's end was read as whole, the batches after the
    cut lost without a word; standard input closed, and --out -, were a traceback and a file named '-'."""
    bom = b"\xef\xbb\xbf"
    for name in ("b.jsonl", "b.jsonl.gz"):
        write(tmp_path / name, bom + docs("a", "b"))
        assert to_arrow(capsys, "--in", tmp_path / name, "--out", tmp_path / "o.arrow")[0] == 0
        assert texts_of(tmp_path / "o.arrow") == ["a", "b"]
    write(tmp_path / "texts/t.txt", bom + b"a text")
    assert to_arrow(capsys, "--in", tmp_path / "texts", "--out", tmp_path / "o.arrow")[0] == 0
    assert texts_of(tmp_path / "o.arrow") == ["a text"]
    src = write(tmp_path / "array.json", b'[\n{"text": "a"},\n{"text": "b"}\n]\n')
    convert = f"JSON lines are a record a line (as .json and .jsonl are read): jq -c '.[]' {src} > records.jsonl"
    code, _, err = to_arrow(capsys, "--in", src, "--out", tmp_path / "o.arrow", "--on-bad-record", "skip")
    assert (code, err) == (2, f"error: {src}: one JSON array, not JSON lines; {convert}\n")
    write(src, b'[{"text": "a"}, {"text": "b"}]\n')  # on one line: a bad record (a file's first may be one), told why
    code, _, err = to_arrow(capsys, "--in", src, "--out", tmp_path / "o.arrow")
    assert code == 2 and err.startswith(f"error: {src}:1: a JSON list, not an object (a record); if the file is one"
                                        f" JSON array, {convert}; --on-bad-record skip"), err  # fmt: skip
    for cut_gz in (gzip.compress(docs("a"))[:5], b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03garbage"):
        (src := tmp_path / "cut.jsonl.gz").write_bytes(cut_gz)  # as it is (write() would compress it)
        code, _, err = to_arrow(capsys, "--in", src, "--out", tmp_path / "o.arrow")  # its first bytes: a traceback
        assert code == 2 and err.startswith(f"error: {src}: not a readable gzip file (") and err.count("\n") == 1
    table = pa.table({"text": [f"r{n}" for n in range(300)]})
    whole = pa.BufferOutputStream()
    with pa.ipc.new_stream(whole, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=100):
            writer.write_batch(batch)
    data = whole.getvalue().to_pybytes()
    cut = tmp_path / "cut.arrow"
    cut.write_bytes(data[: table.schema.serialize().size + table.to_batches(max_chunksize=100)[0].serialize().size])
    assert pa.ipc.open_stream(pa.memory_map(str(cut))).read_all().num_rows == 100  # pyarrow reads it as whole
    code, _, err = to_arrow(capsys, "--in", cut, "--out", tmp_path / "o.arrow")
    assert (code, err) == (2, f"error: {cut}: an Arrow stream without its end-of-stream marker: cut short (a copy or"
                              " a write interrupted?), or written by a writer never closed; copy or write it"
                              " again\n")  # fmt: skip
    code, _, err = to_arrow(capsys, "--in", tmp_path / "b.jsonl", "--out", "-")
    assert (code, err) == (2, "error: --out -: name a file to write (nothing is written to standard output)\n")
    monkeypatch.setattr("sys.stdin", None)
    code, _, err = to_arrow(capsys, "--in", "-", "--out", tmp_path / "o.arrow")
    assert (code, err) == (2, "error: --in -: standard input is closed; pipe the JSON lines in (... | trnrecipes data"
                              " --in -)\n")  # fmt: skip


def test_an_input_removed_after_it_was_listed_is_one_line(tmp_path, capsys, monkeypatch):
    from trnrecipes.data import parallel

    a, b = write(tmp_path / "in/a.jsonl", docs("a")), write(tmp_path / "in/b.jsonl", docs("b"))
    convert_unit = parallel.convert_unit

    def removed_first(task, tick):
        b.unlink(missing_ok=True)
        return convert_unit(task, tick)

    monkeypatch.setattr(parallel, "convert_unit", removed_first)
    code, _, err = to_arrow(capsys, "--in", a, b, "--out", tmp_path / "o.arrow", "--workers", 1)
    assert code == 2 and err.endswith(f"error: {b}: gone since the inputs were listed (removed or renamed?); run the"
                                      " command again\n"), err  # fmt: skip


def test_an_out_ending_in_a_slash_is_a_directory_not_a_file_named_like_one(tmp_path, capsys):
    """`--out DIR/` wrote a plain file named DIR and reported `wrote DIR/`; with --shard-bytes it is the directory."""
    write(tmp_path / "in/a.jsonl", docs("doc"))
    out = f"{tmp_path / 'corpus'}/"
    code, _, err = to_arrow(capsys, "--in", tmp_path / "in", "--out", out)
    assert code == 2 and err == (
        f"error: --out {out}: names a directory, but to-arrow writes one Arrow file: name the file (e.g."
        f" {tmp_path / 'corpus/corpus.arrow'}), or give --shard-bytes to write a shard directory there\n"
    )
    assert not (tmp_path / "corpus").exists()
    assert to_arrow(capsys, "--in", tmp_path / "in", "--out", out, "--shard-bytes", "1M")[0] == 0
    assert [texts_of(s) for s in sorted((tmp_path / "corpus").glob("shard_*.arrow"))] == [["doc"]]
