"""A record batch joined from pieces by batch_bytes.py: the bytes pyarrow writes for their concatenation, whether
the texts come from memory or are copied from a memory-mapped file."""

from __future__ import annotations

import random

import pyarrow as pa
import pytest

from trnrecipes.data.batch_bytes import Mapped, joinable, write_joined
from trnrecipes.data.corpus_writer import CorpusWriter, corpus_schema


def batches(schema: pa.Schema, seed: int, count: int) -> list[pa.RecordBatch]:
    rng = random.Random(seed)
    made = []
    for _ in range(count):
        rows = rng.randint(1, 40)
        texts = ["".join(rng.choices("ab\u00e9\u6771 \U0001f642", k=rng.randint(0, 30))) for _ in range(rows)]
        columns = [pa.array(texts, pa.large_string()), pa.array([rng.randint(0, 9) for _ in range(rows)], pa.int64())]
        made.append(pa.record_batch(columns[: len(schema)], schema=schema))
    return made


def sliced(batch: pa.RecordBatch, seed: int) -> pa.RecordBatch:
    start = random.Random(seed).randint(0, len(batch) - 1)
    return batch.slice(start, random.Random(seed + 1).randint(1, len(batch) - start))


def pyarrows(schema: pa.Schema, pieces: list[pa.RecordBatch]) -> bytes:
    columns = [pa.concat_arrays([p.column(i) for p in pieces]) for i in range(len(schema))]
    return pa.record_batch(columns, schema=schema).serialize().to_pybytes()


@pytest.mark.parametrize("label", [None, "label"])
def test_pieces_in_memory_and_mapped_join_into_pyarrows_bytes(tmp_path, label):
    schema = corpus_schema("text", label)
    part = tmp_path / "part.arrow"
    with pa.OSFile(str(part), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for batch in batches(schema, 0, 6):
            writer.write_batch(batch)
    whole = pa.memory_map(str(part)).read_buffer()
    where = Mapped(str(part), whole.address, whole.size)
    mapped = [(sliced(b, k), where) for k, b in enumerate(pa.ipc.open_stream(whole))]
    in_memory = [(sliced(b, k), None) for k, b in enumerate(batches(schema, 1, 5))]
    # a piece said to lie in the file but read elsewhere (a buffer pyarrow copied): written from memory, not from a
    # wrong place of the file
    astray = [(p, where) for p, _ in in_memory]
    for pieces in (mapped, in_memory, mapped[:2] + in_memory + mapped[2:], mapped[3:4], astray):
        out = tmp_path / "joined"
        with open(out, "wb", buffering=0) as sink:
            assert joinable(schema, pieces)
            write_joined(sink, schema, pieces)
        assert out.read_bytes() == pyarrows(schema, [p for p, _ in pieces])


def test_a_corpus_file_is_the_stream_pyarrows_writer_writes(tmp_path):
    schema = corpus_schema("text", "label")
    given = batches(schema, 2, 30)
    with CorpusWriter(tmp_path / "ours.arrow", schema, rows_per_batch=100) as writer:
        for batch in given:
            writer.write(batch)
    table = pa.Table.from_batches(given).combine_chunks()
    with pa.OSFile(str(tmp_path / "theirs.arrow"), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for batch in table.to_batches(max_chunksize=100):
            writer.write_batch(pa.record_batch([pa.concat_arrays([c]) for c in batch.columns], schema=schema))
    assert (tmp_path / "ours.arrow").read_bytes() == (tmp_path / "theirs.arrow").read_bytes()


def test_nulls_or_other_columns_are_left_to_pyarrow():
    schema = corpus_schema("text")
    assert not joinable(schema, [(pa.record_batch([pa.array(["a", None], pa.large_string())], schema=schema), None)])
    other = pa.schema([pa.field("text", pa.string())])
    assert not joinable(other, [(pa.record_batch([pa.array(["a"])], schema=other), None)])
