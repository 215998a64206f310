"""`trnrecipes data to-arrow` from what users have (docs/data.md, "Bring your data"): Parquet files and shard
directories, a `datasets` save_to_disk directory, into ONE Arrow file in record batches of 1M rows (one, for these),
or of --batch-rows; bad inputs are one line and leave no output."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trnrecipes.cli import main

TEXTS = [f"document {i}: " + "word " * (i % 7) for i in range(2500)]


def batches_of(path: Path) -> list[int]:
    with pa.ipc.open_stream(pa.memory_map(str(path))) as reader:
        return [b.num_rows for b in reader]


def texts_of(path: Path) -> list[str]:
    return pa.ipc.open_stream(pa.memory_map(str(path))).read_all().column("text").to_pylist()


def test_parquet_files_and_shard_directories_become_one_record_batch(tmp_path, capsys):
    shards = tmp_path / "shards" / "data"
    shards.mkdir(parents=True)
    for k, start in enumerate(range(0, 2500, 1000)):  # three shards, each in several row groups
        rows = range(start, min(start + 1000, len(TEXTS)))
        table = pa.table({"text": [TEXTS[i] for i in rows], "label": [i % 2 for i in rows]})
        pq.write_table(table, shards / f"train-{k:05d}-of-00003.parquet", row_group_size=300)
    out = tmp_path / "corpus.arrow"
    assert main(["data", "to-arrow", "--in", str(tmp_path / "shards"), "--out", str(out)]) == 0
    assert batches_of(out) == [2500] and texts_of(out) == TEXTS
    assert capsys.readouterr().out.startswith(f"wrote {out}: 2500 documents")
    labelled = tmp_path / "labelled.arrow"
    one = shards / "train-00001-of-00003.parquet"
    assert main(["data", "to-arrow", "--in", str(one), "--out", str(labelled), "--label-field", "label"]) == 0
    table = pa.ipc.open_stream(pa.memory_map(str(labelled))).read_all()
    assert table.column("label").to_pylist() == [i % 2 for i in range(1000, 2000)]


def test_a_datasets_save_to_disk_directory_becomes_one_record_batch(tmp_path):
    datasets = pytest.importorskip("datasets")  # a dev dependency: installed by make setup
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": TEXTS, "id": list(range(2500))}).save_to_disk(str(saved), num_shards=3)
    assert len(list(saved.glob("data-*.arrow"))) == 3
    out = tmp_path / "corpus.arrow"
    assert main(["data", "to-arrow", "--in", str(saved), "--out", str(out)]) == 0
    assert batches_of(out) == [2500] and texts_of(out) == TEXTS


def test_batch_rows_streams_batches_of_that_size(tmp_path):
    source = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": TEXTS}), source)
    out = tmp_path / "corpus.arrow"
    assert main(["data", "to-arrow", "--in", str(source), "--out", str(out), "--batch-rows", "1000"]) == 0
    assert batches_of(out) == [1000, 1000, 500] and texts_of(out) == TEXTS
    assert main(["data", "to-arrow", "--in", str(source), "--out", str(out), "--batch-rows", "1500"]) == 0
    assert batches_of(out) == [1500, 1000] and texts_of(out) == TEXTS


@pytest.mark.parametrize(
    "case", ["not parquet", "no text column", "ints", "dataset dict", "mixed splits", "zero batch rows"]
)
def test_bad_inputs_are_one_line_and_leave_no_output(tmp_path, capsys, case):
    source = tmp_path / "in.parquet"
    extra = []
    if case == "not parquet":
        source.write_text('{"text": "JSON by the wrong name"}\n')
        expected = f"error: {source}: not a readable Parquet file ("
    elif case == "no text column":
        pq.write_table(pa.table({"body": ["a", "b"]}), source)
        expected = f"error: {source} has no column 'text'; its columns: body"
    elif case == "ints":
        pq.write_table(pa.table({"text": [1, 2]}), source)
        expected = f"error: {source}: row 0: text is int 1, not text"
    elif case == "dataset dict":
        source = tmp_path / "dd"
        for split in ("train", "test"):
            (source / split).mkdir(parents=True)
            (source / split / "dataset_info.json").write_text("{}")
        (source / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
        expected = f"error: {source} is a datasets DatasetDict (splits: test, train); --split NAME takes one"
    elif case == "mixed splits":  # a Hub download: the held-out splits must not leak into training
        source = tmp_path / "hub"
        (source / "data").mkdir(parents=True)
        for name in ("train-00000-of-00001", "test-00000-of-00001", "validation-00000-of-00001"):
            pq.write_table(pa.table({"text": [name]}), source / "data" / f"{name}.parquet")
        expected = (
            f"error: {source} holds files of 3 splits (test: 1 file, train: 1 file, validation: 1 file); --split NAME"
            " takes one of them, e.g. --split train\n"
        )
    else:
        pq.write_table(pa.table({"text": ["a"]}), source)
        extra = ["--batch-rows", "0"]
        expected = "error: --batch-rows must be a positive whole number, got 0"
    out = tmp_path / "out.arrow"
    assert main(["data", "to-arrow", "--in", str(source), "--out", str(out), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith(expected) and err.count("\n") == 1, err
    assert not out.exists() and not list(tmp_path.glob(".out.arrow.*"))
