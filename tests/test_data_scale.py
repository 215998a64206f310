"""Data at the scale of a real pre-training run: orders that are never materialised (a Feistel bijection per index),
multi-batch Arrow read in place, and corpora blended by weight, each keeping the packing guarantees (determinism,
exact resume, disjoint and complete DP coverage of every epoch)."""

from __future__ import annotations

import json
import random
import tracemalloc

import numpy as np
import pyarrow as pa
import pytest
from conftest import REPO
from test_data import ListDocuments, random_docs, take

from trnrecipes.data.arrow import ArrowDocuments, ArrowTexts, write_table
from trnrecipes.data.blend import BlendPosition, position_from_dict, restart_position
from trnrecipes.data.order import Permutation, PermutedRange, derive_key
from trnrecipes.data.pack import PackedStream, StreamPosition, split_documents
from trnrecipes.data.sources import OpenedSource, data_stream
from trnrecipes.data.tokenizer import load_tokenizer

GPT2 = REPO / "data/tokenizers/gpt2"


# ---------------------------------------------------------------- the permutation


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 15, 16, 17, 255, 256, 1000, 4097, 65537])
def test_the_permutation_is_a_bijection_on_0_n(n: int):
    for seed in range(3):
        image = Permutation(n, derive_key(seed, 7))(np.arange(n))
        assert np.array_equal(np.sort(image), np.arange(n))


def test_the_permutation_shuffles_and_depends_on_every_key_word():
    n = 100_000
    a = Permutation(n, derive_key(1, 2))(np.arange(n))
    assert abs(np.corrcoef(np.arange(n), a)[0, 1]) < 0.02  # no trace of the identity
    assert 0.3 < np.mean(np.abs(np.diff(a))) / n < 0.37  # neighbours land about n/3 apart, as in a random shuffle
    for other in (derive_key(1, 3), derive_key(2, 2)):
        assert np.mean(Permutation(n, other)(np.arange(n)) == a) < 0.001


def test_nothing_in_an_order_grows_with_the_corpus():
    """A billion documents: the split, an epoch's order and a block of it in well under a megabyte (the numpy
    permutations these replace were 8 GB each)."""
    tracemalloc.start()
    train, val = split_documents(1_000_000_000, 0.01, seed=0)
    stream = PackedStream(ListDocuments([]), train, seq_len=2048, seed=3, dp_rank=5, dp_size=4096)
    order = stream.order(2)
    block = order[123_456:123_520]
    after = stream._after(2, len(order) - 1, 0)  # the end of an epoch: what a sample ending on a boundary asks
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 1 << 20, peak
    assert len(train) == 990_000_000 and len(val) == 10_000_000
    assert len(order) == 990_000_000 // 4096 + (5 < 990_000_000 % 4096)
    assert len(set(block.tolist())) == 64 and after == StreamPosition(3, 0, 0, 0)


@pytest.mark.parametrize("case", range(40))
def test_property_every_document_once_per_epoch_over_the_dp_ranks_and_resume_is_exact(case: int):
    rng = random.Random(case)
    n, dp, seed = rng.randint(1, 300), rng.randint(1, 8), rng.randint(0, 2**31)
    if n < dp:
        n = dp
    train, _ = split_documents(n + 1, 1 / (n + 1), seed)  # one held out: the training ids are a permuted range
    ids = np.asarray(train)
    docs = random_docs(n + 1, seed=case, max_len=30)
    for epoch in range(rng.randint(1, 3)):
        orders = [np.asarray(PackedStream(ListDocuments(docs), train, 7, seed, r, dp).order(epoch)) for r in range(dp)]
        flat = np.concatenate(orders)
        assert len(flat) == len(train) and set(flat.tolist()) == set(ids.tolist())
    rank = rng.randrange(dp)
    straight = take(PackedStream(ListDocuments(docs), train, 7, seed, rank, dp), 60)
    k = rng.randint(1, 59)
    position = StreamPosition.from_dict(json.loads(json.dumps(straight[k - 1][1].to_dict())))
    resumed = take(PackedStream(ListDocuments(docs), train, 7, seed, rank, dp, start=position), 60 - k)
    assert all(np.array_equal(a, b) for (a, _), (b, _) in zip(straight[k:], resumed, strict=True))


def test_the_split_is_disjoint_complete_and_fixed_by_the_seed():
    train, val = split_documents(1000, 0.05, seed=4)
    t, v = set(np.asarray(train).tolist()), set(np.asarray(val).tolist())
    assert len(v) == 50 and not t & v and t | v == set(range(1000))
    assert np.array_equal(np.asarray(split_documents(1000, 0.05, seed=4)[1]), np.asarray(val))
    assert not np.array_equal(np.asarray(split_documents(1000, 0.05, seed=5)[1]), np.asarray(val))


