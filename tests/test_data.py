"""Data pipeline: to-arrow, tokenizers, Megatron .bin/.idx interop, packing, sharding, resume, prefetch."""

from __future__ import annotations

import gzip
import json
import warnings
from pathlib import Path

import numpy as np
import pytest

from trnrecipes import REPO_ROOT
from trnrecipes.data.arrow import ArrowDocuments, DataError, read_arrow, to_arrow
from trnrecipes.data.indexed import IndexedDocuments, preprocess, token_dtype
from trnrecipes.data.pack import PackedStream, Prefetcher, StreamPosition, batches, split_documents
from trnrecipes.data.tokenizer import TokenizerError, load_tokenizer, train_sentencepiece

GPT2 = REPO_ROOT / "data/tokenizers/gpt2"
DEMO_SP = REPO_ROOT / "data/tokenizers/demo-sp"
CORPUS = REPO_ROOT / "data/demo/pythondocs.arrow"

DOCS = [
    "Hello world",
    "Ünïcødé, emoji 😀 and CJK 漢字 in one line.\n\nA second paragraph\twith a tab.",
    "def f(x):\n    return x ** 2  # code keeps its spaces\n",
    "a<|endoftext|>b",  # the special token in text: both engines must agree with transformers
    "   leading spaces and trailing   ",
    "x" * 5000,
]


def megatron():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets import indexed_dataset
    return indexed_dataset


@pytest.fixture(scope="module")
def gpt2():
    return load_tokenizer(GPT2)


@pytest.fixture
def jsonl(tmp_path: Path) -> Path:
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCS)))
    return path


class ListDocuments:
    """A DocumentSource of given token arrays (EOS already appended), for exact packing checks."""

    def __init__(self, docs: list[np.ndarray]):
        self.docs, self.num_docs = docs, len(docs)

    def tokens(self, doc_ids):
        return [self.docs[i] for i in doc_ids]


def random_docs(n: int, seed: int = 0, eos: int = 0, max_len: int = 90) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    # unique token values per document make every token traceable
    docs, next_id = [], 1
    for _ in range(n):
        length = int(rng.integers(0, max_len))
        docs.append(np.append(np.arange(next_id, next_id + length), eos))
        next_id += length
    return docs


# ---------------------------------------------------------------- tokenizers


def test_gpt2_tokenizer_from_shipped_files(gpt2):
    assert gpt2.encode("Hello world") == [15496, 995]
    assert [list(x) for x in gpt2.encode_batch(["Hello world"])] == [[15496, 995]]
    assert gpt2.eos_id == 50256 and gpt2.vocab_size == 50257
    assert gpt2.engine == "tiktoken"


def test_gpt2_engines_and_transformers_agree_on_the_demo_corpus(gpt2):
    from transformers import AutoTokenizer

    texts = read_arrow(CORPUS).to_pylist()[:60] + DOCS
    fast = gpt2.encode_batch(texts)
    reference = gpt2.backend.encode_batch_fast(texts, add_special_tokens=False)
    assert all(list(a) == b.ids for a, b in zip(fast, reference, strict=True))
    hf = AutoTokenizer.from_pretrained(GPT2)
    assert all(list(a) == hf(t, add_special_tokens=False)["input_ids"] for a, t in zip(fast, texts, strict=True))


def test_non_gpt2_bpe_stays_on_tokenizers(tmp_path: Path):
    spec = json.loads((GPT2 / "tokenizer.json").read_text())
    spec["model"]["merges"] = spec["model"]["merges"][1:] + spec["model"]["merges"][:1]  # ranks != ids
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    (tmp_path / "tokenizer_config.json").write_text((GPT2 / "tokenizer_config.json").read_text())
    assert load_tokenizer(tmp_path).engine == "tokenizers"


