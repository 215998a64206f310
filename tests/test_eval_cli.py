"""`trnrecipes eval run` / `eval code` refuse bad input before loading anything, in one line naming the value (or
file) and what would be valid."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from conftest import REPO

PROBLEMS = REPO / "data/eval/humaneval/HumanEval.jsonl.gz"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--humaneval-n", "0"], "--humaneval-n must be positive, got 0"),
        (["--limit", "-1"], "--limit must be positive, got -1"),
        (["--max-gen-toks", "0"], "--max-gen-toks must be positive, got 0"),
        (["--humaneval-temperature", "0"], "--humaneval-temperature must be positive, got 0.0"),
        (["--max-length", "0"], "--max-length must be positive, got 0"),
        (["--tasks", "mmlu"], "is not a checkpoint (no manifest.json), a run dir with checkpoints (no checkpoints/)"),
        (["--tasks", "humaneval"], "humaneval runs model-written code: add --allow-code-execution"),
        (["--tasks", "mmlu", "--baseline", "nope.json"], "baseline file nope.json does not exist"),
    ],
)
def test_bad_eval_arguments_are_refused_with_the_reason(cli, tmp_path, args, message):
    done = cli("eval", "run", "--ckpt", str(tmp_path), *args)
    assert done.returncode == 2 and message in done.stderr, done.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--k", "1,0"], "--k must be comma-separated positive integers (e.g. 1,10,100), got '1,0'"),
        (["--k", "one"], "--k must be comma-separated positive integers (e.g. 1,10,100), got 'one'"),
        (["--workers", "0"], "--workers must be between 1 and 64, got 0"),
        # each program runs as a sandbox uid of its own: an unbounded count would run into system accounts' uids
        (["--workers", "1000"], "--workers must be between 1 and 64, got 1000"),
        (["--timeout", "0"], "--timeout must be > 0 seconds, got 0.0"),
    ],
)
def test_bad_eval_code_arguments_name_the_flag_at_fault(cli, tmp_path, args, message):
    done = cli("eval", "code", "--samples", str(tmp_path / "samples.jsonl"), *args)
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_a_run_dir_without_a_complete_checkpoint_is_named(cli, tmp_path):
    (tmp_path / "checkpoints" / ".step_5.tmp").mkdir(parents=True)  # a half-written save is not evaluated
    done = cli("eval", "run", "--ckpt", str(tmp_path), "--tasks", "mmlu")
    assert done.returncode == 2 and f"run dir {tmp_path} has no complete checkpoint" in done.stderr, done.stderr


def test_a_run_dir_given_as_dot_is_read_like_any_other(cli, tmp_path):
    (tmp_path / "checkpoints" / ".step_5.tmp").mkdir(parents=True)
    done = cli("eval", "run", "--ckpt", ".", "--tasks", "mmlu", "--data-dir", str(REPO / "data/eval"), cwd=tmp_path)
    assert done.returncode == 2 and "run dir . has no complete checkpoint" in done.stderr, done.stderr  # a traceback


def test_a_classifier_is_refused_before_its_export_naming_predict(cli, tmp_path):
    import torch

    from trnrecipes.checkpoint import write_model_checkpoint
    from trnrecipes.config.recipe import load_recipe

    ckpt = write_model_checkpoint(tmp_path / "cls", {"w": torch.zeros(4)}, load_recipe("bert-tiny"))
    done = cli("eval", "run", "--ckpt", str(ckpt), "--tasks", "boolq", "--limit", "1")
    assert done.returncode == 2 and "holds a bert model (objective 'classification'): eval run scores" in done.stderr
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"architectures": ["BertForSequenceClassification"]}))
    done = cli("eval", "run", "--ckpt", str(hf), "--tasks", "boolq", "--limit", "1")
    assert done.returncode == 2 and "holds a BertForSequenceClassification, not a causal" in done.stderr, done.stderr
    (hf / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))  # causal, named otherwise
    done = cli("eval", "run", "--ckpt", str(hf), "--tasks", "boolq", "--limit", "1")
    assert "not a causal" not in done.stderr, done.stderr  # it goes on (and fails on the dir's missing weights)
    assert sorted(p.name for p in tmp_path.iterdir())[:2] == ["cls", "hf"]  # nothing exported from them


def test_a_checkpoint_that_fails_as_it_is_read_leaves_no_empty_results_dir(cli, tmp_path):
    import torch

    from trnrecipes.checkpoint import write_model_checkpoint
    from trnrecipes.config.recipe import load_recipe

    recipe = load_recipe("llama2-tiny")
    ckpt = write_model_checkpoint(tmp_path / "ck", {"w": torch.zeros(4)}, recipe)
    weights = bytearray((ckpt / "model.safetensors").read_bytes())
    weights[-2] ^= 0xFF
    (ckpt / "model.safetensors").write_bytes(bytes(weights))
    done = cli("eval", "run", "--ckpt", str(ckpt), "--tasks", "boolq", "--limit", "1")
    assert done.returncode == 2 and "model.safetensors: checksum mismatch" in done.stderr, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # its ck-eval/ was left, empty
    in_run = write_model_checkpoint(tmp_path / "run/checkpoints/step_5", {"w": torch.zeros(4)}, recipe)
    (in_run / "model.safetensors").write_bytes(bytes(weights))
    done = cli("eval", "run", "--ckpt", str(in_run), "--tasks", "boolq", "--limit", "1")
    assert done.returncode == 2 and sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoints"]  # eval/


def test_a_checkpoint_its_run_prunes_while_eval_reads_it_is_named_as_pruned_not_corrupt(monkeypatch, tmp_path, capsys):
    import shutil

    import torch

    import trnrecipes.convert as convert
    from trnrecipes.checkpoint import write_model_checkpoint
    from trnrecipes.cli import main
    from trnrecipes.config.recipe import load_recipe

    ckpt = write_model_checkpoint(tmp_path / "ck", {"w": torch.zeros(4)}, load_recipe("llama2-tiny"))
    real_to_hf = convert.to_hf

    def pruned_first(source, out, *args, **kwargs):  # a run still training removes it (checkpoint.keep_last)
        shutil.rmtree(source)
        return real_to_hf(source, out, *args, **kwargs)

    monkeypatch.setattr(convert, "to_hf", pruned_first)
    assert main(["eval", "run", "--ckpt", str(ckpt), "--tasks", "boolq", "--limit", "1"]) == 2
    err = capsys.readouterr().err
    assert f"error: {ckpt} was pruned by its run while it was read (checkpoint.keep_last): evaluate again" in err, err
    assert list(tmp_path.iterdir()) == []  # nor its empty ck-eval/


@pytest.mark.parametrize(
    ("device", "expected"),
    [
        ("cpu", {"dtype": "float32"}),
        # On GPUs: the training precision, split over the node's GPUs (NeoX-20B in fp32 outgrows one 80 GB GPU).
        ("cuda", {"dtype": "bfloat16", "parallelize": True}),
    ],
)
def test_lm_eval_model_args_per_device(device, expected):
    from lm_eval.utils import simple_parse_args_string

    from eval.run import model_args

    args = simple_parse_args_string(model_args(Path("/ckpt/hf"), 4096, device))  # as lm-eval parses them
    # trust_remote_code=False, explicitly: code in a model directory never runs
    assert args == {"pretrained": "/ckpt/hf", "max_length": 4096, "trust_remote_code": False, **expected}


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: d / "none.jsonl", "samples file {path} does not exist"),
        (lambda d: d, "samples file {path}: cannot be read (Is a directory)"),
        (lambda d: _write(d / "s.jsonl", b"\x89PNG\r\n\x1a\n\xff\xfe"), "samples file {path}:1: not UTF-8 text"),
        (lambda d: _write(d / "s.jsonl", b"task_id,completion\n"), "samples file {path}:1: not valid JSON"),
        (lambda d: _write(d / "s.jsonl", b'{"task_id": "HumanEval/0"}\n'), "need string fields task_id and completion"),
        (lambda d: _write(d / "s.jsonl", b'{"task_id": ["HumanEval/0"], "completion": ""}\n'), "need string fields"),
        (lambda d: _write(d / "s.jsonl", b"\n"), "samples file {path}: no samples"),
    ],
)
def test_a_bad_samples_file_is_one_line_naming_it(cli, tmp_path, make, message):
    path = make(tmp_path)
    done = cli("eval", "code", "--samples", str(path), "--problems", str(PROBLEMS), "--allow-code-execution")
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("error: ") and message.format(path=path) in done.stderr, done.stderr


@pytest.mark.parametrize(
    ("name", "data", "message"),
    [
        ("p.jsonl.gz", b'{"task_id": "HumanEval/0"}\n', "cannot be read (Not a gzipped file"),
        ("p.jsonl.gz", gzip.compress(b"\n" * 64, mtime=0)[:20], "a truncated or corrupt gzip file"),
        ("p.jsonl", bytes(range(255, 0, -1)), ":1: not UTF-8 text"),
        ("p.jsonl", b'{"task_id": "HumanEval/0", "prompt": "def f():\\n"}\n', ":1: need string fields task_id, prompt"),
        ("p.jsonl", b"[1, 2]\n", ":1: need string fields task_id, prompt, test, entry_point"),
        ("p.jsonl", b"", ": no problems in it"),
    ],
)
def test_a_bad_problems_file_is_one_line_naming_it(cli, tmp_path, name, data, message):
    problems = _write(tmp_path / name, data)
    samples = _write(tmp_path / "s.jsonl", json.dumps({"task_id": "HumanEval/0", "completion": ""}).encode() + b"\n")
    done = cli("eval", "code", "--samples", str(samples), "--problems", str(problems), "--allow-code-execution")
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert f"error: HumanEval problems {problems}" in done.stderr and message in done.stderr, done.stderr