# ---------------------------------------------------------------- Arrow in record batches


def multi_batch(path, texts: list[str], rows: int) -> None:
    schema = pa.schema([pa.field("text", pa.large_string())])
    batches = [pa.record_batch([pa.array(texts[i : i + rows], pa.large_string())], schema=schema)
               for i in range(0, len(texts), rows)]  # fmt: skip
    write_table(pa.Table.from_batches(batches, schema), path)


def test_a_multi_batch_arrow_corpus_is_read_in_place_and_reads_as_one_batch(tmp_path):
    texts = [f"document {i}: " + "word " * (i % 37) for i in range(5000)]
    multi_batch(tmp_path / "multi.arrow", texts, rows=333)
    multi_batch(tmp_path / "one.arrow", texts, rows=len(texts))
    before = pa.total_allocated_bytes()
    read = ArrowTexts(tmp_path / "multi.arrow")
    assert len(read.chunks) == 16 and len(read) == 5000
    rows = [0, 332, 333, 334, 4999, 2500, 0]
    assert read.take(rows) == [texts[r] for r in rows]
    assert pa.total_allocated_bytes() - before < 64 << 10  # memory-mapped buffers: no copy of the column
    tok = load_tokenizer(GPT2)
    multi, one = ArrowDocuments(tmp_path / "multi.arrow", tok), ArrowDocuments(tmp_path / "one.arrow", tok)
    train, _ = split_documents(5000, 0.01, seed=0)
    a = take(PackedStream(multi, train, 64, seed=1, dp_rank=1, dp_size=3), 200)
    b = take(PackedStream(one, train, 64, seed=1, dp_rank=1, dp_size=3), 200)
    assert all(np.array_equal(x, y) and p == q for (x, p), (y, q) in zip(a, b, strict=True))
    with pytest.raises(IndexError, match="outside"):
        read.take([5000])


# ---------------------------------------------------------------- blends


def blend(sources, weights, seq_len=15, seed=0, dp_rank=0, dp=1, start: BlendPosition | None = None):
    """The trainer's blend (data_stream) over documents given as token arrays."""
    opened = [OpenedSource(f"s{k}", w, ListDocuments(d), np.arange(len(d)), np.arange(0))
              for k, (d, w) in enumerate(zip(sources, weights, strict=True))]  # fmt: skip
    return data_stream(opened, "train", seq_len, seed, dp_rank, dp, start)


def source_of(sample: np.ndarray, offsets: list[int]) -> int:
    """Which source a sample's first non-EOS token comes from: each source's token values start at its offset."""
    token = int(sample[sample != 0][0])
    return max(k for k, o in enumerate(offsets) if token >= o)


def corpora(sizes: list[int], seed: int = 0) -> tuple[list[list[np.ndarray]], list[int]]:
    """Sources whose token values are disjoint ranges, so every token says which source it came from."""
    out, offsets, base = [], [], 0
    for k, n in enumerate(sizes):
        docs = random_docs(n, seed=seed + k, max_len=40)
        docs = [np.where(d == 0, 0, d + base) for d in docs]
        offsets.append(base + 1)
        base = max(int(d.max()) for d in docs) + 1
        out.append(docs)
    return out, offsets


def test_a_blend_gives_each_source_its_weight_of_the_samples_within_one_percent():
    sources, offsets = corpora([50, 400, 120])
    weights = [5.0, 3.0, 2.0]
    samples = take(blend(sources, weights), 10_000)
    counts = np.bincount([source_of(s, offsets) for s, _ in samples], minlength=3)
    shares = counts / counts.sum()
    assert np.all(np.abs(shares - np.array(weights) / 10) < 0.01), shares
    # each source has its own epochs: the small, heavily weighted one has gone round many more times
    last = samples[-1][1]
    assert last.sources[0].epoch > 10 * max(last.sources[1].epoch, 1)
    assert sum(p.samples for p in last.sources) == last.samples == 10_000


def test_a_blend_is_deterministic_and_resumes_bitwise_from_any_position():
    sources, _ = corpora([30, 70])
    for rank, dp in ((0, 1), (1, 3)):
        straight = take(blend(sources, [1, 2], seed=9, dp_rank=rank, dp=dp), 300)
        again = take(blend(sources, [1, 2], seed=9, dp_rank=rank, dp=dp), 300)
        assert all(np.array_equal(a, b) for (a, _), (b, _) in zip(straight, again, strict=True))
        for k in (1, 77, 211):
            saved = json.loads(json.dumps(straight[k - 1][1].to_dict()))
            start = position_from_dict(saved, 2)
            resumed = take(blend(sources, [1, 2], seed=9, dp_rank=rank, dp=dp, start=start), 300 - k)
            assert all(np.array_equal(a, b) for (a, _), (b, _) in zip(straight[k:], resumed, strict=True))
            assert resumed[-1][1] == straight[-1][1]