def test_trained_sentencepiece_loads_in_transformers_with_the_same_ids(tmp_path: Path):
    import sentencepiece as spm
    from transformers import AutoTokenizer

    lines = [line for doc in read_arrow(CORPUS).to_pylist()[:40] for line in doc.splitlines()]
    train_sentencepiece(iter(lines), 600, tmp_path / "sp")
    ours = load_tokenizer(tmp_path / "sp")
    assert ours.vocab_size == 600 and ours.eos_id == 2
    processor = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp/tokenizer.model"))
    hf = AutoTokenizer.from_pretrained(tmp_path / "sp")
    for text in DOCS[:3] + DOCS[4:]:
        ids = ours.encode(text)
        assert ids == hf(text, add_special_tokens=False)["input_ids"]  # training and eval see the same ids
        # HF's Metaspace treats a run of *leading* spaces differently from sentencepiece (as for Llama 2 itself)
        if not text[0].isspace():
            assert ids == processor.encode(text)
            assert ours.decode(ids) == text  # byte fallback: nothing is lost, not even emoji or CJK
    with pytest.raises(TokenizerError, match="too small"):
        train_sentencepiece(iter(lines), 100, tmp_path / "tiny")
    # more pieces than two short texts hold: the most they hold, on one line (was sentencepiece's own message)
    with pytest.raises(TokenizerError, match=r"^--vocab-size 400: these texts hold pieces for at most (\d+); use at"
                                             r" most \1$"):  # fmt: skip
        train_sentencepiece(iter(["hello world", "small corpus here"]), 400, tmp_path / "two")


def test_demo_sp_tokenizer_fits_llama2_tiny_and_pythia_tiny():
    from trnrecipes.config.recipe import load_recipe

    recipe = load_recipe("llama2-tiny")
    tok = load_tokenizer(REPO_ROOT / recipe.data.tokenizer)
    assert tok.vocab_size <= recipe.model.vocab_size
    pythia = load_recipe("pythia-tiny")
    assert load_tokenizer(REPO_ROOT / pythia.data.tokenizer).vocab_size <= pythia.model.vocab_size


def test_missing_tokenizer_is_a_clear_error(tmp_path: Path):
    with pytest.raises(TokenizerError, match=r"no tokenizer at .*tokenizer.json"):
        load_tokenizer(tmp_path)
    import shutil

    shutil.copy(REPO_ROOT / "data/tokenizers/gpt2/tokenizer.json", tmp_path)  # without its tokenizer_config.json
    with pytest.raises(TokenizerError, match=r"has no tokenizer_config.json, which names the eos_token that ends"):
        load_tokenizer(tmp_path)
    # bert-base-uncased's layout: a tokenizer_config.json naming no specials, special_tokens_map.json naming them
    (tmp_path / "tokenizer_config.json").write_text('{"do_lower_case": true, "model_max_length": 512}')
    (tmp_path / "special_tokens_map.json").write_text('{"eos_token": "<|endoftext|>"}')
    assert load_tokenizer(tmp_path).eos_id == 50256  # was refused: 'names no eos_token (or sep_token)'


# ---------------------------------------------------------------- to-arrow


def test_text_to_arrow_to_tokens_equals_direct_tokenization(tmp_path: Path, jsonl: Path, gpt2):
    stats = to_arrow([jsonl], tmp_path / "docs.arrow", progress=False)
    assert stats.documents == len(DOCS)
    assert read_arrow(tmp_path / "docs.arrow").to_pylist() == DOCS
    source = ArrowDocuments(tmp_path / "docs.arrow", gpt2)
    got = source.tokens(list(range(len(DOCS))))
    for text, ids in zip(DOCS, got, strict=True):
        assert list(ids) == [*gpt2.backend.encode(text, add_special_tokens=False).ids, gpt2.eos_id]


