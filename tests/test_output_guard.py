"""Nothing a writing command does loses an input or a checkpoint (trnrecipes/files/outputs.py).

The property: for every writing command and every kind of output (the input itself, a symbolic link to it, a hard
link to it, the directory holding it, inside a checkpoint, inside a run dir's checkpoints/ (also where checkpoints/
is a symbolic link), one of the run dir's own files, below a regular file, a fresh path), either the
command refuses with one line and every byte under the test's directory (inputs, a real checkpoint) is as it was,
or it succeeds and what changed lies within its outputs. Every (command, kind) pair is run, in a seeded random order
of the kinds per command, so no draw of pairs can miss one. Kinds that always collide must be refused; a fresh
path must succeed.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import transformers
from conftest import REPO
from test_infer import hf_dir, randomised, recipe_file, sentences
from tokenizers import BertWordPieceTokenizer

from trnrecipes.checkpoint import verify, write_model_checkpoint
from trnrecipes.cli import main
from trnrecipes.config.recipe import load_recipe
from trnrecipes.files.outputs import run_entry_around
from trnrecipes.files.run_files import LOCK_FILE, RUN_ENTRIES
from trnrecipes.models import build_model

KINDS = ("same", "symlink", "hardlink", "holds_input", "in_checkpoint", "in_checkpoints", "in_linked_checkpoints",
         "run_file", "below_file", "fresh")  # fmt: skip
COLLIDING = set(KINDS) - {"fresh"}
# Kinds that are no clash for a command, so it may go ahead: preprocess writes OUT.bin, .idx, .tokenizer.json and
# .rejects.jsonl beside what --out names; plot adds its PNGs to a directory (a run dir, the one holding it) and
# replaces nothing.
NO_CLASH = {"preprocess": {"same", "symlink", "hardlink", "holds_input"}, "plot": {"same", "holds_input"}}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """A BERT classifier (predict, embed) and a pythia-tiny language model with the demo tokenizer (convert, eval),
    each a real checkpoint, copied into every case's directory."""
    root = tmp_path_factory.mktemp("guard")
    tokenizer = BertWordPieceTokenizer(lowercase=True)
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tokenizer.train_from_iterator(sentences(200, seed=1), vocab_size=60, special_tokens=specials)
    config = transformers.BertConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=32, num_hidden_layers=1,
                                     num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
                                     pad_token_id=0, num_labels=3)  # fmt: skip
    hf_dir(root / "hf-cls", randomised(transformers.BertForSequenceClassification(config)), tokenizer)
    recipe = recipe_file(root / "bert.yaml")
    assert (
        main(["convert", "from-hf", "--hf", str(root / "hf-cls"), "--out", str(root / "cls"), "--recipe", recipe]) == 0
    )
    lm = load_recipe("pythia-tiny", overrides=["model.num_layers=1"])
    torch.manual_seed(0)
    write_model_checkpoint(root / "lm", build_model(lm.model).state_dict(), lm, REPO / lm.data.tokenizer, step=7)
    return {"cls": root / "cls", "lm": root / "lm"}


@dataclass
class Case:
    """One command run in `root`: its argv without --out, the input that --out kinds collide with, and the outputs
    it may write for a given --out."""

    argv: list[str]
    collide_with: Path  # "same" and "symlink" name it; "hardlink" links to it (or to a file in it)
    directory: bool  # --out is a directory
    outputs: Callable[[Path], list[Path]] = field(default=lambda out: [out])
    ext: str = ""


