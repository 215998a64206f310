"""The job's data, checked when it is rendered (trnrecipes/jobs/data_check.py): `sbatch` refuses a job whose corpus
or tokenizer is missing, not what data.format says, or larger than the model's vocabulary, naming the command that
makes it and writing nothing; `--no-data-check` (make: nodatacheck=1) skips it; `plan` only warns."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import pyarrow as pa
import pytest
from conftest import REPO
from test_data_inputs import docs, texts_of, write

from trnrecipes.cli import main
from trnrecipes.config.recipe import load_recipe
from trnrecipes.jobs import data_check
from trnrecipes.jobs.data_check import data_problems, tokenizer_vocab_size


def sbatch(cli, tmp_path: Path, overrides: str, *flags: str, recipe: str = "llama2-tiny"):
    out = tmp_path / "job"
    done = cli("sbatch", "--recipe", recipe, "--nodes", "1", "--out", str(out), "--overrides", overrides, *flags)
    return done, out


def test_a_missing_corpus_is_refused_naming_the_command_that_makes_it(cli, tmp_path):
    done, out = sbatch(cli, tmp_path, f"data.path={tmp_path / 'corpus.arrow'}")
    assert done.returncode == 2 and not out.exists(), done.stderr
    assert done.stderr.startswith("error: llama2-tiny-1n would fail on its files")
    lines = done.stderr.splitlines()
    assert len(lines) == 2 and "Traceback" not in done.stderr
    assert lines[1] == (
        f"  data.path {tmp_path / 'corpus.arrow'}: {tmp_path / 'corpus.arrow'} does not exist; make it with"
        f" `trnrecipes data to-arrow --in <your .jsonl(.gz/.zst)/.parquet files or folders, or a datasets save_to_disk"
        f" dir> --out {tmp_path / 'corpus.arrow'}` (docs/data.md, 'Bring your data')"
    )


def test_a_file_that_is_not_arrow_is_refused(cli, tmp_path):
    (tmp_path / "corpus.arrow").write_bytes(b"ARROW1\x00\x00 and then no Arrow at all")
    done, out = sbatch(cli, tmp_path, f"data.path={tmp_path / 'corpus.arrow'}")
    assert done.returncode == 2 and not out.exists() and done.stderr.count("\n") == 2, done.stderr
    assert "corpus.arrow: not a readable Arrow IPC stream" in done.stderr  # pyarrow's check, where it is installed
    (tmp_path / "corpus.arrow").write_text('{"text": "a JSONL file by the wrong name"}\n')
    recipe = load_recipe("llama2-tiny", overrides=f"data.path={tmp_path / 'corpus.arrow'}")
    (problem,) = data_problems(recipe, REPO)  # the light check, which needs no pyarrow
    assert "corpus.arrow is JSON (lines), not Arrow: convert it with `trnrecipes data to-arrow --in " in problem


def test_a_folder_of_several_splits_is_told_the_command_that_converts_its_train_split(tmp_path, capsys):
    """to-arrow refuses a folder of several splits without --split (the held-out ones would leak into training), so
    the advice names the train split: the command given, run as it is, converts it. A DatasetDict is called one, and
    a relative data.path is named where the job reads it (the checkout), not where the user stands."""
    pile = tmp_path / "pile"
    write(pile / "train/00.jsonl", docs("t0"))
    write(pile / "val.jsonl", docs("v"))
    commands = []
    for folder, what in [(pile, "a folder of raw files (2 .jsonl)"), (tmp_path / "dd", "a datasets DatasetDict")]:
        if folder.name == "dd":
            datasets = pytest.importorskip("datasets")
            splits = {"test": ["c"], "train": ["a", "b"]}
            datasets.DatasetDict({k: datasets.Dataset.from_dict({"text": v}) for k, v in splits.items()}).save_to_disk(
                str(folder)
            )
        (problem,) = data_problems(load_recipe("pythia-tiny", overrides=f"data.path={folder}"), REPO)
        assert problem.startswith(f"data.path {folder}: {folder} is {what}"), problem
        assert "holds 2 splits (train, " in problem and f"--split train --out {folder}-train.arrow`" in problem
        commands.append(re.search(r"`trnrecipes (data to-arrow [^`]+)`", problem)[1].split())
    for command in commands:
        assert main(command) == 0, capsys.readouterr().err
    assert texts_of(tmp_path / "pile-train.arrow") == ["t0"] and texts_of(tmp_path / "dd-train.arrow") == ["a", "b"]
    (problem,) = data_problems(load_recipe("pythia-tiny", overrides="data.path=no/such.arrow"), REPO)
    assert problem.endswith(f"--out {REPO / 'no/such.arrow'}` (docs/data.md, 'Bring your data')"), problem
    (pile / "train/00.jsonl").unlink()
    write(pile / "test.jsonl", docs("x"))
    (problem,) = data_problems(load_recipe("pythia-tiny", overrides=f"data.path={pile}"), REPO)
    assert "holds 2 splits (test, validation): convert the split to train on, e.g. with `trnrecipes data to-arrow" \
           f" --in {pile} --split test --out" in problem  # fmt: skip


def test_a_megatron_pair_as_a_classification_holdout_is_told_it_is_read_as_arrow(tmp_path):
    prefix = tmp_path / "held_out"
    Path(f"{prefix}.bin").write_bytes(b"")
    Path(f"{prefix}.idx").write_bytes(data_check.MEGATRON_IDX_MAGIC + b"\x01")
    problems = data_problems(load_recipe("m5-tiny", overrides=f"data.eval_path={prefix}"), REPO)
    assert f"data.eval_path {prefix}: names a Megatron pair ({prefix}.bin/.idx), but it is read as Arrow: make it" \
           f" with `trnrecipes data to-arrow" in problems[-1], problems  # fmt: skip


def test_megatron_data_needs_both_files_and_the_index_header(tmp_path):
    prefix = tmp_path / "pile_text_document"
    recipe = load_recipe("pythia-tiny", overrides=f"data.format=megatron data.path={prefix}")
    (problem,) = data_problems(recipe, REPO)
    assert f"{prefix}.bin and {prefix}.idx missing; make it with `trnrecipes data preprocess" in problem
    assert f"--tokenizer {REPO / recipe.data.tokenizer} --out {prefix}`" in problem
    Path(f"{prefix}.bin").write_bytes(b"")
    Path(f"{prefix}.idx").write_bytes(b"not an index")
    assert data_problems(recipe, REPO) == [
        f"data.path {prefix}: {prefix}.idx is not a Megatron index (no MMIDIDX header); data.format megatron"
    ]
    Path(f"{prefix}.idx").write_bytes(data_check.MEGATRON_IDX_MAGIC + b"\x01")
    assert data_problems(recipe, REPO) == []


def test_raw_folders_and_misnamed_megatron_pairs_are_told_the_fix(tmp_path):
    """A folder of raw shards as data.path is told to convert it; a JSON-lines file that starts with a blank line is
    JSON lines; a Megatron pair named by its .bin, or by its prefix without data.format megatron, or by its .idx, is
    told the name and format to give (not to tokenize it again: hours at TB scale)."""

    def problems(overrides: str) -> list[str]:
        return data_problems(load_recipe("pythia-tiny", overrides=overrides), REPO)

    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "a.jsonl").write_text('{"text": "a"}\n')
    (raw / "b.JSONL").write_text('{"text": "b"}\n')
    assert problems(f"data.path={raw}") == [
        f"data.path {raw}: {raw} is a folder of raw files (2 .jsonl), not an Arrow corpus: convert it with `trnrecipes"
        f" data to-arrow --in {raw} --out {raw}.arrow` and name that in data.path (docs/data.md, 'Bring your data')"
    ]
    # counted by the walk's rule: a user's state.json is records; a rejects list beside what it was made from is not
    held = tmp_path / "held"
    held.mkdir()
    for name in ("part.jsonl", "state.json", "part.jsonl.rejects.jsonl"):
        (held / name).write_text('{"text": "a"}\n')
    (problem,) = problems(f"data.path={held}")
    assert f"{held} is a folder of raw files (1 .json, 1 .jsonl), not an Arrow corpus" in problem
    spaced = tmp_path / "my raw"  # the command pastes as one word per path (it split at the space, and failed)
    spaced.mkdir()
    (spaced / "a.jsonl").write_text('{"text": "a"}\n')
    (problem,) = problems(f"data.path='{spaced}'")
    argv = shlex.split(problem.split("`")[1])
    assert argv == ["trnrecipes", "data", "to-arrow", "--in", str(spaced), "--out", f"{spaced}.arrow"]
    blank = tmp_path / "blank.jsonl"
    blank.write_text('\n  {"text": "a"}\n')
    (problem,) = problems(f"data.path={blank}")
    assert f"is JSON (lines), not Arrow: convert it with `trnrecipes data to-arrow --in {blank} --out" in problem
    prefix = tmp_path / "wiki_text_document"
    Path(f"{prefix}.bin").write_bytes(b"")
    Path(f"{prefix}.idx").write_bytes(data_check.MEGATRON_IDX_MAGIC + b"\x01")
    assert problems(f"data.format=megatron data.path={prefix}.bin") == [
        f"data.path {prefix}.bin: names the pair's .bin file; data.path is its prefix: {prefix}"
    ]
    assert problems(f"data.path={prefix}") == [
        f"data.path {prefix}: names a Megatron pair ({prefix}.bin/.idx): set data.format megatron"
    ]
    (problem,) = problems(f"data.path={prefix}.idx")
    assert problem.startswith(f"data.path {prefix}.idx: {prefix}.idx is a Megatron index: name its prefix (without")
    blend = [{"path": f"{raw}.arrow", "weight": 1}, {"path": str(prefix), "weight": 1}]
    recipe = load_recipe("pythia-tiny", overrides=["data.path=null", f"data.sources={json.dumps(blend)}"])
    assert data_problems(recipe, REPO)[-1] == (
        f"data.sources[1].path {prefix}: names a Megatron pair ({prefix}.bin/.idx): set data.sources[1].format megatron"
    )  # not data.format, which every source without a format of its own takes
    pointer = tmp_path / "lfs.arrow"  # a broken .arrow (a Git LFS pointer) is not called JSON lines by its name
    pointer.write_text("version https://git-lfs.github.com/spec/v1\n")
    (problem,) = problems(f"data.path={pointer}")
    assert "is not an Arrow file (it starts with b'version " in problem, problem


def test_classification_counts_epochs_in_documents_and_refuses_too_few_to_validate(tmp_path):
    """Classification reads one document a sample, however short: its epochs are samples over training documents
    (not tokens over tokens: 10,000 short texts read 5.3 times were said to be read 68 times, and the advice cut the
    run 7x). A held-out split too small for train.val_batches x batch.micro_batch per rank fails the job as it
    starts (train/loop.py): sbatch refuses it first, naming a val_fraction that holds out enough."""
    from trnrecipes.data.holdout import held_out
    from trnrecipes.jobs.corpus_check import corpus_problems
    from trnrecipes.jobs.data_plan import data_plan, epoch_warnings

    def corpus(n: int) -> Path:
        path = tmp_path / f"c{n}.arrow"
        table = pa.table({"text": [f"query {i} product" for i in range(n)], "label": [i % 2 for i in range(n)]})
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        return path

    recipe = load_recipe("bert-tiny", overrides=f"data.path={corpus(10_000)} train.max_steps=5000")
    (plan,) = data_plan(recipe, REPO)
    train_documents = 10_000 - held_out(10_000, recipe.data.val_fraction)
    assert plan.documents == train_documents
    assert plan.epochs == pytest.approx(5000 * recipe.batch.global_batch / train_documents)
    (warning,) = epoch_warnings([plan], recipe)
    assert f"reads it {plan.epochs:,.1f} times (its training split is {train_documents:,} documents)" in warning
    assert f"train.max_steps <= {int(5000 * 10 / plan.epochs):,} for 10 epochs" in warning
    recipe = load_recipe("bert-tiny", overrides=f"data.path={corpus(1_000)}")
    problems, _ = corpus_problems(recipe, REPO)
    wanted = recipe.train.val_batches * recipe.batch.micro_batch
    assert problems and problems[0].startswith(
        f"data.path {tmp_path / 'c1000.arrow'}: train.val_batches {recipe.train.val_batches} x batch.micro_batch"
        f" {recipe.batch.micro_batch} = {wanted} validation examples per data-parallel rank, but data.val_fraction"
        f" {recipe.data.val_fraction} holds out 100 of its 1,000 documents"
    ), problems
    for start in ("0.1", "0.0001"):  # fewer held out than ranks too: the fraction named is every rank's share
        recipe = load_recipe("bert-tiny", overrides=f"data.path={corpus(1_000)} data.val_fraction={start}")
        (problem,) = corpus_problems(recipe, REPO)[0]
        fraction = float(re.search(r"raise data.val_fraction to ([0-9.]+), or lower", problem).group(1))
        recipe = load_recipe("bert-tiny", overrides=f"data.path={corpus(1_000)} data.val_fraction={fraction}")
        assert corpus_problems(recipe, REPO)[0] == [], (start, fraction)


def test_an_empty_data_path_is_refused_before_it_names_the_checkout():
    """data.path= (empty) or . resolved to the checkout, which sbatch then listed as a directory without corpus.json."""
    from trnrecipes.config.sections import RecipeError

    for overrides in (["data.path="], ["data.path=./"], ["data.path=null", 'data.sources=[{path: " ", weight: 1}]']):
        with pytest.raises(RecipeError, match=r"data\.(path|sources\[0\]\.path) '.*' names no file \(the checkout"):
            load_recipe("pythia-tiny", overrides=overrides)


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused(cli, tmp_path):
    tok = tmp_path / "tok"
    tok.mkdir()
    vocab = {f"t{i}": i for i in range(5000)}
    (tok / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": vocab, "merges": []}}))
    done, out = sbatch(cli, tmp_path, f"data.tokenizer={tok}")
    assert done.returncode == 2 and not out.exists()
    assert (
        f"data.tokenizer {tok}: 5,000 ids, more than model.vocab_size 4,096: ids >= 4,096 would index past the"
        " embedding" in done.stderr
    )


def test_a_missing_or_broken_tokenizer_is_named(tmp_path):
    recipe = load_recipe("llama2-tiny", overrides=f"data.tokenizer={tmp_path / 'tok'}")
    (problem,) = data_problems(recipe, REPO)
    assert problem.startswith(f"data.tokenizer {tmp_path / 'tok'}: {tmp_path / 'tok'} does not exist; put a")
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok/tokenizer.json").write_text('{"model": ')
    (problem,) = data_problems(recipe, REPO)
    assert "tokenizer.json is not a readable tokenizer.json (" in problem and "corrupt or truncated?" in problem
    (tmp_path / "tok/tokenizer.json").write_text('{"model": {"vocab": {"a": 0}}, "added_tokens": 5}')
    (problem,) = data_problems(recipe, REPO)  # was a TypeError: sbatch and plan ended in a traceback
    assert "is not a readable tokenizer.json (added_tokens is not a list); corrupt or truncated?" in problem
    by_file = load_recipe("llama2-tiny", overrides=f"data.tokenizer={tmp_path / 'tok/tokenizer.json'}")
    assert data_problems(by_file, REPO) == [
        f"data.tokenizer {tmp_path / 'tok/tokenizer.json'}: names a file; data.tokenizer is a directory holding"
        f" tokenizer.json (here {tmp_path / 'tok'})"
    ]
    llama = load_recipe("llama2-7b", nodes=1)  # the gated tokenizer: where to get it
    assert any("Llama 2's tokenizer is gated on the Hugging Face Hub" in p for p in data_problems(llama, tmp_path))


def test_no_data_check_writes_the_job_and_plan_only_warns(cli, tmp_path):
    done, out = sbatch(cli, tmp_path, f"data.path={tmp_path / 'later.arrow'}", "--no-data-check")
    assert done.returncode == 0 and (out / "run.sbatch").is_file(), done.stderr
    plan = cli("plan", "--recipe", "llama2-tiny", "--nodes", "1", "--overrides", f"data.path={tmp_path / 'x.arrow'}")
    assert plan.returncode == 0 and plan.stderr.startswith(f"warning: data.path {tmp_path / 'x.arrow'}: ")
    quiet = cli("plan", "--recipe", "llama2-tiny", "--nodes", "1", "--no-data-check", "--overrides",
                f"data.path={tmp_path / 'x.arrow'}")  # fmt: skip
    assert quiet.returncode == 0 and quiet.stderr == ""


def test_make_passes_nodatacheck(tmp_path):
    args = [
        "make",
        "--no-print-directory",
        "recipe=llama2-7b",
        "nodes=16",
        f"out={tmp_path / 'job'}",
        f"overrides=run_dir={tmp_path / 'run'}",
    ]
    for off in ([], ["nodatacheck=0"], ["nodatacheck=NO"]):  # 0 is off, as nothing is: it passed the flag once
        refused = subprocess.run([*args, *off, "sbatch"], cwd=REPO, capture_output=True, text=True, timeout=300)
        assert refused.returncode != 0 and "llama2-7b-16n would fail on its files" in refused.stderr
    odd = subprocess.run([*args, "nodatacheck=maybe", "sbatch"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert "make: nodatacheck=maybe: give nodatacheck=1 to switch it on (0 or nothing: off)" in odd.stderr
    assert odd.returncode == 2 and not (tmp_path / "job").exists()
    done = subprocess.run([*args, "nodatacheck=1", "sbatch"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and (tmp_path / "job/run.sbatch").is_file(), done.stderr


def test_every_shipped_recipe_that_make_setup_provides_passes(tmp_path):
    """The demo and classification recipes find their data after `make setup`; the lists the messages use are the
    files setup makes."""
    from trnrecipes.data import corpora

    assert {f"data/cls/{c.file}" for c in corpora.CORPORA} | {"data/tokenizers/bert-uncased"} == set(
        data_check.CLASSIFICATION_FILES
    )
    for name in ("pythia-tiny", "llama2-tiny", "neox-tiny", "bert-tiny", "minilm-cls", "llama2-smoke-trn2",
                 "llama2-smoke-trn1"):  # fmt: skip
        assert data_problems(load_recipe(name, nodes=1), REPO) == [], name


@pytest.mark.parametrize("name", ["gpt2", "demo-sp", "bert-uncased"])
def test_the_vocabulary_size_read_from_json_is_what_tokenizers_counts(name):
    from tokenizers import Tokenizer

    path = REPO / "data/tokenizers" / name / "tokenizer.json"
    assert tokenizer_vocab_size(path) == Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)


def test_the_vocabulary_size_counts_unigram_lists_and_added_tokens_past_the_vocabulary(tmp_path):
    unigram = tmp_path / "unigram.json"
    unigram.write_text(json.dumps({"model": {"type": "Unigram", "vocab": [["<unk>", 0.0], ["a", -1.0], ["b", -2.0]]}}))
    assert tokenizer_vocab_size(unigram) == 3
    added = tmp_path / "added.json"
    spec = {"model": {"type": "BPE", "vocab": {"a": 0, "b": 1}}, "added_tokens": [{"id": 9, "content": "<pad>"}]}
    added.write_text(json.dumps(spec))
    assert tokenizer_vocab_size(added) == 10  # the largest id + 1: id 9 must fit the embedding


@pytest.mark.parametrize(
    ("head", "kind"),
    [(b'{"text": "a raw record"}\n', "JSON (lines)"), (b"PAR1\x00\x00", "Parquet"),
     (b"\x1f\x8b\x08\x00", "gzip-compressed (.jsonl.gz?)"), (b"\x28\xb5\x2f\xfd\x00", "zstd-compressed (.jsonl.zst?)")],
)  # fmt: skip
def test_a_raw_corpus_named_as_data_path_is_told_to_be_converted(cli, tmp_path, head, kind):
    raw = tmp_path / "corpus.jsonl"
    raw.write_bytes(head)
    done, out = sbatch(cli, tmp_path, f"data.path={raw}")
    assert done.returncode == 2 and not out.exists(), done.stderr
    assert (
        f"data.path {raw}: {raw} is {kind}, not Arrow: convert it with `trnrecipes data to-arrow --in {raw} --out"
        f" {tmp_path / 'corpus.arrow'}` and name that in data.path" in done.stderr
    )


def test_many_epochs_and_a_small_tokenizer_are_warned_of_by_sbatch_and_plan(cli, tmp_path):
    corpus = tmp_path / "small.arrow"
    table = pa.table({"text": pa.array([f"a short document number {i}" for i in range(40)], pa.large_string())})
    with pa.OSFile(str(corpus), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    overrides = f"data.path={corpus} model.vocab_size=16384 run_dir={tmp_path / 'run'}"
    done, _ = sbatch(cli, tmp_path, overrides)
    planned = cli("plan", "--recipe", "llama2-tiny", "--nodes", "1", "--overrides", overrides)
    for run in (done, planned):
        assert run.returncode == 0, run.stderr
        assert re.search(
            rf"warning: {corpus}: train.max_steps 100 reads it [\d,.]+ times .* the model would memorise"
            r" it\. Use a bigger corpus, or train.max_steps <= \d+ for 10 epochs",
            run.stderr,
        ), run.stderr
        assert (
            "warning: data.tokenizer data/tokenizers/demo-sp: 4,096 ids, under half of model.vocab_size 16,384: the"
            " other 12,288 rows of the embedding would never be trained" in run.stderr
        )
    quiet = cli("plan", "--recipe", "llama2-tiny", "--nodes", "1")  # the shipped recipe: neither
    assert "memorise" not in quiet.stderr and "under half" not in quiet.stderr


def test_a_missing_init_from_checkpoint_is_a_data_problem_naming_the_conversion(tmp_path):
    """A long-context stage starts from a converted checkpoint: missing, the job would stop after the queue."""
    data_problems = data_check.data_problems
    recipe = load_recipe("llama3.1-8b-128k-trn2", overrides=f"train.init_from={tmp_path / 'ckpt'}")
    (problem,) = [p for p in data_problems(recipe, tmp_path) if p.startswith("train.init_from")]
    assert f"{tmp_path / 'ckpt'} does not exist" in problem and "trnrecipes convert from-hf --hf" in problem
    (tmp_path / "ckpt").mkdir()
    (problem,) = [p for p in data_problems(recipe, tmp_path) if p.startswith("train.init_from")]
    assert "ckpt/recipe.yaml: cannot read" in problem  # an empty directory is no checkpoint


def test_sbatch_refuses_the_init_from_checkpoint_the_trainer_would(tmp_path):
    """Found after the queue, before: a checkpoint of another model, or 'keep' of a conversion's weights only. A
    new phase may change how the model runs (activation checkpointing) and a rotary model's context (a long-context
    stage: max_seq_len, RoPE base and scaling); a `convert from-hf` without --recipe took the former from the
    family's tiny recipe and was refused for it."""
    import yaml

    def init_from_problems(saved_overrides: list[str], *overrides: str) -> list[str]:
        saved = load_recipe("llama3.1-8b", overrides=saved_overrides)
        (tmp_path / "ckpt").mkdir(exist_ok=True)
        (tmp_path / "ckpt/recipe.yaml").write_text(yaml.safe_dump(saved.to_dict(), sort_keys=False))
        recipe = load_recipe("llama3.1-8b-128k-trn2", overrides=[f"train.init_from={tmp_path / 'ckpt'}", *overrides])
        return [p for p in data_check.data_problems(recipe, REPO) if p.startswith("train.init_from")]

    base = ["model.max_seq_len=8192", "model.rope_scaling=null", "model.activation_checkpointing=none"]
    assert init_from_problems(base) == []
    (problem,) = init_from_problems([*base, "model.num_layers=30"])
    assert problem == (
        f"train.init_from {tmp_path / 'ckpt'}: its model section differs from this recipe's (checkpoint -> recipe):"
        " model.num_layers: 30 -> 32; a model fine-tunes in the shape it was trained in"
    )
    (problem,) = init_from_problems(base, "train.init_optimizer=keep")
    assert problem.endswith("holds weights only (no optimizer state: a `convert from-hf` output or a model-only"
                            " copy), so train.init_optimizer 'keep' has nothing to keep; use 'reset'")  # fmt: skip
    (tmp_path / "ckpt/state.json").write_text("{}")
    assert init_from_problems(base, "train.init_optimizer=keep") == []