def test_to_arrow_inputs(tmp_path: Path):
    (tmp_path / "lines.txt").write_text("one\ntwo\n\nthree\n")
    with gzip.open(tmp_path / "g.jsonl.gz", "wt") as f:
        f.write(json.dumps({"body": "zipped"}) + "\n")
    text_dir = tmp_path / "dir"
    (text_dir / "sub").mkdir(parents=True)
    (text_dir / "a.rst.txt").write_text("first file\nstill first")
    (text_dir / "sub/b.md").write_text("second file")
    stats = to_arrow([tmp_path / "lines.txt", text_dir], tmp_path / "o.arrow", progress=False)
    expected = ["one", "two", "three", "first file\nstill first", "second file"]
    assert read_arrow(tmp_path / "o.arrow").to_pylist() == expected
    assert stats.skipped_empty == 1
    to_arrow([tmp_path / "g.jsonl.gz"], tmp_path / "g.arrow", text_field="body", progress=False)
    assert read_arrow(tmp_path / "g.arrow", "body").to_pylist() == ["zipped"]


def test_to_arrow_reads_a_datasets_save_to_disk_dir(tmp_path: Path):
    import datasets

    datasets.Dataset.from_dict({"text": DOCS, "n": list(range(len(DOCS)))}).save_to_disk(tmp_path / "saved")
    to_arrow([tmp_path / "saved"], tmp_path / "o.arrow", progress=False)
    assert read_arrow(tmp_path / "o.arrow").to_pylist() == DOCS


def test_to_arrow_errors_name_the_problem_and_write_nothing(tmp_path: Path, jsonl: Path):
    out = tmp_path / "o.arrow"
    with pytest.raises(DataError, match="does not exist"):
        to_arrow([tmp_path / "missing.jsonl"], out, progress=False)
    with pytest.raises(DataError, match=r"no field 'body' \(has: text, id\)"):
        to_arrow([jsonl], out, text_field="body", progress=False)
    (tmp_path / "table.csv").write_text("text\nhello\n")
    with pytest.raises(
        DataError,
        match=r"table.csv: unknown input type; expected .jsonl, .json .*, .txt, .md, .rst .*, a directory, or -",
    ):
        to_arrow([tmp_path / "table.csv"], out, progress=False)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match=r"empty.jsonl: it holds no records \(empty, or blank lines only\)"):
        to_arrow([tmp_path / "empty.jsonl"], out, progress=False)
    (tmp_path / "bad.txt").write_bytes(b"good line\nbad \xff\xfe line\nanother good\n")
    with pytest.raises(DataError, match=r"bad.txt:2: invalid UTF-8 \(.*\); --on-bad-record skip skips such records"):
        to_arrow([tmp_path / "bad.txt"], out, progress=False)  # an error unless skipped
    assert not out.exists() and not list(tmp_path.glob(".o.arrow*"))  # no partial output left behind
    stats = to_arrow([tmp_path / "bad.txt"], out, on_bad_record="skip", progress=False)
    assert stats.rejected == 1 and '"line": 2, "reason": "invalid UTF-8' in Path(f"{out}.rejects.jsonl").read_text()
    assert read_arrow(out).to_pylist() == ["good line", "another good"]
    with pytest.raises(DataError, match="no column 'body'; its columns: text"):
        read_arrow(out, "body")


def test_cli_to_arrow_and_preprocess(tmp_path: Path, jsonl: Path, cli):
    done = cli("data", "to-arrow", "--in", str(jsonl), "--out", str(tmp_path / "o.arrow"))
    assert done.returncode == 0 and f"{len(DOCS)} documents" in done.stdout, done.stderr
    done = cli("data", "to-arrow", "--in", str(jsonl), "--out", str(tmp_path / "x.arrow"), "--text-field", "body")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr == f"error: --text-field body: none of the first records of {jsonl} has it (they have:" \
                          " text, id); name the field that holds the text\n"  # fmt: skip
    done = cli("data", "preprocess", "--in", str(jsonl), "--tokenizer", str(GPT2), "--out", str(tmp_path / "m/d"))
    assert done.returncode == 0 and (tmp_path / "m/d.idx").exists(), done.stderr


# ---------------------------------------------------------------- Megatron .bin/.idx