def lay_out(root: Path, checkpoints: dict[str, Path], which: str) -> Path:
    """root/{in/, run/checkpoints/step_7 (a copy of checkpoint `which`), run/metrics.jsonl, afile}."""
    (root / "in").mkdir(parents=True)
    rows = [json.dumps({"text": t, "label": i % 3}) for i, t in enumerate(sentences(20))]
    (root / "in/rows.jsonl").write_text("\n".join(rows) + "\n")
    ckpt = root / "run/checkpoints/step_7"
    shutil.copytree(checkpoints[which], ckpt)
    steps = [{"step": s, "loss": 5.0 - s / 10, "grad_norm": 1.0, "param_norm": 10.0} for s in (1, 2, 3)]
    (root / "run/metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    (root / "afile").write_text("a regular file\n")
    shutil.copy(REPO / "recipes/pythia/pythia-tiny.yaml", root / "in/recipe.yaml")
    return ckpt


def case(command: str, root: Path, ckpt: Path) -> Case:
    rows = root / "in/rows.jsonl"
    if command == "predict":
        return Case(["predict", "--ckpt", str(ckpt), "--in", str(rows)], rows, False,
                    lambda out: [out, out.with_name(f"{out.stem}.summary.json")], ".jsonl")  # fmt: skip
    if command == "embed":
        return Case(["embed", "--ckpt", str(ckpt), "--in", str(rows), "--chunk-rows", "8", "--batch-size", "4"],
                    rows, False, lambda out: [out, out.with_name(out.name + ".parts")], ".arrow")  # fmt: skip
    if command == "eval-run":
        argv = ["eval", "run", "--ckpt", str(ckpt), "--tasks", "arc_easy", "--limit", "1",
                "--data-dir", str(REPO / "data/eval")]  # fmt: skip
        return Case(argv, ckpt, True)
    if command == "to-hf":
        return Case(["convert", "to-hf", "--ckpt", str(ckpt)], ckpt, True)
    if command == "to-arrow":  # skip: the list of rejected records beside the output is written (and guarded) too
        return Case(["data", "to-arrow", "--in", str(rows), "--on-bad-record", "skip"], rows, False,
                    lambda out: [out, Path(f"{out}.rejects.jsonl")], ".arrow")  # fmt: skip
    if command == "preprocess":
        tokenizer = str(REPO / "data/tokenizers/gpt2")
        suffixes = (".bin", ".idx", ".tokenizer.json", ".rejects.jsonl")
        return Case(["data", "preprocess", "--in", str(rows), "--tokenizer", tokenizer, "--on-bad-record", "skip"],
                    rows, False, lambda out: [Path(f"{out}{suffix}") for suffix in suffixes])  # fmt: skip
    if command == "sbatch":
        recipe = root / "in/recipe.yaml"
        return Case(["sbatch", "--recipe", str(recipe), "--nodes", "1"], recipe, True)
    if command == "plot":
        return Case(["plot", str(root / "run")], root / "run", True)
    raise AssertionError(command)


def output_of(kind: str, root: Path, c: Case, ckpt: Path) -> Path:
    name = "out" + c.ext
    if kind == "same":
        return c.collide_with
    if kind == "symlink":
        os.symlink(c.collide_with, root / "link")
        return root / "link"
    if kind == "hardlink":  # of the input, or of a file inside an input directory
        target = (
            c.collide_with if c.collide_with.is_file() else next(p for p in c.collide_with.rglob("*") if p.is_file())
        )
        os.link(target, root / "hard")
        return root / "hard"
    if kind == "in_checkpoint":
        return ckpt / name
    if kind == "holds_input":  # the directory the input is in
        return c.collide_with.parent
    if kind == "in_checkpoints":
        return ckpt.parent / name
    if kind == "in_linked_checkpoints":  # RUN/checkpoints is a link to the checkpoints' real home
        real = root / "fast" / "checkpoints"
        real.parent.mkdir()
        os.replace(ckpt.parent, real)
        os.symlink(real, ckpt.parent)
        return ckpt.parent / name
    if kind == "run_file":  # the run's metrics; a directory output or a prefix: in the run's TensorBoard dir
        run = ckpt.parent.parent
        return run / "metrics.jsonl" if not c.directory and "preprocess" not in c.argv else run / "tensorboard" / name
    if kind == "below_file":
        return root / "afile" / name
    return root / "fresh" / name


def snapshot(root: Path) -> dict[str, str]:
    """Every path under `root`: a file's sha256, a link's target, or 'dir'."""
    found = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            found[rel] = "link -> " + os.readlink(p)
        elif p.is_dir():
            found[rel] = "dir"
        else:
            found[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return found


def within(rel: str, outputs: list[Path], root: Path) -> bool:
    """Whether `rel` is an output, lies in one, or is a directory made to hold one."""
    path = root / rel
    return any(path == o or o in path.parents or (path in o.parents and path.is_dir()) for o in outputs)


COMMANDS = {"predict": "cls", "embed": "cls", "eval-run": "lm", "to-hf": "lm", "to-arrow": "lm", "preprocess": "lm",
            "sbatch": "lm", "plot": "lm"}  # fmt: skip
PAIRS = [(command, kind) for command in COMMANDS for kind in random.Random(32).sample(KINDS, len(KINDS))]


@pytest.mark.parametrize(("command", "kind"), PAIRS, ids=[f"{c}-{k}" for c, k in PAIRS])
def test_a_writing_command_refuses_with_one_line_or_writes_only_its_output(
    command, kind, checkpoints, tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)  # sbatch writes its default job dir relative to here
    root = tmp_path / "case"
    ckpt = lay_out(root, checkpoints, COMMANDS[command])
    c = case(command, root, ckpt)
    out = output_of(kind, root, c, ckpt)
    before = snapshot(root)
    capsys.readouterr()

    code = main([*c.argv, "--out", str(out)])

    err = capsys.readouterr().err
    after = snapshot(root)
    verify(ckpt)  # the checkpoint still verifies: every file its manifest lists, nothing else
    if code != 0:
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
        assert after == before, f"refused, yet changed: {set(after.items()) ^ set(before.items())}"
    else:
        changed = {rel for rel in before.keys() | after.keys() if before.get(rel) != after.get(rel)}
        strays = sorted(rel for rel in changed if not within(rel, c.outputs(out), root))
        assert not strays, f"wrote outside its output {out}: {strays}"
    if kind in COLLIDING - NO_CLASH.get(command, set()):
        assert code == 2, f"{command} --out {kind} was not refused"
    if kind == "fresh":
        assert code == 0, err


@pytest.mark.parametrize("mark", ["lock", "step_dirs", "none"])
def test_every_entry_of_a_run_dir_is_its_own_and_a_new_name_in_it_is_not(tmp_path, mark):
    """A run dir is known by the lock every trainer leaves, or by checkpoints/ with step dirs; in one, each of its
    entries (and what lies in them) is the run's, but for plot's plots/ to plot; a dir without those marks has none."""
    run = tmp_path / "run"
    run.mkdir()
    if mark == "lock":
        (run / LOCK_FILE).write_text("")
    elif mark == "step_dirs":
        (run / "checkpoints/step_5").mkdir(parents=True)
    for entry in (*RUN_ENTRIES, ".stop-4242", ".stop-4242.saved"):
        for path, inside in ((run / entry, False), (run / entry / "x" / "out.arrow", True)):
            assert run_entry_around(path) == (None if mark == "none" else (run / entry, inside)), path
    assert run_entry_around(run / "plots" / "loss.png", allowed="plots") is None
    for new in ("eval/step_5/results.json", "embeddings/q.arrow", "metrics.arrow", "stop-1"):
        assert run_entry_around(run / new) is None


def test_a_runs_metrics_and_other_own_files_are_refused_to_every_writing_command(tmp_path, capsys):
    """A run killed before its first checkpoint (the lock and metrics.jsonl, no checkpoints/): `data to-arrow --out
    RUN/metrics.jsonl` is refused in one line, the metrics kept (was: overwritten by an Arrow file); plot still
    writes its default RUN/plots/."""
    run, rows = tmp_path / "run", tmp_path / "rows.jsonl"
    run.mkdir()
    (run / LOCK_FILE).write_text("")
    steps = [{"step": s, "loss": 5.0 - s / 10, "grad_norm": 1.0, "param_norm": 10.0} for s in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    rows.write_text(json.dumps({"text": "a few words"}) + "\n")
    before = snapshot(tmp_path)
    capsys.readouterr()
    assert main(["data", "to-arrow", "--in", str(rows), "--out", str(run / "metrics.jsonl")]) == 2
    assert capsys.readouterr().err == (
        f"error: --out {run / 'metrics.jsonl'} would overwrite metrics.jsonl of the run dir {run}, one of the run's"
        f" own files; give a new name in the run dir (e.g. {run / 'eval/metrics.jsonl'}) or a path outside it\n"
    )
    for argv in (["convert", "to-hf", "--ckpt", str(run), "--out", str(run / "tensorboard")],
                 ["tokenizer", "from-gpt2", "--vocab", str(rows), "--merges", str(rows), "--out", str(run / "plots")],
                 ["plot", str(run), "--out", str(run / "archived")]):  # fmt: skip
        assert main(argv) == 2, argv
        assert "of the run dir" in capsys.readouterr().err
    assert snapshot(tmp_path) == before
    assert main(["plot", str(run)]) == 0 and (run / "plots/loss.png").stat().st_size > 0


def test_preprocess_refuses_a_prefix_that_names_a_directory(tmp_path, capsys):
    """`--out dir/` or `--out dir` (it exists) would write dir/.bin and dir/.idx, hidden files: one line instead."""
    rows, d = tmp_path / "rows.jsonl", tmp_path / "d"
    rows.write_text(json.dumps({"text": "a few words"}) + "\n")
    d.mkdir()
    argv = ["data", "preprocess", "--in", str(rows), "--tokenizer", str(REPO / "data/tokenizers/gpt2"), "--out"]
    for prefix in (f"{d}/", str(d), f"{tmp_path}/new/"):
        assert main([*argv, prefix]) == 2, prefix
        named = Path(prefix)
        assert capsys.readouterr().err == (
            f"error: --out {prefix} names a directory: the outputs would be hidden files in it ({named / '.bin'},"
            f" {named / '.idx'}); give a prefix like {named / 'corpus'} (writes {named / 'corpus'}.bin, ...)\n"
        )
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["d", "rows.jsonl"]


def test_predict_into_an_existing_directory_is_one_line(checkpoints, tmp_path, capsys):
    ckpt = lay_out(tmp_path, checkpoints, "cls")
    assert main(["predict", "--ckpt", str(ckpt), "--in", str(tmp_path / "in/rows.jsonl"), "--out", str(tmp_path)]) == 2
    assert (
        capsys.readouterr().err == f"error: --out {tmp_path} is a directory; give a file path (e.g. {tmp_path}/NAME)\n"
    )


@pytest.mark.parametrize("linked", [False, True], ids=["checkpoints", "checkpoints-a-link"])
def test_the_default_eval_output_of_a_run_dirs_checkpoint_is_beside_the_run_not_in_its_checkpoints(
    checkpoints, tmp_path, linked
):
    ckpt = lay_out(tmp_path, checkpoints, "lm")
    if linked:  # RUN/checkpoints a link to where the checkpoints really are
        os.replace(tmp_path / "run/checkpoints", tmp_path / "fast")
        os.symlink(tmp_path / "fast", tmp_path / "run/checkpoints")
    before = snapshot(tmp_path / "run/checkpoints")
    argv = [
        "eval",
        "run",
        "--ckpt",
        str(ckpt),
        "--tasks",
        "arc_easy",
        "--limit",
        "1",
        "--data-dir",
        str(REPO / "data/eval"),
    ]
    assert main(argv) == 0
    assert (tmp_path / "run/eval/step_7/results.json").is_file()
    assert snapshot(tmp_path / "run/checkpoints") == before  # was: checkpoints/step_7-eval/


@pytest.mark.parametrize("verb", ["sbatch", "plan", "show"])
def test_an_unbalanced_quote_in_overrides_is_one_line(verb, tmp_path, capsys):
    argv = [verb, "--recipe", "pythia-tiny", "--nodes", "1", "--overrides", "data.path='my corpus.arrow"]
    assert main([*argv, *(["--out", str(tmp_path / "job")] if verb == "sbatch" else [])]) == 2
    assert capsys.readouterr().err == (
        'error: overrides "data.path=\'my corpus.arrow" cannot be split into words (No closing quotation); close'
        " every quote, e.g. \"data.path='my corpus.arrow'\"\n"
    )
    assert not (tmp_path / "job").exists()


def test_fine_tuning_another_shape_names_the_fields_that_differ(cli, tmp_path):
    bert = load_recipe("bert-tiny", overrides=["model.num_layers=1"])
    torch.manual_seed(0)
    ckpt = write_model_checkpoint(tmp_path / "ckpt", build_model(bert.model).state_dict(), bert)
    done = cli("train", "--config", "bert-tiny", f"run_dir={tmp_path / 'run'}", "cluster.workers_per_node=1",
               f"train.init_from={ckpt}", "model.num_layers=1", "model.num_labels=3")  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: train.init_from {ckpt}: its model section differs from this recipe's (checkpoint -> recipe):"
        " model.num_labels: 2 -> 3; a model fine-tunes in the shape it was trained in"
    )  # was: both model sections printed whole


def test_a_tokenizer_never_replaces_the_directory_of_its_inputs_or_one_it_did_not_write(tmp_path, capsys, monkeypatch):
    d = tmp_path / "d"
    d.mkdir()
    for name, text in (("vocab.json", "{}"), ("merges.txt", "#version: 0.2\n"), ("notes.txt", "mine\n")):
        (d / name).write_text(text)
    before = snapshot(tmp_path)
    gpt2 = ["tokenizer", "from-gpt2", "--vocab", str(d / "vocab.json"), "--merges", str(d / "merges.txt")]
    assert main([*gpt2, "--out", str(d)]) == 2
    assert f"--out {d} holds the input {d / 'vocab.json'}" in capsys.readouterr().err
    monkeypatch.chdir(d)
    assert main([*gpt2, "--out", "."]) == 2  # was: a ValueError traceback and a temp dir left behind
    assert capsys.readouterr().err == "error: --out . names no directory of its own; give a path ending in a new name\n"
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine\n")
    before = snapshot(tmp_path)
    assert main([*gpt2, "--out", str(mine)]) == 2
    assert "is not a tokenizer directory (it holds notes.txt; no tokenizer.json)" in capsys.readouterr().err
    assert snapshot(tmp_path) == before
    model = tmp_path / "hf"  # a Hugging Face model directory holds a tokenizer.json beside its weights
    model.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (model / name).write_text("{}")
    before = snapshot(tmp_path)
    assert main([*gpt2, "--out", str(model)]) == 2  # it replaced the directory: the weights were gone
    assert "holds config.json, model.safetensors besides its tokenizer files" in capsys.readouterr().err
    assert snapshot(tmp_path) == before


def test_eval_never_replaces_an_hf_directory_it_did_not_export(checkpoints, tmp_path, capsys):
    ckpt = lay_out(tmp_path, checkpoints, "lm")
    out = tmp_path / "models"
    (out / "hf").mkdir(parents=True)
    (out / "hf/config.json").write_text("{}")  # the user's own model, no export record
    before = snapshot(out)
    argv = [
        "eval",
        "run",
        "--ckpt",
        str(ckpt),
        "--tasks",
        "arc_easy",
        "--out",
        str(out),
        "--data-dir",
        str(REPO / "data/eval"),
    ]
    assert main(argv) == 2
    assert f"{out / 'hf'} exists and is not an export of ours" in capsys.readouterr().err
    assert snapshot(out) == before
