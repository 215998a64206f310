"""`trnrecipes eval run` end to end on a tiny checkpoint, offline, and its numbers against lm-eval's own CLI run on
the exported HF directory with the same task files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, run_cli

pytestmark = pytest.mark.slow

TINY = ["cluster.workers_per_node=1", "batch.seq_len=64", "batch.global_batch=4", "batch.micro_batch=2",
        "train.max_steps=8", "train.val_every=1000"]  # fmt: skip
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
GEN_TOKS = 48  # BBH's own cap is 1024 tokens per answer: 27 subtasks x 2 runs would take minutes on a tiny model


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory) -> tuple[Path, dict]:
    tmp = tmp_path_factory.mktemp("eval")
    done = run_cli("train", "--config", "pythia-tiny", *TINY, f"run_dir={tmp / 'run'}")
    assert done.returncode == 0, done.stderr[-2000:]
    ckpt = tmp / "run/checkpoints/step_8"
    cmd = [sys.executable, "-m", "trnrecipes", "eval", "run", "--ckpt", str(ckpt), "--limit", "1",
           "--max-gen-toks", str(GEN_TOKS), "--allow-code-execution", "--humaneval-n", "2",
           "--out", str(tmp / "eval")]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900, env={**os.environ, **OFFLINE})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "| task | shots | metric | value (stderr) | baseline |" in done.stdout
    return tmp / "eval", json.loads((tmp / "eval/results.json").read_text())


def test_all_tasks_are_reported(evaluated):
    out, report = evaluated
    rows = {(r["task"], r["metric"]): r for r in report["results"]}
    assert rows[("trn_mmlu", "acc,none")]["shots"] == 5 and 0 <= rows[("trn_mmlu", "acc,none")]["value"] <= 1
    assert rows[("trn_bbh_cot", "exact_match,get-answer")]["shots"] == 3
    assert rows[("trn_gsm8k_cot", "exact_match,strict-match")]["shots"] == 8
    assert ("humaneval", "pass@1") in rows and ("humaneval", "pass@10") not in rows  # k <= n only
    assert (out / "hf/config.json").exists() and (out / "results.md").read_text().count("\n") == 2 + len(rows)
    assert report["checkpoint"]["step"] == 8 and report["checkpoint"]["path"].endswith("checkpoints/step_8")


def test_numbers_equal_lm_eval_cli_on_the_exported_model(evaluated, tmp_path):
    out, report = evaluated
    args = f"pretrained={out / 'hf'},dtype=float32,max_length=2048"
    cmd = [sys.executable, "-m", "lm_eval", "run", "--model", "hf", "--model_args", args, "--tasks", "trn_mmlu",
           "trn_bbh_cot", "trn_gsm8k_cot", "--include_path", str(out / "tasks"), "--limit", "1", "--device", "cpu",
           "--batch_size", "1", "--gen_kwargs", f"max_gen_toks={GEN_TOKS}",
           "--output_path", str(tmp_path / "lm")]  # fmt: skip
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900, env={**os.environ, **OFFLINE})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (result_file,) = list((tmp_path / "lm").rglob("results_*.json"))
    theirs = json.loads(result_file.read_text())["results"]
    for row in report["results"]:
        if row["task"] != "humaneval":
            assert theirs[row["task"]][row["metric"]] == row["value"], row