def test_our_bin_idx_is_read_by_megatron_core(tmp_path: Path, jsonl: Path, gpt2):
    stats, total = preprocess([jsonl], gpt2, tmp_path / "d", progress=False)
    dataset = megatron().IndexedDataset(str(tmp_path / "d"))
    assert len(dataset) == stats.documents == len(DOCS)
    expected = [[*gpt2.backend.encode(t, add_special_tokens=False).ids, gpt2.eos_id] for t in DOCS]
    assert [list(dataset[i]) for i in range(len(DOCS))] == expected
    assert total == sum(map(len, expected)) and dataset[0].dtype == np.uint16
    ours = IndexedDocuments(tmp_path / "d")
    assert [list(x) for x in ours.tokens(list(range(len(DOCS))))] == expected


def test_megatron_core_bin_idx_is_read_by_us(tmp_path: Path):
    indexed_dataset = megatron()
    builder = indexed_dataset.IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.int32)
    docs = [[70000, 1, 2], [3], [4, 5, 6, 7]]
    builder.add_document(np.array(docs[0]), [3])
    builder.add_document(np.array(docs[1] + docs[2]), [1, 4])  # one document of two sequences
    builder.finalize(str(tmp_path / "m.idx"))
    ours = IndexedDocuments(tmp_path / "m")
    assert ours.num_docs == 2
    assert [list(x) for x in ours.tokens([0, 1])] == [docs[0], docs[1] + docs[2]]


def test_token_dtype_must_hold_the_vocabulary(tmp_path: Path, jsonl: Path):
    assert token_dtype(50257) == np.uint16 and token_dtype(65536) == np.uint16 and token_dtype(65537) == np.int32
    with pytest.raises(DataError, match=r"vocabulary \(70000 ids\) does not fit in uint16"):
        token_dtype(70000, "uint16")
    with pytest.raises(DataError, match="not one of: auto, uint16, int32"):
        token_dtype(100, "int8")
    with pytest.raises(DataError, match=r"d2.bin does not exist"):
        IndexedDocuments(tmp_path / "d2")


# ---------------------------------------------------------------- packing


def take(stream, n):
    it = iter(stream)
    return [next(it) for _ in range(n)]


def test_packing_never_drops_or_duplicates_a_token():
    docs = random_docs(50)
    source = ListDocuments(docs)
    ids = np.arange(len(docs))
    stream = PackedStream(source, ids, seq_len=31, seed=3)
    epoch_tokens = sum(len(d) for d in docs)
    n = 3 * epoch_tokens // 32 + 1  # more than three epochs: crosses epoch boundaries
    samples = take(stream, n)
    assert all(s.shape == (32,) and s.dtype == np.int64 for s, _ in samples)
    flat = np.concatenate([s for s, _ in samples])
    expected = np.concatenate([docs[i] for e in range(4) for i in stream.order(e)])
    assert np.array_equal(flat, expected[: len(flat)])  # the stream, exactly, in order: nothing dropped or repeated
    one_epoch = flat[:epoch_tokens]
    content = one_epoch[one_epoch != 0]
    assert len(np.unique(content)) == len(content) == sum(len(d) - 1 for d in docs)


@pytest.mark.parametrize("dp_size", [1, 2, 3])
def test_resume_from_a_saved_position_yields_the_same_samples(dp_size: int):
    source = ListDocuments(random_docs(40, seed=1, max_len=40))  # ~52 samples per epoch at dp 1
    ids = np.arange(40)
    for rank in range(dp_size):
        straight = take(PackedStream(source, ids, 15, seed=7, dp_rank=rank, dp_size=dp_size), 120)
        for k in (1, 17, 59, 90):  # 90 is past an epoch boundary
            position = StreamPosition.from_dict(json.loads(json.dumps(straight[k - 1][1].to_dict())))
            resumed = take(PackedStream(source, ids, 15, 7, rank, dp_size, start=position), 120 - k)
            assert all(np.array_equal(a, b) for (a, _), (b, _) in zip(straight[k:], resumed, strict=True))
            assert resumed[-1][1] == straight[-1][1]
        assert straight[89][1].epoch >= 1


