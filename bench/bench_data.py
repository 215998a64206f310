"""Benchmark: online tokenize + pack (ours) vs the run_clm recipe (datasets.map(tokenize) + group_texts).

Both read the same Arrow file (the demo corpus), use the same tokenizer, run in one process each (a fresh one, so
nothing is cached) and produce fixed-length samples of every token of one epoch. Prints tokens/s, the ratio
(goal >= 3x), and tokens/s per core against what one trn1.32xlarge consumes training Llama2-7B (~26k tokens/s per
node, FACTS.md): how many host cores the data path needs per node.

    .venv/bin/python bench/bench_data.py [--seq 2048] [--tokenizer data/tokenizers/gpt2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--tokenizer", default=str(REPO / "data/tokenizers/gpt2"))
    parser.add_argument("--one", choices=["ours", "run_clm"], help=argparse.SUPPRESS)
    args = parser.parse_args()
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
