"""What a corpus holds is checked before an allocation (sbatch, doctor) and again where training reads it: one
corpus under two names, an empty or too small corpus or blend source, token ids past the model's vocabulary; and a
run dir that is a dangling link or a link loop. Each refusal is one line naming the file and what would be valid."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from conftest import REPO, run_cli

from trnrecipes.config.recipe import load_recipe
from trnrecipes.data import DataError
from trnrecipes.data.indexed import IndexedDocuments, _megatron
from trnrecipes.data.sources import open_sources
from trnrecipes.jobs.corpus_check import corpus_problems

DEMO = REPO / "data/demo/pythondocs.arrow"  # `make setup` makes it
TOKENIZER = "data/tokenizers/demo-sp"  # llama2-tiny's; its model.vocab_size is 4096


def arrow(path: Path, texts: list[str]) -> Path:
    table = pa.table({"text": pa.array(texts, pa.large_string())})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return path


def megatron(prefix: Path, docs: list[list[int]]) -> Path:
    builder = _megatron().IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    for doc in docs:
        builder.add_document(np.array(doc, np.int32), [len(doc)])
    builder.finalize(f"{prefix}.idx")
    return prefix


def sbatch(tmp_path: Path, *overrides: str, recipe: str = "llama2-tiny") -> subprocess.CompletedProcess[str]:
    out = tmp_path / "job"
    args = ["--recipe", recipe, "--nodes", "1", "--out", str(out)]
    done = run_cli("sbatch", *args, "--overrides", shlex.join([f"run_dir={tmp_path / 'run'}", *overrides]))
    assert (done.returncode == 0) == out.exists(), done.stderr
    return done


def sources(*paths: str | Path, megatron: tuple[Path, ...] = ()) -> list[str]:
    blend = [{"path": str(p), "weight": 1, **({"format": "megatron"} if p in megatron else {})} for p in paths]
    return ["data.path=null", "data.sources=" + json.dumps(blend)]


@pytest.mark.parametrize("spelling", ["symbolic link", "hard link", "absolute and relative"])
def test_one_corpus_under_two_names_is_refused_at_sbatch_and_in_training(tmp_path, spelling):
    """Each name would get its own validation split: what one holds out, the other trains on."""
    first = arrow(tmp_path / "a.arrow", [f"document {i}" for i in range(50)])
    second = tmp_path / "b.arrow"
    if spelling == "symbolic link":
        second.symlink_to(first)
    elif spelling == "hard link":
        os.link(first, second)
    else:
        first, second = DEMO, DEMO.relative_to(REPO)  # data paths are relative to the checkout
    done = sbatch(tmp_path, *sources(first, second))
    assert done.returncode == 2, done.stderr
    assert (
        f"data.sources[1].path {second} is data.sources[0].path {first} under another name (the same file"
        f" {Path(first).resolve()})" in done.stderr
    )
    recipe = load_recipe("llama2-tiny", overrides=sources(first, second))
    with pytest.raises(DataError, match=r"data.sources\[1\].path .* is data.sources\[0\].path .* another name"):
        open_sources(recipe.data, REPO, seed=0)
    other = arrow(tmp_path / "c.arrow", [f"document {i}" for i in range(50)])  # equal content, another file: fine
    assert corpus_problems(load_recipe("llama2-tiny", overrides=sources(first, other)), REPO) == ([], [])


def test_a_shard_directory_and_one_of_its_shards_are_one_corpus_in_part(tmp_path):
    """Each is split with its own held-out documents: what the shard's split holds out, the directory trains on."""
    shards = tmp_path / "shards"
    done = run_cli("data", "to-arrow", "--in", str(DEMO), "--out", str(shards), "--shard-bytes", "3M")
    assert done.returncode == 0, done.stderr
    shard = shards / "shard_000000.arrow"
    assert shard.is_file() and len(list(shards.glob("shard_*.arrow"))) > 1
    for first, second in ((shards, shard), (shard, shards)):
        done = sbatch(tmp_path, *sources(first, second))
        assert done.returncode == 2, done.stderr
        assert (
            f"data.sources[1].path {second} is data.sources[0].path {first} in part (a shard directory and its shard)"
            f" (the same file {shard.resolve()})" in done.stderr
        ), done.stderr
    with pytest.raises(DataError, match=r"data.sources\[1\].path .* in part"):
        open_sources(load_recipe("llama2-tiny", overrides=sources(shards, shard)).data, REPO, seed=0)
    (tmp_path / "link").symlink_to(shards)  # the directory itself under two names
    done = sbatch(tmp_path, *sources(shards, tmp_path / "link"))
    assert f"is data.sources[0].path {shards} under another name (the same file {shards})" in done.stderr