def test_dp_shards_are_disjoint_and_cover_the_stream():
    docs = random_docs(31)
    source = ListDocuments(docs)
    ids = np.arange(len(docs))
    for epoch in range(3):
        shards = [PackedStream(source, ids, 8, seed=5, dp_rank=r, dp_size=3).order(epoch) for r in range(3)]
        flat = np.concatenate(shards)
        assert len(flat) == len(set(flat.tolist())) == len(docs)  # disjoint and covering
    # what each rank's stream actually emits over its first epoch is exactly its shard's tokens
    for r in range(3):
        stream = PackedStream(source, ids, 8, seed=5, dp_rank=r, dp_size=3)
        shard_tokens = np.concatenate([docs[i] for i in stream.order(0)])
        emitted = np.concatenate([s for s, _ in take(stream, len(shard_tokens) // 9)])
        assert np.array_equal(emitted, shard_tokens[: len(emitted)])
    # within one epoch the ranks' tokens (EOS aside) are disjoint and together are all of the corpus
    per_epoch = [set(np.concatenate([docs[i] for i in shards_r]).tolist()) - {0} for shards_r in shards]
    assert set.union(*per_epoch) == set(np.concatenate(docs).tolist()) - {0}
    assert sum(map(len, per_epoch)) == len(set.union(*per_epoch))


def test_stream_is_deterministic_for_a_seed_and_differs_across_seeds():
    source = ListDocuments(random_docs(20))
    ids = np.arange(20)
    a = [s for s, _ in take(PackedStream(source, ids, 16, seed=1), 30)]
    b = [s for s, _ in take(PackedStream(source, ids, 16, seed=1), 30)]
    c = [s for s, _ in take(PackedStream(source, ids, 16, seed=2), 30)]
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


def test_split_documents():
    train, val = split_documents(100, 0.05, seed=1)
    assert len(val) == 5 and len(train) == 95 and not set(train) & set(val)
    assert np.array_equal(split_documents(100, 0.05, seed=1)[1], val)
    assert len(split_documents(10, 0.01, seed=1)[1]) == 1  # at least one validation document
    with pytest.raises(DataError, match="too few to hold out 1 for validation"):
        split_documents(1, 0.5, seed=0)


def test_batches_are_full_and_static():
    source = ListDocuments(random_docs(10))
    got = take(batches(PackedStream(source, np.arange(10), 7), micro_batch=3), 20)
    assert all(b.shape == (3, 8) for b, _ in got)
    assert got[-1][1].samples == 60


def test_prefetcher_yields_the_same_items_and_surfaces_errors():
    items = list(range(100))
    assert list(Prefetcher(iter(items), depth=4)) == items

    def failing():
        yield 1
        raise DataError("corrupt shard 7")

    prefetch = Prefetcher(failing())
    assert next(prefetch) == 1
    with pytest.raises(DataError, match="corrupt shard 7"):
        next(prefetch)
    endless = Prefetcher(iter(lambda: 0, 1), depth=2)
    next(endless)
    endless.close()
    assert not endless._thread.is_alive()


def test_real_corpus_stream_with_both_formats(tmp_path: Path, gpt2):
    """The demo corpus as Arrow (online tokenization) and as .bin/.idx give the same packed samples."""
    texts = read_arrow(CORPUS).to_pylist()[:25]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    to_arrow([tmp_path / "c.jsonl"], tmp_path / "c.arrow", progress=False)
    preprocess([tmp_path / "c.jsonl"], gpt2, tmp_path / "c", progress=False)
    train, _ = split_documents(25, 0.1, seed=0)
    arrow = take(PackedStream(ArrowDocuments(tmp_path / "c.arrow", gpt2), train, 128, seed=0), 50)
    indexed = take(PackedStream(IndexedDocuments(tmp_path / "c"), train, 128, seed=0), 50)
    assert all(np.array_equal(a, b) for (a, _), (b, _) in zip(arrow, indexed, strict=True))