def test_an_init_from_checkpoint_this_user_cannot_search_is_one_line(tmp_path, monkeypatch):
    """Another user's 0700 checkpoint: Python 3.11's Path.is_file raises EACCES (root, running the tests, is never
    refused: the refusal is stood in)."""
    (tmp_path / "ckpt").mkdir()
    real = Path.is_file
    monkeypatch.setattr(Path, "is_file", lambda p: real(p) if p.name != "state.json" else (_ for _ in ()).throw(
        PermissionError(13, "Permission denied")))  # fmt: skip
    recipe = load_recipe("llama2-tiny", overrides=[f"train.init_from={tmp_path / 'ckpt'}", "train.init_optimizer=keep"])
    (problem,) = [p for p in data_check.data_problems(recipe, REPO) if p.startswith("train.init_from")]
    assert problem == f"train.init_from {tmp_path / 'ckpt'}: cannot be read (Permission denied)"


def test_an_arrow_stream_cut_short_as_data_path_is_refused(tmp_path):
    """A copy cut at a record batch's end reads as a whole corpus (pyarrow stops at the cut, without a word): the
    stream's end-of-stream marker, which every writer puts last, is looked for."""
    table = pa.table({"text": ["a", "b"]})
    corpus = tmp_path / "corpus.arrow"
    with pa.OSFile(str(corpus), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    recipe = load_recipe("llama2-tiny", overrides=f"data.path={corpus}")
    assert data_problems(recipe, REPO) == []
    corpus.write_bytes(corpus.read_bytes()[:-8])
    assert data_problems(recipe, REPO) == [
        f"data.path {corpus}: {corpus} is an Arrow stream without its end-of-stream marker: cut short (a copy or a"
        " write interrupted?), or written by a writer never closed; copy or write it again; data.format arrow"
    ]


def test_a_classifier_whose_pad_id_is_not_its_tokenizers_is_refused_before_the_queue():
    """Training refuses it at its start (the model would attend to padding); sbatch reads the tokenizer's files."""
    problems = data_check.data_problems(load_recipe("bert-tiny", overrides="model.pad_token_id=1"), REPO)
    assert problems == [
        "data.tokenizer data/tokenizers/bert-uncased: pads with id 0 but model.pad_token_id is 1: the model would"
        " attend to padding; set model.pad_token_id=0"
    ]
    assert data_check.data_problems(load_recipe("bert-tiny"), REPO) == []