@pytest.mark.parametrize(
    ("docs", "val_fraction", "expected"),
    [
        (0, 0.01, "has no documents; a corpus needs at least 3 at this layout"),
        (1, 0.01, "1 document(s); data.val_fraction 0.01 holds out 1 for validation, leaving 0 to train on, but each"
                  " of the 2 data-parallel ranks reads its own: it needs at least 3 documents"),
        (2, 0.01, "2 document(s); data.val_fraction 0.01 holds out 1 for validation, leaving 1 to train on, but"
                  " each of the 2 data-parallel ranks reads its own: it needs at least 3 documents (or"
                  " data.val_fraction=0)"),
        (1, 0.0, "1 document(s), but each of the 2 data-parallel ranks reads its own: it needs at least 2 documents"),
        (3, 0.01, None),
        (2, 0.0, None),
    ],
)  # fmt: skip
def test_too_few_documents_for_the_split_and_the_ranks_are_refused_before_allocation(
    tmp_path, docs, val_fraction, expected
):
    corpus = arrow(tmp_path / "small.arrow", [f"document {i}" for i in range(docs)])
    done = sbatch(tmp_path, f"data.path={corpus}", f"data.val_fraction={val_fraction}")
    if expected is None:
        assert done.returncode == 0, done.stderr
        return
    assert done.returncode == 2 and f"data.path {corpus}: {expected}" in done.stderr, done.stderr


def test_the_doctor_refuses_a_corpus_that_shrank_after_sbatch_and_a_blend_with_an_empty_source(tmp_path):
    big = arrow(tmp_path / "big.arrow", [f"document {i}" for i in range(50)])
    empty = megatron(tmp_path / "empty", [])
    done = sbatch(tmp_path, *sources(big, empty, megatron=(empty,)))
    assert done.returncode == 2 and f"data.sources[1].path {empty}: has no documents" in done.stderr, done.stderr
    assert sbatch(tmp_path, f"data.path={big}").returncode == 0
    arrow(big, ["just one document"])  # replaced after the job was written
    doctor = run_cli("doctor", "--config", str(tmp_path / "job/recipe.yaml"))
    assert doctor.returncode == 2, doctor.stdout + doctor.stderr
    (line,) = [x for x in doctor.stdout.splitlines() if x.startswith("error:")]
    assert line.endswith(f"data.path {big}: 1 document(s); data.val_fraction 0.01 holds out 1 for validation, leaving"
                         " 0 to train on, but each of the 2 data-parallel ranks reads its own: it needs at least 3"
                         " documents")  # fmt: skip


