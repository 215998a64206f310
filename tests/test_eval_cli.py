"""`trnrecipes eval run` refuses bad input before loading anything, naming the value and what would be valid."""

from __future__ import annotations

from pathlib import Path

import pytest


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
        (["--workers", "0"], "--workers must be >= 1, got 0"),
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
    assert args == {"pretrained": "/ckpt/hf", "max_length": 4096, **expected}