def test_the_dp_ranks_of_a_blend_read_each_source_once_per_epoch():
    """Each rank's blend emits, from source k, exactly what source k's own stream for that rank emits (in order);
    and those streams' epoch orders over the ranks cover each source once."""
    sources, offsets = corpora([40, 90])
    dp = 3
    for r in range(dp):
        mixed = blend(sources, [2, 1], dp_rank=r, dp=dp)
        emitted = take(mixed, 400)
        for k, docs in enumerate(sources):
            from_k = [s for s, _ in emitted if source_of(s, offsets) == k]
            alone = PackedStream(ListDocuments(docs), np.arange(len(docs)), 15, 0, r, dp, True, None, index=k)
            assert len(from_k) > 50 and all(np.array_equal(a, b) for a, (b, _) in zip(from_k, take(alone, len(from_k)),
                                                                                     strict=True))  # fmt: skip
    for k, docs in enumerate(sources):
        for epoch in (0, 1):
            read = [np.asarray(blend(sources, [2, 1], dp_rank=r, dp=dp).streams[k].order(epoch)) for r in range(dp)]
            assert sorted(np.concatenate(read).tolist()) == list(range(len(docs)))


def test_the_sources_of_a_blend_and_the_split_and_the_epochs_each_have_their_own_permutation():
    """Same-size sources are not shuffled alike, and the split's permutation is no epoch's (their keys differ)."""
    a = PackedStream(ListDocuments([]), np.arange(1000), 8, seed=3, index=0)
    b = PackedStream(ListDocuments([]), np.arange(1000), 8, seed=3, index=1)
    assert np.mean(np.asarray(a.order(0)) == np.asarray(b.order(0))) < 0.01
    assert np.mean(np.asarray(a.order(0)) == np.asarray(a.order(1))) < 0.01
    train, val = split_documents(1001, 1 / 1001, seed=3)
    split_order = np.concatenate([np.asarray(val), np.asarray(train)])
    assert not any(np.array_equal(split_order[:1000], np.asarray(a.order(e))) for e in range(50))


def test_a_scalar_index_maps_without_numpy_overflow_warnings():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Permutation(10**6, derive_key(0, 1))(3).shape == (1,)


def test_saved_positions_are_read_as_the_data_section_has_them():
    one = StreamPosition(2, 5, 3, 40)
    two = BlendPosition((StreamPosition(1, 2, 0, 10), StreamPosition(4, 0, 7, 30)), 40)
    assert position_from_dict(one.to_dict(), 1) == one
    assert position_from_dict(two.to_dict(), 2) == two
    with pytest.raises(ValueError):
        position_from_dict(two.to_dict(), 1)
    with pytest.raises(ValueError):
        position_from_dict(one.to_dict(), 2)
    with pytest.raises(ValueError):
        position_from_dict(two.to_dict(), 3)
    # a position that does not carry over: every source at the epoch after the furthest any rank reached
    other = BlendPosition((StreamPosition(3, 0, 0, 5), StreamPosition(1, 0, 0, 5)), 10)
    assert restart_position([two.to_dict(), other.to_dict()], 2) == BlendPosition(
        (StreamPosition(epoch=4), StreamPosition(epoch=5))
    )
    assert restart_position([one.to_dict()], 1) == StreamPosition(epoch=3)
    assert restart_position([one.to_dict()], 2) == BlendPosition((StreamPosition(epoch=3), StreamPosition(epoch=3)))
    nothing_saved = BlendPosition((StreamPosition(epoch=0), StreamPosition(epoch=0)))
    assert restart_position([], 2) == nothing_saved == restart_position([{"samples": 0, "sources": []}], 2)


def test_a_permuted_range_is_a_slice_of_the_permutation():
    perm = Permutation(100, derive_key(0))
    full = perm(np.arange(100))
    assert np.array_equal(np.asarray(PermutedRange(perm, 10, 30)), full[10:40])
    assert np.array_equal(PermutedRange(perm, 10, 30)[5:9], full[15:19])


def test_to_arrow_writes_record_batches_of_rows_per_batch(tmp_path, monkeypatch):
    from trnrecipes.data import arrow

    monkeypatch.setattr(arrow, "ROWS_PER_BATCH", 3000)  # the default, 131,072 rows, made small enough to see
    source = tmp_path / "docs.txt"
    source.write_text("".join(f"line {i}\n" for i in range(7000)))
    arrow.to_arrow([source], tmp_path / "out.arrow", progress=False)
    table = pa.ipc.open_stream(pa.memory_map(str(tmp_path / "out.arrow"))).read_all()
    assert [len(b) for b in table.to_batches()] == [3000, 3000, 1000]
    assert table.column("text").to_pylist() == [f"line {i}" for i in range(7000)]
