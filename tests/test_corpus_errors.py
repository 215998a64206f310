"""Corpus errors are input errors, found early: a null text is refused when the corpus is opened and when the job is
rendered, a row the tokenizer cannot read stops the run as bad input (no requeue), and labels and row numbers follow
one rule in to-arrow, training and predict."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from conftest import REPO

from trnrecipes.config.recipe import load_recipe
from trnrecipes.data import DataError
from trnrecipes.data.arrow import ArrowDocuments, read_arrow, read_table, to_arrow
from trnrecipes.data.classify import read_labels
from trnrecipes.data.pack import PackedStream, Prefetcher
from trnrecipes.infer import read_row_labels, read_rows
from trnrecipes.jobs.corpus_check import corpus_problems
from trnrecipes.jobs.render import render_job

TEXTS = [f"document {i} about nothing in particular" for i in range(40)]


def write_stream(path: Path, columns: dict[str, pa.Array], batch_rows: int = 16) -> Path:
    """An Arrow IPC stream in several record batches, as to-arrow writes one."""
    table = pa.table(columns)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=batch_rows)
    return path


def corpus_with_null(path: Path, row: int = 21) -> Path:
    texts = [None if i == row else t for i, t in enumerate(TEXTS)]
    return write_stream(path, {"text": pa.array(texts, pa.large_string())})


def test_a_null_text_is_refused_when_the_corpus_is_opened(tmp_path: Path):
    path = corpus_with_null(tmp_path / "c.arrow")
    message = r"c\.arrow: column 'text' has 1 null row\(s\), the first row 21; every row needs text"
    with pytest.raises(DataError, match=message):
        read_arrow(path, "text")
    with pytest.raises(DataError, match=message):
        ArrowDocuments(path, tokenizer=None, text_field="text")


def test_the_command_a_null_text_names_writes_a_corpus_without_it(tmp_path: Path):
    """The fix the message names is run as given (NEW.arrow its placeholder): it writes the corpus less that row."""
    import re
    import shlex

    from trnrecipes.cli import main

    path = corpus_with_null(tmp_path / "c.arrow")
    with pytest.raises(DataError) as refused:
        read_arrow(path, "text")
    command = re.search(r"`(trnrecipes data to-arrow [^`]*)`", str(refused.value)).group(1)
    assert main(shlex.split(command.replace("NEW.arrow", str(tmp_path / "new.arrow")))[1:]) == 0
    assert read_arrow(tmp_path / "new.arrow", "text").to_pylist() == TEXTS[:21] + TEXTS[22:]


def test_the_command_a_null_text_in_a_shard_names_writes_the_whole_shard_directory_again(tmp_path: Path):
    """Of a shard, the advice copied that one shard, which does not mend the corpus data.path names."""
    import re
    import shlex

    from trnrecipes.cli import main

    shards = tmp_path / "shards"
    whole = write_stream(tmp_path / "whole.arrow", {"text": pa.array(TEXTS * 40, pa.large_string())})
    assert main(["data", "to-arrow", "--in", str(whole), "--out", str(shards), "--shard-bytes", "8K"]) == 0
    first = sorted(shards.glob("shard_*.arrow"))[0]
    rows = read_table(first).column("text").to_pylist()
    write_stream(first, {"text": pa.array([None, *rows[1:]], pa.large_string())})  # its row count kept
    (problem,) = corpus_problems(load_recipe("llama2-tiny", overrides=[f"data.path={shards}"]), REPO)[0]
    command = re.search(r"`(trnrecipes data to-arrow [^`]*)`", problem).group(1)
    assert f"--in {shards} --out NEW_DIR --shard-bytes " in command
    assert main(shlex.split(command.replace("NEW_DIR", str(tmp_path / "mended")))[1:]) == 0
    mended = load_recipe("llama2-tiny", overrides=[f"data.path={tmp_path / 'mended'}"])
    assert corpus_problems(mended, REPO) == ([], [])


def test_train_on_a_corpus_with_a_null_row_exits_2_and_records_it_as_fatal(tmp_path: Path):
    """Exit 2 with one line naming the file and the row, and the fatal file run.sbatch reads so as not to requeue."""
    corpus, fatal = corpus_with_null(tmp_path / "nulls.arrow", row=3), tmp_path / "logs" / "fatal"
    overrides = ["cluster.workers_per_node=1", f"run_dir={tmp_path}/run", f"data.path={corpus}"]
    done = subprocess.run(
        [sys.executable, "-m", "trnrecipes", "train", "--config", "llama2-tiny", *overrides],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**os.environ, "TRNRECIPES_FATAL_FILE": str(fatal)},
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: {corpus}: column 'text' has 1 null row(s), the first row 3;"), done.stderr
    assert "Traceback" not in done.stderr and line in fatal.read_text()


class RefusingTokenizer:
    """Refuses one text, as a tokenizer refuses a value it cannot encode."""

    eos_id = 0

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        if "poison" in texts:
            raise TypeError("TextEncodeInput must be Union[TextInputSequence, Tuple[InputSequence, InputSequence]]")
        return [np.arange(1, len(t.split()) + 1, dtype=np.int64) for t in texts]


def test_a_row_the_tokenizer_refuses_stops_the_stream_as_bad_input_naming_file_and_row(tmp_path: Path):
    texts = [*TEXTS[:29], "poison", *TEXTS[30:]]
    path = write_stream(tmp_path / "c.arrow", {"text": pa.array(texts, pa.large_string())})
    docs = ArrowDocuments(path, RefusingTokenizer())
    stream = Prefetcher(iter(PackedStream(docs, np.arange(len(texts)), seq_len=8, shuffle=False)))
    with pytest.raises(DataError, match=r"c\.arrow: row 29 cannot be read or tokenized \(TextEncodeInput must be"):
        list(stream)  # raised in the prefetch thread, re-raised here unchanged
    stream.close()


class BrokenTokenizer(RefusingTokenizer):
    """Fails on every text: a bug in the code, which no row is to blame for."""

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        raise TypeError("a bug, not the data")


def test_a_failure_every_row_meets_is_not_blamed_on_the_first_row(tmp_path: Path):
    path = write_stream(tmp_path / "c.arrow", {"text": pa.array(TEXTS, pa.large_string())})
    with pytest.raises(TypeError, match="a bug, not the data"):  # as raised: a crash, not bad input
        ArrowDocuments(path, BrokenTokenizer()).tokens([0, 1, 2])


def test_invalid_utf8_in_an_arrow_row_is_named(tmp_path: Path):
    offsets = pa.py_buffer(np.array([0, 2, 4], dtype=np.int64).tobytes())
    bad = pa.Array.from_buffers(pa.large_string(), 2, [None, offsets, pa.py_buffer(b"ok\xff\xfe")])
    docs = ArrowDocuments(write_stream(tmp_path / "c.arrow", {"text": bad}), RefusingTokenizer())
    with pytest.raises(DataError, match=r"c\.arrow: row 1 cannot be read or tokenized \('utf-8' codec"):
        docs.tokens([0, 1])


def test_sbatch_refuses_a_corpus_with_nulls(cli, tmp_path: Path):
    corpus, out = corpus_with_null(tmp_path / "nulls.arrow", row=7), tmp_path / "job"
    done = cli("sbatch", "--recipe", "llama2-tiny", "--nodes", "1", "--out", str(out), "--overrides",
               f"data.path={corpus}")  # fmt: skip
    assert done.returncode == 2 and done.stderr.count("\n") == 2, done.stderr
    problem = done.stderr.splitlines()[1]
    assert problem.startswith(f"  data.path {corpus}: column 'text' has 1 null row(s), the first row 7;"), problem
    assert not out.exists()
    # A corpus that is not there yet (from this host: --no-data-check) is not opened: the job dir is written.
    done = cli("sbatch", "--recipe", "llama2-tiny", "--nodes", "1", "--out", str(out), "--no-data-check",
               "--overrides", f"data.path={tmp_path}/later.arrow")  # fmt: skip
    assert done.returncode == 0, done.stderr


def test_sbatch_refuses_a_classification_holdout_with_nulls(cli, tmp_path: Path):
    holdout, out = corpus_with_null(tmp_path / "holdout.arrow", row=3), tmp_path / "job"
    done = cli("sbatch", "--recipe", "bert-tiny", "--nodes", "1", "--out", str(out), "--overrides",
               f"data.eval_path={holdout}")  # fmt: skip
    assert (
        done.returncode == 2
        and f"  data.eval_path {holdout}: column 'text' has 1 null row(s), the first row 3;" in done.stderr
    )
    assert not out.exists()


def test_the_render_check_says_it_was_skipped_without_pyarrow(tmp_path: Path, monkeypatch):
    corpus = corpus_with_null(tmp_path / "n.arrow")
    recipe = load_recipe("llama2-tiny", nodes=1, overrides=f"data.path={corpus}")
    (problem,), notes = corpus_problems(recipe, REPO)
    assert "null row(s)" in problem and notes == []
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if not installed: sbatch needs only the base deps
    assert corpus_problems(recipe, REPO) == (
        [],
        [f"data.path {corpus}: its documents not checked (pyarrow is not installed here; the pre-flight checks them)"],
    )
    assert "run.sbatch" in render_job(recipe, tmp_path / "job", "cmd").files


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_to_arrow_refuses_a_label_beyond_int64_in_one_line(cli, tmp_path: Path):
    src = write_lines(tmp_path / "big.jsonl", ['{"text": "a", "label": 0}', json.dumps({"text": "b", "label": 2**64})])
    done = cli("data", "to-arrow", "--in", str(src), "--out", str(tmp_path / "o.arrow"), "--label-field", "label")
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert f"big.jsonl:2: label {2**64} is not a class id (an integer 0, 1, ... up to 2**63 - 1" in done.stderr
    write_lines(src, ['{"text": "a", "label": ' + "9" * 5000 + "}"])  # beyond what int() parses
    done = cli("data", "to-arrow", "--in", str(src), "--out", str(tmp_path / "o.arrow"), "--label-field", "label")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "big.jsonl:1: label <an integer of 16610 bits> is not a class id (an integer 0, 1," in done.stderr


def test_bool_labels_are_class_ids_0_and_1_for_to_arrow_training_and_predict(tmp_path: Path):
    src = write_lines(tmp_path / "b.jsonl", ['{"text": "yes", "label": true}', '{"text": "no", "label": false}'])
    to_arrow([src], tmp_path / "o.arrow", progress=False, label_field="label")
    assert read_table(tmp_path / "o.arrow").column("label").to_pylist() == [1, 0]
    assert read_row_labels(src, "label", 2, required=True).tolist() == [1, 0]
    bools = write_stream(tmp_path / "bools.arrow", {"text": pa.array(["yes", "no"]), "label": pa.array([True, False])})
    assert read_labels(bools, "label", 2).tolist() == [1, 0]
    one_class = r"b\.jsonl: row 0 \(line 1\): label True is not a class id \(an integer in \[0, 1\)"
    with pytest.raises(DataError, match=one_class):
        read_row_labels(src, "label", 1, required=True)


def test_predict_rows_are_non_blank_lines_numbered_from_0_in_every_message(tmp_path: Path):
    txt = write_lines(tmp_path / "t.txt", ["first", "", "   ", "second"])
    assert read_rows(txt, "text").to_pylist() == ["first", "second"]  # as jsonl: a blank line is no row
    jsonl = write_lines(tmp_path / "r.jsonl", ['{"text": "a", "label": 0}', "", '{"text": "b"}', '{"text": null}'])
    with pytest.raises(DataError, match=r"r\.jsonl: row 2 \(line 4\): field 'text' is null"):
        read_rows(jsonl, "text")
    with pytest.raises(DataError, match=r"r\.jsonl: row 1 \(line 3\): no 'label' \(other rows have one\)"):
        read_row_labels(jsonl, "label", 2, required=False)


def test_predict_undecodable_utf8_suggests_what_predict_can_do(tmp_path: Path):
    path = tmp_path / "r.jsonl"
    path.write_bytes(b'{"text": "a"}\n\n{"text": "\xff"}\n')
    with pytest.raises(DataError) as err:
        read_rows(path, "text")
    assert str(err.value).startswith(f"{path}: row 1 (line 3): undecodable UTF-8")
    assert "--on-bad-utf8" not in str(err.value) and "trnrecipes data to-arrow" in str(err.value)
