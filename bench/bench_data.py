"""Benchmark: online tokenize + pack (ours) vs the run_clm recipe (datasets.map(tokenize) + group_texts).

Both read the same Arrow file (the demo corpus), use the same tokenizer, run in one process each (a fresh one, so
nothing is cached) and produce fixed-length samples of every token of one epoch. Prints tokens/s, the ratio
(goal >= 3x), and tokens/s per core against what one trn1.32xlarge consumes training Llama2-7B (~26k tokens/s per
node, FACTS.md): how many host cores the data path needs per node.

    .venv/bin/python bench/bench_data.py [--seq 2048] [--tokenizer data/tokenizers/gpt2]

`--scale` measures instead what the data path costs as the corpus grows (the issue "Data at the scale of a real
pre-training run"): synthetic corpora of 1M and 16M short documents, as an Arrow IPC stream (1M-row record
batches, read in place by ArrowDocuments) and as a Megatron .bin/.idx pair (IndexedDocuments), generated once and
cached under build/bench-data/. Each (format, size) is measured in a fresh process, as rank 0 of 32: start-up
(open + split + PackedStream + Prefetcher, until the first batch), steady tokens/s, and RSS growth over the RSS after
imports. Targets, 16M against 1M: RSS growth within 64 MiB, start-up under 1.3x, tokens/s within 10%. Then an
extrapolation to 1B documents and 32 ranks per node, against what the code before order.py held.

    .venv/bin/python bench/bench_data.py --scale [--sizes 1M,16M] [--batches 500] [--repeats 5] [--against REV]

`--convert` measures `trnrecipes data to-arrow` on 8 JSON-lines shards of 128 MB (synthetic documents of ~3 KB,
generated once under build/bench-data/), plain and as .jsonl.zst, at --workers 2 against --workers 1 and against
`datasets.load_dataset("json", num_proc=2)` + `save_to_disk` with its cache cleared, each a whole process (interpreter
start-up included): seconds, MB/s, the ratios (goals: >= 1.8x and >= 2x) and the peak RSS of each process; and
datasets once more with its output fsynced after save_to_disk, as ours is before it takes its name; then the
peak RSS per worker at 8 and at 32 shards (1 GB and 4 GB of input; goal: within 10%). A fourth side measures what
the machine gives two processes: two `--workers 1` conversions of half the shards each, started at once and timed
until both end. That is the same work split in two with nothing shared (no join between them), so --workers 1's
time over theirs bounds what any two-process conversion can gain here.

    .venv/bin/python bench/bench_data.py --convert [--shards 8] [--shard-mb 128] [--scale-to 32] [--repeats 3]

`--preprocess` measures `trnrecipes data preprocess --workers 2` (tokenize into Megatron .bin/.idx) on --shards
JSON-lines shards of --shard-mb MB (each its own unit from 32 MiB) against what a user of the tokenizers library
writes: a pool of 2 processes, each reading a shard's lines with json and encoding them with Tokenizer.encode_batch,
1000 at a time, into a .bin of the ids (uint16, EOS after each document); both whole processes, interleaved, medians.
It checks that both wrote as many tokens, and prints the ratio (the issue names no goal: the library is the yardstick).

    .venv/bin/python bench/bench_data.py --preprocess --shards 4 --shard-mb 40 [--repeats 3]

`--against REV` measures trnrecipes/ of a git revision too (unpacked with git archive into a temporary directory),
e.g. 6317da4, the last before the never-listed order: one run per (format, size).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CORPUS = REPO / "data/demo/pythondocs.arrow"
NODE_NEEDS = 26_000  # tokens/s per trn1.32xlarge node for Llama2-7B (seed 002 / FACTS.md)


def ours(corpus: Path, tokenizer: str, seq: int) -> dict:
    import numpy as np

    from trnrecipes.data.arrow import ArrowDocuments
    from trnrecipes.data.pack import PackedStream, Prefetcher, batches
    from trnrecipes.data.tokenizer import load_tokenizer

    start = time.perf_counter()
    tok = load_tokenizer(tokenizer)
    source = ArrowDocuments(corpus, tok)
    stream = PackedStream(source, np.arange(source.num_docs), seq, seed=0)
    tokens = 0
    loader = Prefetcher(batches(stream, micro_batch=1))
    for batch, position in loader:
        tokens += batch.size
        if position.epoch > 0:  # one epoch, like the baseline
            break
    loader.close()
    return {"seconds": time.perf_counter() - start, "tokens": tokens, "engine": tok.engine}


def run_clm(corpus: Path, tokenizer: str, seq: int) -> dict:
    """transformers' examples/pytorch/language-modeling/run_clm.py, its data part, verbatim in spirit."""
    from itertools import chain

    import datasets
    from transformers import AutoTokenizer

    datasets.disable_progress_bars()
    start = time.perf_counter()
    hf_tok = AutoTokenizer.from_pretrained(tokenizer)
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(tmp) / "corpus.arrow"
        shutil.copy(corpus, local)  # map() writes its cache files next to the data, as run_clm does
        raw = datasets.Dataset.from_file(str(local))

        def tokenize_function(examples):
            return hf_tok(examples["text"])

        tokenized = raw.map(tokenize_function, batched=True, remove_columns=["text"])

        def group_texts(examples):
            concatenated = {k: list(chain(*examples[k])) for k in examples.keys()}
            total = (len(concatenated["input_ids"]) // seq) * seq
            result = {k: [t[i : i + seq] for i in range(0, total, seq)] for k, t in concatenated.items()}
            result["labels"] = result["input_ids"].copy()
            return result

        grouped = tokenized.map(group_texts, batched=True)
        tokens = sum(len(x) for x in grouped["input_ids"])
    return {"seconds": time.perf_counter() - start, "tokens": tokens}


# --- --scale: the data path against the corpus size ------------------------------------------------------------------

SCALE_DIR = REPO / "build/bench-data"  # git-ignored (/build/)
SCALE_VERSION = 1  # in the cached files' names: bump it when the generator changes
CHUNK = 1_000_000  # documents per generated chunk = rows per Arrow record batch
WORD_BYTES = 12  # a vocabulary word and its trailing space, zero padded
EOS = 50256  # GPT-2's <|endoftext|>: the Megatron corpus's ids are GPT-2-sized, as `data preprocess` would write
MEGATRON_UINT16 = 8  # megatron.core.datasets.indexed_dataset.DType.uint16
DP, VAL_FRACTION, SEED = 32, 0.01, 0
TARGET_RSS_MIB, TARGET_STARTUP, TARGET_RATE = 64, 1.3, 0.10
BILLION, RANKS_PER_NODE = 1_000_000_000, 32
MIB = 1 << 20


def count(text: str) -> int:
    """'1M' -> 1000000, '250k' -> 250000, '4096' -> 4096."""
    scale = {"k": 10**3, "m": 10**6, "b": 10**9}.get(text[-1:].lower(), 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def label(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def vocabulary(seed: int, size: int = 8192):
    """[size, WORD_BYTES] uint8: pseudo-words of 1-4 consonant+vowel syllables, each with a trailing space, zero
    padded, shortest first (the frequent low ids are short words, as in a language)."""
    import numpy as np

    rng = np.random.default_rng([seed, 0x70CA])
    consonants = np.frombuffer(b"bcdfghjklmnprstvwz", np.uint8)
    vowels = np.frombuffer(b"aeiouy", np.uint8)
    letters = np.stack(
        [consonants[rng.integers(0, len(consonants), (size, 4))], vowels[rng.integers(0, len(vowels), (size, 4))]],
        axis=2,
    ).reshape(size, 8)
    n_letters = 2 * rng.integers(1, 5, size)
    table = np.zeros((size, WORD_BYTES), np.uint8)
    table[:, :8] = np.where(np.arange(8) < n_letters[:, None], letters, 0)
    table[np.arange(size), n_letters] = ord(" ")
    return table[np.argsort(n_letters, kind="stable")]


def arrow_chunk(seed: int, chunk: int, n: int, table, words_per_doc: tuple[int, int] = (3, 41)):
    """Chunk `chunk` of the Arrow corpus: n documents of 3-40 (`words_per_doc`) Zipf-distributed words ending in '.',
    built as one bytes buffer and its offsets (no Python strings), deterministic from (seed, chunk)."""
    import numpy as np
    import pyarrow as pa

    rng = np.random.default_rng([seed, 0xA770, chunk])
    words = rng.integers(*words_per_doc, n)  # words per document
    ids = (rng.zipf(1.2, int(words.sum())) - 1) % len(table)
    word_bytes = (table != 0).sum(axis=1)[ids]  # the word and its space
    rows = table[ids]
    data = rows[rows != 0]  # the words' bytes in order, padding dropped
    starts = np.concatenate([[0], np.cumsum(words)[:-1]])
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(np.add.reduceat(word_bytes, starts), out=offsets[1:])
    data[offsets[1:] - 1] = ord(".")  # each document's last space ends its sentence
    text = pa.LargeStringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(data))
    return pa.record_batch([text], names=["text"])


def write_arrow(path: Path, n_docs: int, seed: int, chunk_docs: int = CHUNK) -> None:
    """An Arrow IPC stream, column `text` (large_string), one record batch per chunk; atomic (temp + rename)."""
    import pyarrow as pa

    table = vocabulary(seed)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        schema = pa.schema([("text", pa.large_string())])
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
            for chunk, start in enumerate(range(0, n_docs, chunk_docs)):
                writer.write_batch(arrow_chunk(seed, chunk, min(chunk_docs, n_docs - start), table))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def indexed_chunk(seed: int, chunk: int, n: int):
    """(lengths int32, tokens uint16) of n documents of 4-62 tokens (about the Arrow corpus's GPT-2 token count
    per document), the last one EOS, as `trnrecipes data preprocess` writes them."""
    import numpy as np

    rng = np.random.default_rng([seed, 0x1DC5, chunk])
    lengths = rng.integers(4, 63, n).astype(np.int32)
    tokens = rng.integers(0, EOS, int(lengths.sum()), dtype=np.uint16)
    tokens[np.cumsum(lengths, dtype=np.int64) - 1] = EOS
    return lengths, tokens


def write_indexed(prefix: Path, n_docs: int, seed: int, chunk_docs: int = CHUNK) -> None:
    """prefix.bin/.idx in megatron-core's IndexedDataset format (indexed_dataset.py, _IndexWriter), one sequence
    per document, written with numpy: header b"MMIDIDX\x00\x00", version <Q 1, dtype code <B, sequence count <Q,
    document count <Q (= documents + 1), sequence lengths int32, sequence pointers int64 (byte offsets into .bin),
    document indices int64 (0, 1, ..., n: the sequence where each document starts). .bin first, then .idx."""
    import numpy as np

    tmp = prefix.with_name(f".{prefix.name}.tmp{os.getpid()}")
    try:
        lengths = []
        with open(f"{tmp}.bin", "wb") as f:
            for chunk, start in enumerate(range(0, n_docs, chunk_docs)):
                chunk_lengths, tokens = indexed_chunk(seed, chunk, min(chunk_docs, n_docs - start))
                tokens.tofile(f)
                lengths.append(chunk_lengths)
        lengths = np.concatenate(lengths)
        pointers = np.zeros(n_docs, np.int64)
        np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
        pointers *= np.dtype(np.uint16).itemsize
        with open(f"{tmp}.idx", "wb") as f:
            f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", MEGATRON_UINT16))
            f.write(struct.pack("<Q", n_docs) + struct.pack("<Q", n_docs + 1))
            lengths.tofile(f)
            pointers.tofile(f)
            np.arange(n_docs + 1, dtype=np.int64).tofile(f)
        os.replace(f"{tmp}.bin", f"{prefix}.bin")
        os.replace(f"{tmp}.idx", f"{prefix}.idx")
    finally:
        for suffix in (".bin", ".idx"):
            Path(f"{tmp}{suffix}").unlink(missing_ok=True)


def check_writers(tokenizer: str) -> str:
    """Both writers on a small corpus of 3 chunks: the .bin/.idx equal, byte for byte, what megatron-core's own
    IndexedDatasetBuilder writes, and both read back through the trainer's readers to the generated documents."""
    import numpy as np

    from trnrecipes.data.arrow import ArrowDocuments
    from trnrecipes.data.indexed import IndexedDocuments, _megatron
    from trnrecipes.data.tokenizer import load_tokenizer

    n, chunk_docs, picks = 2500, 1000, [0, 999, 1000, 1777, 2499]
    with tempfile.TemporaryDirectory() as tmp:
        ours, theirs = Path(tmp) / "ours", Path(tmp) / "theirs"
        write_indexed(ours, n, SEED, chunk_docs)
        chunks = [indexed_chunk(SEED, c, min(chunk_docs, n - c * chunk_docs)) for c in range(3)]
        docs = [d for lengths, tokens in chunks for d in np.split(tokens, np.cumsum(lengths)[:-1])]
        builder = _megatron().IndexedDatasetBuilder(f"{theirs}.bin", dtype=np.uint16)
        for doc in docs:
            builder.add_document(doc, [len(doc)])
        builder.finalize(f"{theirs}.idx")
        for suffix in (".bin", ".idx"):
            if Path(f"{ours}{suffix}").read_bytes() != Path(f"{theirs}{suffix}").read_bytes():
                raise AssertionError(f"write_indexed: {suffix} differs from megatron-core's IndexedDatasetBuilder")
        source = IndexedDocuments(ours)
        assert source.num_docs == n, source.num_docs
        for doc_id, got in zip(picks, source.tokens(picks), strict=True):
            assert np.array_equal(got, docs[doc_id].astype(np.int64)), doc_id

        path = Path(tmp) / "corpus.arrow"
        write_arrow(path, n, SEED, chunk_docs)
        table = vocabulary(SEED)
        texts = [t for c in range(3) for t in arrow_chunk(SEED, c, min(chunk_docs, n - c * chunk_docs), table)[0]]
        texts = [t.as_py() for t in texts]
        assert all(t and t.endswith(".") and "  " not in t and 3 <= len(t.split()) <= 40 for t in texts)
        tok = load_tokenizer(tokenizer)
        source = ArrowDocuments(path, tok, "text")
        assert source.num_docs == n and len(source.texts.chunks) == 3, (source.num_docs, len(source.texts.chunks))
        want = [np.append(ids, tok.eos_id) for ids in tok.encode_batch([texts[i] for i in picks])]
        for got, expected in zip(source.tokens(picks), want, strict=True):
            assert np.array_equal(got, expected)
    return (
        f"writers checked on {n} documents in 3 chunks: .bin/.idx byte-equal to megatron-core's builder, both read back"
    )


def corpus_paths(cache: Path, n: int) -> dict[str, Path]:
    stem = cache / f"synthetic-v{SCALE_VERSION}-seed{SEED}-{label(n)}"
    return {"arrow": stem.with_suffix(".arrow"), "megatron": stem}


def ensure_corpora(cache: Path, sizes: list[int]) -> dict[str, dict[int, Path]]:
    cache.mkdir(parents=True, exist_ok=True)
    corpora: dict[str, dict[int, Path]] = {"arrow": {}, "megatron": {}}
    for n in sizes:
        paths = corpus_paths(cache, n)
        for fmt, path in paths.items():
            done = path if fmt == "arrow" else Path(f"{path}.idx")
            if not done.exists():
                start = time.perf_counter()
                (write_arrow if fmt == "arrow" else write_indexed)(path, n, SEED)
                print(
                    f"  generated {done.name} ({done_size(path) / 1e9:.2f} GB) in {time.perf_counter() - start:.0f} s"
                )
            corpora[fmt][n] = path
    return corpora


def done_size(path: Path) -> int:
    if path.suffix == ".arrow":
        return path.stat().st_size
    return sum(Path(f"{path}{suffix}").stat().st_size for suffix in (".bin", ".idx"))


def memory() -> dict[str, int]:
    """This process's VmRSS, VmHWM (its peak), RssAnon (private: heap, arrays) and RssFile (mapped file pages: the
    page cache, one copy per node whichever processes map it, clean and reclaimable) in bytes, and FilePmdMapped
    (the part of RssFile mapped as whole 2 MiB huge pages)."""
    status = {}
    for name, keys in (("status", ("VmRSS", "VmHWM", "RssAnon", "RssFile")), ("smaps_rollup", ("FilePmdMapped",))):
        with open(f"/proc/self/{name}") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in keys:
                    status[key] = int(value.split()[0]) * 1024
    return status


def reset_peak() -> None:
    """Reset this process's peak RSS (VmHWM) to its current RSS (Linux >= 4.0: clear_refs 5), so that the peak read
    later is the data path's, not the imports' transient (loading a tokenizer, importing torch for megatron)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def measure(fmt: str, corpus: Path, tokenizer: str, seq: int, n_batches: int) -> dict:
    """One measurement (run in a fresh process): open + split + stream of rank 0 of DP until the first batch, then
    n_batches more; memory after each stage. The peak is VmHWM, reset at the baseline, not ru_maxrss: a process's
    ru_maxrss keeps the RSS of the process that started it (exec records the old address space's peak), here
    the parent bench's, hundreds of MiB after it generated a corpus."""
    import gc

    from trnrecipes.data.pack import PackedStream, Prefetcher, batches, split_documents

    if fmt == "arrow":  # what does not depend on the corpus is loaded before the baseline
        from trnrecipes.data.arrow import ArrowDocuments
        from trnrecipes.data.tokenizer import load_tokenizer

        tok = load_tokenizer(tokenizer)
        tok.encode_batch(["warm up the tokenizer"])
    else:
        from trnrecipes.data.indexed import IndexedDocuments, _megatron

        _megatron()
    gc.collect()
    reset_peak()
    stages = {"baseline": memory()}
    start = time.perf_counter()
    source = ArrowDocuments(corpus, tok, "text") if fmt == "arrow" else IndexedDocuments(corpus)
    stages["open"] = memory()
    train, _val = split_documents(source.num_docs, VAL_FRACTION, SEED)
    stages["split"] = memory()
    stream = PackedStream(source, train, seq, seed=SEED, dp_rank=0, dp_size=DP)
    loader = Prefetcher(batches(stream, micro_batch=1))
    batch, position = next(loader)
    startup = time.perf_counter() - start
    stages["first batch"] = memory()
    docs_read = 0
    start, cpu = time.perf_counter(), time.process_time()
    tokens = 0
    for _ in range(n_batches):
        batch, after = next(loader)
        tokens += batch.size
        if after.epoch != position.epoch:
            docs_read += len(stream.order(position.epoch))
        position = after
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    loader.close()
    stages["end"] = memory()
    return {
        "docs": source.num_docs,
        "startup_s": startup,
        "tokens": tokens,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "docs_read": docs_read + position.doc,
        "peak": stages["end"]["VmHWM"],
        "stages": stages,
    }


def median(values: list[float]) -> float:
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def summarise(runs: list[dict]) -> dict:
    """Medians over the repeats: start-up, tokens/s, peak RSS growth over the baseline RSS, the end state."""

    def grown(stage: str, key: str) -> float:
        return median([r["stages"][stage][key] - r["stages"]["baseline"][key] for r in runs])

    return {
        "docs": runs[0]["docs"],
        "docs_read": runs[0]["docs_read"],
        "startup_s": median([r["startup_s"] for r in runs]),
        "rate": median([r["tokens"] / r["seconds"] for r in runs]),
        "cpu_rate": median([r["tokens"] / r["cpu_seconds"] for r in runs]),
        "growth": median([r["peak"] - r["stages"]["baseline"]["VmRSS"] for r in runs]),
        "anon": median([r["stages"]["end"]["RssAnon"] for r in runs]),
        "anon_growth": median(  # the highest of the snapshots: the code before order.py freed some of its arrays
            [max(r["stages"][k]["RssAnon"] - r["stages"]["baseline"]["RssAnon"] for k in r["stages"]) for r in runs]
        ),
        "file_growth": grown("end", "RssFile"),
        "pmd_growth": grown("end", "FilePmdMapped"),
        "stages": {s: {k: grown(s, k) for k in ("RssAnon", "RssFile")} for s in ("open", "split", "first batch")},
    }


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def run_measure(fmt: str, corpus: Path, args: argparse.Namespace, tree: Path | None = None) -> dict:
    """measure() in a fresh process; with `tree`, of the trnrecipes package there (another revision)."""
    cmd = [sys.executable, __file__, "--measure", fmt, str(corpus), "--seq", str(args.seq)]
    cmd += ["--tokenizer", args.tokenizer, "--batches", str(args.batches)]
    cmd += ["--tree", str(tree)] if tree else []
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        print(done.stdout + done.stderr, file=sys.stderr)
        raise SystemExit(f"the measurement of {fmt} {corpus.name}{' at ' + str(tree) if tree else ''} failed")
    return json.loads(done.stdout.strip().splitlines()[-1])


def checkout(rev: str, into: Path) -> Path:
    """trnrecipes/ of git revision `rev`, unpacked under `into` (git archive: the repository is not touched)."""
    import io
    import tarfile

    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "trnrecipes"], capture_output=True, check=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(into, filter="data")
    return into


def scale(args: argparse.Namespace) -> int:
    sizes = sorted(count(s) for s in args.sizes.split(","))
    cores = len(os.sched_getaffinity(0))
    print(
        f"scale: rank 0 of {DP}, seq {args.seq}, micro-batch 1, val_fraction {VAL_FRACTION}, seed {SEED};"
        f" {args.batches} batches timed after the first; median of {args.repeats} fresh processes each; {cores} cores"
    )
    print(f"  {check_writers(args.tokenizer)}")
    corpora = ensure_corpora(Path(args.cache), sizes)
    runs: dict[str, dict[int, list[dict]]] = {fmt: {n: [] for n in sizes} for fmt in corpora}
    for _ in range(args.repeats):  # interleaved, so that a slow moment of the machine spreads over all of them
        for fmt in corpora:
            for n in sizes:
                runs[fmt][n].append(run_measure(fmt, corpora[fmt][n], args))
    old: dict[str, dict[int, dict]] = {}
    if args.against:  # one run each: the old code's costs are far from any target
        with tempfile.TemporaryDirectory() as tmp:
            tree = checkout(args.against, Path(tmp))
            old = {fmt: {n: summarise([run_measure(fmt, corpora[fmt][n], args, tree)]) for n in sizes} for fmt in runs}
    for fmt, by_size in runs.items():
        summary = {n: summarise(r) for n, r in by_size.items()}
        report(fmt, corpora[fmt], summary, sizes, old.get(fmt), args.against)
    return 0


def report(
    fmt: str,
    paths: dict[int, Path],
    summary: dict[int, dict],
    sizes: list[int],
    old: dict[int, dict] | None = None,
    rev: str | None = None,
) -> None:
    name = {"arrow": "Arrow IPC stream (ArrowDocuments, GPT-2 tokenized online)", "megatron": "Megatron .bin/.idx"}
    print(f"\n{name[fmt]}")
    print(
        "  MiB. RSS growth: peak RSS (VmHWM) - RSS after imports; RssAnon: at the end; anon: its growth (the highest"
        " after each stage); file: RssFile growth, of which mapped as 2 MiB pages"
    )
    print(
        f"  {'docs':>14} {'GB':>5} {'read':>6} {'start-up s':>10} {'tokens/s':>10} {'RSS growth':>10} {'RssAnon':>7}"
        f" {'anon':>6} {'file':>6} {'(2 MiB pages)':>13} {'tokens/CPU-s':>12}"
    )
    rows = [(label(n), n, summary[n]) for n in sizes]
    rows += [(f"{label(n)} @{rev}", n, old[n]) for n in sizes] if old else []
    for name_, n, s in rows:
        print(
            f"  {name_:>14} {done_size(paths[n]) / 1e9:5.2f} {s['docs_read']:6,} {s['startup_s']:10.3f}"
            f" {s['rate']:10,.0f} {s['growth'] / MIB:10.1f} {s['anon'] / MIB:7.1f} {s['anon_growth'] / MIB:+6.1f}"
            f" {s['file_growth'] / MIB:+6.0f} {s['pmd_growth'] / MIB:13.0f} {s['cpu_rate']:12,.0f}"
        )
    for name_, _n, s in rows:
        parts = ", ".join(
            f"{stage} {d['RssAnon'] / MIB:+.1f}/{d['RssFile'] / MIB:+.1f}" for stage, d in s["stages"].items()
        )
        print(f"  {name_:>14} anon/file after: {parts}")
    if len(sizes) < 2:
        return
    small, large = summary[sizes[0]], summary[sizes[-1]]
    ratio = f"{label(sizes[-1])}/{label(sizes[0])}"
    d_growth = (large["growth"] - small["growth"]) / MIB
    d_anon = (large["anon_growth"] - small["anon_growth"]) / MIB
    startup = large["startup_s"] / small["startup_s"]
    rate = large["rate"] / small["rate"]
    goal = f"target < {TARGET_RSS_MIB} MiB"
    print(
        f"  {ratio}: RSS growth beyond the corpus's memory-mapped pages (RssAnon: what the issue's target counts)"
        f" {d_anon:+.1f} MiB ({goal}): {verdict(d_anon < TARGET_RSS_MIB)}"
    )
    print(
        f"  {ratio}: peak RSS growth with the mapped pages (page cache the OS can drop, one copy per node; not the"
        f" target) {d_growth:+.1f} MiB"
    )
    print(f"  {ratio}: start-up {startup:.3f}x (target < {TARGET_STARTUP}x): {verdict(startup < TARGET_STARTUP)}")
    low, high = 1 - TARGET_RATE, 1 + TARGET_RATE
    print(f"  {ratio}: tokens/s {rate:.3f}x (target {low:.2f}-{high:.2f}x): {verdict(low <= rate <= high)}", end="")
    cpu_rate = large["cpu_rate"] / small["cpu_rate"]
    print(f"; tokens per CPU-second {cpu_rate:.3f}x: {verdict(low <= cpu_rate <= high)} (robust to a busy machine)")
    extra = sizes[-1] - sizes[0]
    per_doc = (large["anon_growth"] - small["anon_growth"]) / extra
    at_billion = max(0.0, small["anon_growth"] + per_doc * (BILLION - sizes[0]))
    print(f"  extrapolated to {BILLION:,} documents, {RANKS_PER_NODE} ranks per node (a line through the two points):")
    print(
        f"    private: ({large['anon_growth'] / MIB:.2f} - {small['anon_growth'] / MIB:.2f} MiB) / {extra:,} docs"
        f" = {per_doc:+.5f} B/doc; {small['anon_growth'] / MIB:.2f} MiB + that x {BILLION - sizes[0]:,}"
        f" = {at_billion / MIB:,.1f} MiB per rank, x {RANKS_PER_NODE} = {at_billion * RANKS_PER_NODE / 2**30:,.2f} GiB"
        " per node"
    )
    print(
        "    mapped page cache (file): one unit per document read (4 KiB to 2 MiB, as the page cache holds the file),"
        " the corpus's size at most; one copy per node whatever its ranks map; clean, so reclaimable"
    )
    old_rank = 3 * 8 * BILLION
    line = f"    before order.py: 3 int64 arrays x 8 B x 1e9 docs = {old_rank / 2**30:,.1f} GiB per rank"
    if fmt == "arrow":
        per_doc_bytes = done_size(paths[sizes[-1]]) / sizes[-1]
        copy = per_doc_bytes * BILLION
        line += (
            f" + combine_chunks' private copy of the text column ({per_doc_bytes:.0f} B/doc here x 1e9"
            f" = {copy / 2**30:,.0f} GiB; more for real documents) = {(old_rank + copy) / 2**30:,.0f} GiB per rank,"
            f" x {RANKS_PER_NODE} = {(old_rank + copy) * RANKS_PER_NODE / 2**40:,.1f} TiB per node"
        )
    else:
        line += f", x {RANKS_PER_NODE} = {old_rank * RANKS_PER_NODE / 2**30:,.0f} GiB per node"
    print(line)
    if old:
        was = (old[sizes[-1]]["anon_growth"] - old[sizes[0]]["anon_growth"]) / extra
        at = old[sizes[0]]["anon_growth"] + was * (BILLION - sizes[0])
        print(
            f"    measured at {rev}: private ({old[sizes[-1]]['anon_growth'] / MIB:.1f}"
            f" - {old[sizes[0]]['anon_growth'] / MIB:.1f} MiB) / {extra:,} docs = {was:.2f} B/doc; x 1e9"
            f" = {at / 2**30:,.1f} GiB per rank, x {RANKS_PER_NODE} = {at * RANKS_PER_NODE / 2**40:,.2f} TiB per node"
            f" (after {old[sizes[-1]]['docs_read']:,} documents; its transient peaks are in RSS growth)"
        )


# --- --convert: data to-arrow in worker processes against datasets --------------------------------------------------

CONVERT_VERSION = 1  # in the generated shards' directory name: bump it when the generator changes
CONVERT_WORDS = (50, 1000)  # words per document: ~3 KB on average, about a web page's text
MB = 10**6


def json_shard(path: Path, seed: int, shard: int, target_bytes: int) -> None:
    """One JSON-lines shard of about `target_bytes`: {"text": ...} records of CONVERT_WORDS words, written from
    Arrow buffers (the texts need no escaping: letters, spaces and a full stop); .zst: zstd-compressed."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    table = vocabulary(seed)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    written, chunk = 0, 0
    with pa.output_stream(str(tmp), compression="zstd" if path.name.endswith(".zst") else None) as sink:
        while written < target_bytes:
            texts = arrow_chunk(seed, shard * 1_000_000 + chunk, 200, table, CONVERT_WORDS).column(0)
            head, tail, nothing = (pa.scalar(t, pa.large_string()) for t in ('{"text": "', '"}\n', ""))
            lines = pc.binary_join_element_wise(head, texts, tail, nothing)
            width = np.int64 if pa.types.is_large_string(lines.type) else np.int32
            end = int(np.frombuffer(lines.buffers()[1], width)[-1])
            sink.write(memoryview(lines.buffers()[2])[:end])
            written += end
            chunk += 1
    os.replace(tmp, path)


def convert_corpus(cache: Path, shards: int, shard_mb: int, suffix: str) -> Path:
    """`shards` JSON-lines shards of `shard_mb` MB (uncompressed) under cache/, generated once (the same texts for
    .jsonl and .jsonl.zst)."""
    folder = cache / f"convert-v{CONVERT_VERSION}-{shards}x{shard_mb}MB-{suffix.strip('.').replace('.', '-')}"
    folder.mkdir(parents=True, exist_ok=True)
    for k in range(shards):
        path = folder / f"shard-{k:05d}{suffix}"
        if not path.exists():
            start = time.perf_counter()
            json_shard(path, SEED, k, shard_mb * MB)
            print(f"  generated {path.name} ({path.stat().st_size / MB:.0f} MB) in {time.perf_counter() - start:.1f} s")
    return folder


def peak_rss(pid: int, peaks: dict[int, int]) -> None:
    """VmHWM (peak RSS) of `pid` and every process below it, into peaks (pid -> bytes): the largest seen so far."""
    stack = [pid]
    while stack:
        p = stack.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                hwm = next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:")), 0)
            peaks[p] = max(peaks.get(p, 0), hwm)
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    stack += [int(c) for c in f.read().split()]
        except (OSError, ValueError):  # ended meanwhile
            continue


def timed(cmd: list[str]) -> dict:
    """`cmd` as a whole process (interpreter start-up included): wall seconds, and the peak RSS of the process and of
    each process it started (sampled every 50 ms: VmHWM only grows, so a sample late in a process's life holds its
    peak)."""
    peaks: dict[int, int] = {}
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    while proc.poll() is None:
        peak_rss(proc.pid, peaks)
        time.sleep(0.05)
    seconds = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr.read()}")
    main_rss = peaks.pop(proc.pid, 0)
    return {"seconds": seconds, "main_rss": main_rss, "worker_rss": max(peaks.values(), default=0)}


def timed_at_once(cmds: list[list[str]]) -> float:
    """Wall seconds from starting every command at once until the last ends."""
    start = time.perf_counter()
    procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for cmd in cmds]
    for cmd, proc in zip(cmds, procs, strict=True):
        if proc.wait():
            raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr.read()}")
    return time.perf_counter() - start


def halves(folder: Path, into: Path) -> list[Path]:
    """Two directories of symlinks to the first and the second half of `folder`'s files."""
    files = sorted(folder.iterdir())
    dirs = [into / "half-0", into / "half-1"]
    for k, d in enumerate(dirs):
        d.mkdir()
        for f in files[k * len(files) // 2 : (k + 1) * len(files) // 2]:
            (d / f.name).symlink_to(f)
    return dirs


def hf_convert(folder: str, out: str, num_proc: int, cache: str, synced: bool = False) -> None:
    """What a user of datasets writes: load_dataset("json") over the shards with num_proc, then save_to_disk;
    `synced`: then its output fsynced, as ours is before it takes its name (the same durability)."""
    import datasets

    datasets.disable_progress_bars()
    files = sorted(str(p) for p in Path(folder).iterdir())
    dataset = datasets.load_dataset("json", data_files=files, split="train", num_proc=num_proc, cache_dir=cache)
    dataset.save_to_disk(out)
    if synced:
        from trnrecipes.files.durable import sync_tree

        sync_tree(out)


def convert(args: argparse.Namespace) -> int:
    import platform

    cores = len(os.sched_getaffinity(0))
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "")
    print(
        f"convert: {args.shards} JSON-lines shards of {args.shard_mb} MB, to one Arrow file; whole processes timed"
        f" (interpreter start-up included), median of {args.repeats}; {cores} cores ({cpu or platform.machine()})"
    )
    cache = Path(args.cache)
    trnrecipes = [sys.executable, "-m", "trnrecipes", "data", "to-arrow"]
    zst_ok = importlib_spec("zstandard")
    for suffix in (".jsonl", ".jsonl.zst"):
        folder = convert_corpus(cache, args.shards, args.shard_mb, suffix)
        size = sum(p.stat().st_size for p in folder.iterdir())
        json_mb = sum(p.stat().st_size for p in convert_corpus(cache, args.shards, args.shard_mb, ".jsonl").iterdir())
        json_mb /= MB
        sides = {"ours --workers 1": 1, "ours --workers 2": 2, "datasets num_proc=2": "nosync",
                 "datasets, then synced": "sync"}  # fmt: skip
        if suffix.endswith(".zst") and not zst_ok:  # its json loader reads .zst only with the zstandard package
            del sides["datasets num_proc=2"], sides["datasets, then synced"]
        runs: dict[str, list[dict]] = {side: [] for side in sides}
        at_once: list[float] = []
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            split = halves(folder, Path(tmp))
            for _ in range(args.repeats):  # interleaved: a slow moment of the machine spreads over all sides
                cmds = [[*trnrecipes, "--in", str(d), "--out", f"{d}.arrow", "--workers", "1"] for d in split]
                at_once.append(timed_at_once(cmds))
                for d in split:
                    Path(f"{d}.arrow").unlink()
                for side, workers in sides.items():
                    out = Path(tmp) / "out"
                    if isinstance(workers, int):
                        cmd = [*trnrecipes, "--in", str(folder), "--out", f"{out}.arrow", "--workers", str(workers)]
                    else:
                        hf_cache = Path(tmp) / "hf-cache"  # cleared: every run parses the JSON again
                        cmd = [sys.executable, __file__, "--hf-convert", str(folder), str(out), "2", str(hf_cache),
                               workers]  # fmt: skip
                    runs[side].append(timed(cmd))
                    shutil.rmtree(out, ignore_errors=True)
                    Path(f"{out}.arrow").unlink(missing_ok=True)
                    shutil.rmtree(Path(tmp) / "hf-cache", ignore_errors=True)
        print(f"\n{suffix}: {size / MB:,.0f} MB on disk ({json_mb:,.0f} MB of JSON lines)")
        seconds = {side: median([r["seconds"] for r in rs]) for side, rs in runs.items()}
        for side, rs in runs.items():
            main_rss = median([r["main_rss"] for r in rs]) / MIB
            worker_rss = median([r["worker_rss"] for r in rs]) / MIB
            workers = f", each worker {worker_rss:,.0f} MiB" if worker_rss else ""
            print(
                f"  {side:<22} {seconds[side]:7.2f} s  {json_mb / seconds[side]:7.1f} MB/s of JSON"
                f"  peak RSS: main process {main_rss:,.0f} MiB{workers}"
            )
        w1, w2 = seconds["ours --workers 1"], seconds["ours --workers 2"]
        halved = median(at_once)
        print(f"  two --workers 1 at once, half the shards each: {halved:.2f} s (until both end)")
        print(f"  --workers 2 / --workers 1: {w1 / w2:.2f}x throughput (goal >= 1.8x): {verdict(w1 / w2 >= 1.8)};"
              f" this machine gives the same work split in two, with nothing shared, {w1 / halved:.2f}x")  # fmt: skip
        if "datasets num_proc=2" in seconds:
            ratio = seconds["datasets num_proc=2"] / w2
            print(f"  --workers 2 / datasets num_proc=2: {ratio:.2f}x throughput (goal >= 2x): {verdict(ratio >= 2)}")
            synced = seconds["datasets, then synced"] / w2
            print(f"  --workers 2 / datasets with its output synced as ours is (the same durability): {synced:.2f}x")
        else:
            print("  datasets: not run on .zst (its json loader needs the zstandard package, not installed here)")
    if args.scale_to:
        rss = {}
        for shards in (args.shards, args.scale_to):
            folder = convert_corpus(cache, shards, args.shard_mb, ".jsonl")
            with tempfile.TemporaryDirectory(dir=cache) as tmp:
                cmd = [*trnrecipes, "--in", str(folder), "--out", f"{tmp}/out.arrow", "--workers", "2"]
                rss[shards] = timed(cmd)
        small, large = rss[args.shards]["worker_rss"], rss[args.scale_to]["worker_rss"]
        if not small:
            from trnrecipes.data.parts import UNIT_BYTES

            print(f"\nno worker processes: shards under {UNIT_BYTES / MIB:.0f} MiB are converted together, in one")
            return 0
        print(
            f"\npeak RSS per worker, --workers 2: {args.shards * args.shard_mb:,} MB of input {small / MIB:,.0f} MiB,"
            f" {args.scale_to * args.shard_mb:,} MB {large / MIB:,.0f} MiB: {large / small:.3f}x (goal within 10%):"
            f" {verdict(abs(large / small - 1) <= 0.10)}; the main process {rss[args.shards]['main_rss'] / MIB:,.0f}"
            f" and {rss[args.scale_to]['main_rss'] / MIB:,.0f} MiB"
        )
    return 0


def hf_tokenize(folder: str, out: str, procs: int, tokenizer: str) -> None:
    """What a user of the tokenizers library writes to tokenize JSON-lines shards: a pool of `procs` processes, a
    shard each at a time (_hf_tokenize_shard)."""
    import multiprocessing

    files = sorted(str(p) for p in Path(folder).iterdir())
    Path(out).mkdir()
    with multiprocessing.get_context("spawn").Pool(procs) as pool:
        pool.starmap(_hf_tokenize_shard, [(f, out, tokenizer) for f in files])


def _hf_tokenize_shard(path: str, out: str, tokenizer: str) -> None:
    """One shard's lines read with json, encoded by Tokenizer.encode_batch 1000 at a time (its threads, as the
    library defaults), the ids with EOS after each document written as uint16 to OUT/<shard>.bin."""
    import numpy as np
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{tokenizer}/tokenizer.json")
    with open(path, "rb") as f, open(Path(out) / f"{Path(path).name}.bin", "wb") as sink:
        while lines := f.readlines(1 << 22):
            for start in range(0, len(lines), 1000):
                texts = [json.loads(line)["text"] for line in lines[start : start + 1000]]
                for encoding in tok.encode_batch(texts, add_special_tokens=False):
                    np.array([*encoding.ids, EOS], np.uint16).tofile(sink)


def preprocess_bench(args: argparse.Namespace) -> int:
    """`data preprocess --workers 2` against the tokenizers library in 2 processes (hf_tokenize), whole processes."""
    from trnrecipes.data.tokenizer import load_tokenizer

    cache = Path(args.cache)
    folder = convert_corpus(cache, args.shards, args.shard_mb, ".jsonl")
    json_mb = sum(p.stat().st_size for p in folder.iterdir()) / MB
    engine = load_tokenizer(args.tokenizer).engine
    print(
        f"preprocess: {args.shards} JSON-lines shards of {args.shard_mb} MB ({json_mb:,.0f} MB), {args.tokenizer}"
        f" (ours by {engine}); whole processes timed, median of {args.repeats}; {len(os.sched_getaffinity(0))} cores"
    )
    sides = {
        "ours data preprocess --workers 2": lambda out: [
            sys.executable, "-m", "trnrecipes", "data", "preprocess", "--in", str(folder), "--tokenizer",
            args.tokenizer, "--out", str(out), "--workers", "2"],
        "tokenizers encode_batch, 2 processes": lambda out: [
            sys.executable, __file__, "--hf-tokenize", str(folder), str(out), "2", args.tokenizer],
    }  # fmt: skip
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    tokens: dict[str, int] = {}
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        for _ in range(args.repeats):  # interleaved
            for side, cmd in sides.items():
                out = Path(tmp) / "out"
                runs[side].append(timed(cmd(out)))
                bins = [Path(f"{out}.bin")] if side.startswith("ours") else sorted(out.glob("*.bin"))
                tokens[side] = sum(b.stat().st_size for b in bins) // 2  # uint16 ids
                shutil.rmtree(out, ignore_errors=True)
                for suffix in (".bin", ".idx", ".tokenized_with.json"):
                    Path(f"{out}{suffix}").unlink(missing_ok=True)
    seconds = {side: median([r["seconds"] for r in rs]) for side, rs in runs.items()}
    for side, rs in runs.items():
        print(
            f"  {side:<38} {seconds[side]:7.2f} s  {json_mb / seconds[side]:6.1f} MB/s of JSON"
            f"  {tokens[side] / seconds[side]:>12,.0f} tokens/s  peak RSS: main process"
            f" {median([r['main_rss'] for r in rs]) / MIB:,.0f} MiB, each worker"
            f" {median([r['worker_rss'] for r in rs]) / MIB:,.0f} MiB"
        )
    ours, theirs = sides
    same = "the same" if tokens[ours] == tokens[theirs] else f"NOT the same ({tokens[ours]:,} vs {tokens[theirs]:,})"
    print(f"  tokens written: {same} ({tokens[ours]:,}); ours / tokenizers: {seconds[theirs] / seconds[ours]:.2f}x")
    return 0 if tokens[ours] == tokens[theirs] else 1


def importlib_spec(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--tokenizer", default=str(REPO / "data/tokenizers/gpt2"))
    parser.add_argument("--one", choices=["ours", "run_clm"], help=argparse.SUPPRESS)
    parser.add_argument("--scale", action="store_true", help="the data path's cost against the corpus size")
    parser.add_argument(
        "--sizes", default="1M,16M", help="--scale: documents per corpus (smallest and largest compared)"
    )
    parser.add_argument("--batches", type=int, default=500, help="--scale: batches timed after the first")
    parser.add_argument("--repeats", type=int, default=5, help="--scale: fresh processes per measurement (median)")
    parser.add_argument("--cache", default=str(SCALE_DIR), help="--scale: where the generated corpora are kept")
    parser.add_argument("--against", metavar="REV", help="--scale: also measure trnrecipes/ of git revision REV")
    parser.add_argument("--convert", action="store_true", help="data to-arrow --workers 2 / 1 / datasets")
    parser.add_argument("--shards", type=int, default=8, help="--convert, --preprocess: JSON-lines shards")
    parser.add_argument("--shard-mb", type=int, default=128, help="--convert, --preprocess: MB of JSON lines a shard")
    parser.add_argument("--scale-to", type=int, default=32, help="--convert: shards of the larger input (0: none)")
    parser.add_argument("--preprocess", action="store_true", help="data preprocess --workers 2 / tokenizers")
    parser.add_argument("--hf-convert", nargs=5, help=argparse.SUPPRESS)
    parser.add_argument("--hf-tokenize", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--measure", nargs=2, metavar=("FORMAT", "CORPUS"), help=argparse.SUPPRESS)
    parser.add_argument("--tree", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tree:  # --measure another revision's trnrecipes (--against)
        sys.path.insert(0, args.tree)
    if args.measure:
        fmt, corpus = args.measure
        print(json.dumps(measure(fmt, Path(corpus), args.tokenizer, args.seq, args.batches)))
        return 0
    if args.hf_convert:
        folder, out, num_proc, cache, sync = args.hf_convert
        hf_convert(folder, out, int(num_proc), cache, synced=sync == "sync")
        return 0
    if args.hf_tokenize:
        folder, out, procs, tokenizer = args.hf_tokenize
        hf_tokenize(folder, out, int(procs), tokenizer)
        return 0
    if args.convert:
        return convert(args)
    if args.preprocess:
        return preprocess_bench(args)
    if args.scale:
        return scale(args)
    if not CORPUS.exists():
        print(f"missing {CORPUS}: run `make setup` first", file=sys.stderr)
        return 2
    if args.one:
        print(json.dumps({"ours": ours, "run_clm": run_clm}[args.one](CORPUS, args.tokenizer, args.seq)))
        return 0
    cores = len(os.sched_getaffinity(0))
    print(f"one epoch of {CORPUS.name} ({CORPUS.stat().st_size / 1e6:.1f} MB), seq {args.seq}, {args.tokenizer}")
    result = {}
    for side in ("ours", "run_clm"):
        cmd = [sys.executable, __file__, "--one", side, "--seq", str(args.seq), "--tokenizer", args.tokenizer]
        result[side] = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
        r = result[side]
        rate = r["tokens"] / r["seconds"]
        print(f"  {side:<8} {r['tokens']:>10,} tokens in {r['seconds']:6.2f} s = {rate:>10,.0f} tokens/s", end="")
        print(f"  ({r['engine']} engine)" if "engine" in r else "")
    ours_rate = result["ours"]["tokens"] / result["ours"]["seconds"]
    ratio = ours_rate / (result["run_clm"]["tokens"] / result["run_clm"]["seconds"])
    print(f"ratio ours / run_clm: {ratio:.2f}x (goal >= 3x)")
    per_core = ours_rate / cores
    print(
        f"ours per host core: {per_core:,.0f} tokens/s ({cores} cores); a trn1.32xlarge training Llama2-7B needs"
        f" ~{NODE_NEEDS:,} tokens/s: {NODE_NEEDS / per_core:.2f} core(s) of its 128 vCPUs"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