def test_token_ids_past_the_vocabulary_are_refused_at_sbatch_and_in_training(tmp_path):
    """Made by another tokenizer and without the record beside it: every rank died with IndexError and the job was
    requeued as a node failure."""
    prefix = megatron(tmp_path / "other", [[5, 6, 7, 4200, 8]] * 3 + [[1, 2, 3]] * 40)
    format_ = "data.format=megatron"
    done = sbatch(tmp_path, f"data.path={prefix}", format_)
    assert done.returncode == 2, done.stderr
    assert f"data.path {prefix}: token id 4,200 (found in it) is at or above model.vocab_size 4,096" in done.stderr
    job = tmp_path / "job"
    overrides = f"run_dir={tmp_path / 'run'} data.path={tmp_path / 'later'} {format_}"
    written = run_cli("sbatch", "--recipe", "llama2-tiny", "--nodes", "1", "--out", str(job), "--no-data-check",
                      "--overrides", overrides)  # fmt: skip
    assert written.returncode == 0, written.stderr
    for ext in (".bin", ".idx"):  # the corpus appears after the job was written
        os.link(f"{prefix}{ext}", f"{tmp_path / 'later'}{ext}")
    # Training on it anyway (no sbatch, no doctor): the first document with such an id is a DataError, exit 2,
    # recorded as a failure a requeue would repeat.
    fatal = tmp_path / "fatal"
    env = {**os.environ, "TRNRECIPES_FATAL_FILE": str(fatal)}
    train = subprocess.run(
        [sys.executable, "-m", "trnrecipes", "train", "--config", str(job / "recipe.yaml"),
         "cluster.workers_per_node=1", "train.max_steps=3", "data.val_fraction=0"],
        cwd=REPO, capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert train.returncode == 2, train.stderr[-3000:]
    assert "Traceback" not in train.stderr and "IndexError" not in train.stderr
    assert "holds token id 4,200, at or above model.vocab_size 4,096" in train.stderr
    assert "holds token id 4,200" in fatal.read_text()
    ok = IndexedDocuments(prefix, vocab_size=4201)  # the check's edge: 4200 is the last id of a 4201 vocabulary
    assert [len(t) for t in ok.tokens([0, 3])] == [5, 3]


@pytest.mark.parametrize("kind", ["dangling link", "link loop"])
def test_a_run_dir_that_is_a_broken_link_is_refused_at_sbatch_and_by_the_doctor(tmp_path, kind):
    run = tmp_path / "run"
    if kind == "dangling link":
        run.symlink_to(tmp_path / "gone")
        why = f"{run} is a symbolic link to {tmp_path / 'gone'}, which does not exist"
    else:
        (tmp_path / "loop").symlink_to(run)
        run.symlink_to(tmp_path / "loop")
        why = f"{run}: a symbolic link loop"
    done = sbatch(tmp_path)
    assert done.returncode == 2 and f"run dir {run}: {why}" in done.stderr, done.stderr
    written = run_cli("sbatch", "--recipe", "llama2-tiny", "--nodes", "1", "--out", str(tmp_path / "job"),
                      "--no-data-check", "--overrides", f"run_dir={run}")  # fmt: skip
    assert written.returncode == 0, written.stderr
    doctor = run_cli("doctor", "--config", str(tmp_path / "job/recipe.yaml"))
    assert doctor.returncode == 2, doctor.stdout + doctor.stderr
    (line,) = [x for x in doctor.stdout.splitlines() if x.startswith("error:")]
    assert f"run dir {run}: {why}" in line


def test_a_megatron_pair_megatron_core_could_not_read_is_refused_before_allocation(tmp_path):
    """A truncated .idx, float ids, a .bin cut mid-id, a negative id: each passed sbatch, then failed on every rank."""
    good = megatron(tmp_path / "good", [[1, 2, 3]] * 40)
    cases = {}
    cut = tmp_path / "cut"
    Path(f"{cut}.bin").write_bytes(Path(f"{good}.bin").read_bytes())
    Path(f"{cut}.idx").write_bytes(Path(f"{good}.idx").read_bytes()[:-9])
    cases[cut] = f"{cut}.idx is truncated: "
    floats = tmp_path / "floats"
    Path(f"{floats}.bin").write_bytes(Path(f"{good}.bin").read_bytes())
    raw = bytearray(Path(f"{good}.idx").read_bytes())
    raw[17] = 6  # megatron-core's DType code for float64
    Path(f"{floats}.idx").write_bytes(bytes(raw))
    cases[floats] = "dtype code 6 is not one of the integer token dtypes megatron-core writes"
    odd = tmp_path / "odd"
    Path(f"{odd}.bin").write_bytes(Path(f"{good}.bin").read_bytes() + b"\x00")
    Path(f"{odd}.idx").write_bytes(Path(f"{good}.idx").read_bytes())
    cases[odd] = f"{odd}.bin holds 481 bytes, not a whole number of int32 ids"
    negative = megatron(tmp_path / "negative", [[1, -5, 3]] + [[1, 2, 3]] * 39)
    cases[negative] = "token id -5 in "
    for prefix, expected in cases.items():
        recipe = load_recipe("llama2-tiny", overrides=f"data.format=megatron data.path={prefix}")
        problems, _ = corpus_problems(recipe, REPO)
        assert len(problems) == 1 and expected in problems[0], (prefix.name, problems)
    assert corpus_problems(load_recipe("llama2-tiny", overrides=f"data.format=megatron data.path={good}"), REPO) == (
        [],
        [],
    )


def test_a_classification_corpus_is_refused_at_render_time_for_what_training_would_refuse(tmp_path):
    """Its labels were checked only when training read them, after the allocation: a corpus made by following
    sbatch's own advice (to-arrow without --label-field) had none. Also a shard directory (training reads one file)
    and a holdout whose labels are past model.num_labels (eval.sbatch failed after the whole run)."""
    from trnrecipes.jobs.data_check import data_problems

    texts = [f"review {i}" for i in range(400)]

    def labelled(name: str, labels: list | None) -> Path:
        columns = {"text": pa.array(texts, pa.large_string())}
        if labels is not None:
            columns["label"] = pa.array(labels, pa.int64())
        table, path = pa.table(columns), tmp_path / name
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        return path

    good = labelled("good.arrow", [i % 2 for i in range(400)])

    def problems(**paths: Path) -> list[str]:
        overrides = [f"data.{key}={path}" for key, path in paths.items()] + [
            "train.val_batches=1",
            "data.val_fraction=0.1",
        ]
        return corpus_problems(load_recipe("bert-tiny", 1, overrides), REPO)[0]

    assert problems(path=good) == []
    unlabelled = labelled("unlabelled.arrow", None)
    assert problems(path=unlabelled) == [
        f"data.path {unlabelled}: has no label column 'label' (data.label_field); its columns: text"
    ]
    past = labelled("past.arrow", [i % 3 for i in range(400)])
    assert problems(path=good, eval_path=past) == [
        f"data.eval_path {past}: row 2 has label 2, outside [0, 2) (model.num_labels 2); 133 row(s) in all"
    ]
    shards = tmp_path / "shards"
    done = run_cli("data", "to-arrow", "--in", str(good), "--out", str(shards), "--shard-bytes", "2K", "--label-field",
                   "label")  # fmt: skip
    assert done.returncode == 0, done.stderr
    (problem,) = problems(path=shards)
    assert problem.startswith(f"data.path {shards}: {shards} is a shard directory; a classification corpus is one")
    missing = data_problems(load_recipe("bert-tiny", 1, [f"data.path={tmp_path / 'mine.arrow'}"]), REPO)
    assert "make it with `trnrecipes data to-arrow --label-field label --in <your" in missing[0]  # it keeps the labels


def test_an_eval_path_that_is_the_training_corpus_is_warned(tmp_path):
    """eval.sbatch's "holdout" accuracy would be measured on documents the run trains on."""
    corpus = REPO / "data/cls/rotten-tomatoes.arrow"  # bert-tiny's data.path
    (tmp_path / "same.arrow").symlink_to(corpus)
    for eval_path, warned in ((tmp_path / "same.arrow", True), (REPO / "data/cls/amazon-snippets.arrow", False)):
        done = run_cli("sbatch", "--recipe", "bert-tiny", "--nodes", "1", "--out", str(tmp_path / "job"), "--force",
                       "--overrides", f"run_dir={tmp_path / 'run'} data.eval_path={eval_path}")  # fmt: skip
        assert done.returncode == 0, done.stderr
        said = f"warning: data.eval_path {eval_path} is data.path {corpus.relative_to(REPO)} (the same file {corpus})"
        assert (said in done.stderr) == warned, done.stderr
