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
# lm-eval's window (prompt + answer; prompts are cut from the left to fit), the same on both sides of the parity test:
# the default 2048 spends most of these tests on the long 5- and 8-shot prompts.
WINDOW = 384


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory) -> tuple[Path, dict]:
    tmp = tmp_path_factory.mktemp("eval")
    done = run_cli("train", "--config", "pythia-tiny", *TINY, f"run_dir={tmp / 'run'}")
    assert done.returncode == 0, done.stderr[-2000:]
    ckpt = tmp / "run/checkpoints/step_8"
    cmd = [sys.executable, "-m", "trnrecipes", "eval", "run", "--ckpt", str(ckpt), "--limit", "1",
           "--max-gen-toks", str(GEN_TOKS), "--max-length", str(WINDOW), "--allow-code-execution", "--humaneval-n", "2",
           "--out", str(tmp / "eval")]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900, env={**os.environ, **OFFLINE})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "| row | shots | metric | value (stderr) | baseline |" in done.stdout
    return tmp / "eval", json.loads((tmp / "eval/results.json").read_text())


def test_all_tasks_are_reported(evaluated):
    from eval.registry import GROUPS, TASKS

    out, report = evaluated
    rows = {(r["task"], r["metric"]): r for r in report["results"]}
    for task in TASKS.values():
        metrics = task.metric_names if task.name != "humaneval" else ("pass@1",)  # k <= n only
        for metric in metrics:
            r = rows.pop((task.name, metric))
            assert r["kind"] == "task" and r["shots"] == task.shots and 0 <= r["value"] <= 1, r
    for group in ("common_reasoning", "world_knowledge"):  # the others have one task: its row is the group's
        for metric in GROUPS[group].metrics:
            assert rows.pop((group, metric))["kind"] == "group"
    assert not rows, rows  # nothing else, e.g. no pass@10 from 2 samples
    table = (out / "results.md").read_text()
    for title in ("| MMLU |", "| BBH |", "| Common Reasoning (average of 7) | 0 | acc_norm |",
                  "| · winogrande | 0 | acc |", "| World Knowledge (average of 2) | 5 | exact_match |",
                  "| Reading Comprehension: boolq | 0 | acc |", "| Math: gsm8k | 8 |",
                  "| Code: humaneval | 0 | pass@1 |", "| CommonsenseQA | 7 | acc |"):  # fmt: skip
        assert title in table, title
    assert (out / "hf/config.json").exists()
    assert report["checkpoint"]["step"] == 8 and report["checkpoint"]["path"].endswith("checkpoints/step_8")


def test_numbers_equal_lm_eval_cli_on_the_exported_model(evaluated, tmp_path):
    """Every task's metrics, and item by item what the model was asked and answered (lm-eval's --log_samples: the
    prompts and the loglikelihoods or generations), equal lm-eval's own CLI on the exported model."""
    from eval.registry import TASKS

    out, report = evaluated
    ours = [r for r in report["results"] if "lm_eval" in r]
    assert len(ours) == sum(len(t.metrics) for t in TASKS.values() if t.lm_eval_name) == 19  # acc_norm: 5 tasks
    args = f"pretrained={out / 'hf'},dtype=float32,max_length={WINDOW}"
    names = sorted({r["lm_eval"][0] for r in ours})
    cmd = [sys.executable, "-m", "lm_eval", "run", "--model", "hf", "--model_args", args, "--tasks", *names,
           "--include_path", str(out / "tasks"), "--limit", "1", "--device", "cpu", "--log_samples",
           "--batch_size", "1", "--gen_kwargs", f"max_gen_toks={GEN_TOKS}",
           "--output_path", str(tmp_path / "lm")]  # fmt: skip
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900, env={**os.environ, **OFFLINE})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (result_file,) = list((tmp_path / "lm").rglob("results_*.json"))
    theirs = json.loads(result_file.read_text())
    for row in ours:
        task, metric = row["lm_eval"]
        assert theirs["results"][task][metric] == row["value"], row
        assert theirs["n-shot"].get(task, row["shots"]) == row["shots"], row  # groups have their subtasks' only
    their_samples = {p.name.split("samples_")[1].rsplit("_", 1)[0]: p for p in (tmp_path / "lm").rglob("samples_*")}
    assert len(their_samples) == 57 + 27 + 12 == len(list((out / "samples").iterdir()))  # MMLU, BBH subtasks, 12
    for task, path in their_samples.items():
        mine = [json.loads(x) for x in (out / "samples" / f"{task}.jsonl").read_text().splitlines()]
        for a, b in zip(mine, [json.loads(x) for x in path.read_text().splitlines()], strict=True):
            assert {k: b[k] for k in a} == a, task  # the same prompts, responses and target


def test_a_second_eval_into_the_same_out_adds_to_its_table_and_other_weights_are_refused(evaluated, tmp_path):
    """`make eval ckpt=RUN tasks=boolq` after hours of the whole table replaced it with one row, and its samples;
    into a results dir of other weights or other settings it would have mixed or replaced them."""
    import torch

    from trnrecipes.checkpoint import write_model_checkpoint
    from trnrecipes.config.recipe import load_recipe

    out, report = evaluated
    ckpt = report["checkpoint"]["path"]
    samples = sorted(p.name for p in (out / "samples").iterdir())
    args = ["--max-gen-toks", str(GEN_TOKS), "--max-length", str(WINDOW), "--out", str(out)]
    again = run_cli("eval", "run", "--ckpt", ckpt, "--tasks", "boolq", "--limit", "1", *args, env=OFFLINE)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"[eval] keeping {out}'s earlier rows of mmlu, bbh," in again.stdout
    merged = json.loads((out / "results.json").read_text())["results"]
    assert [(r["task"], r["metric"], r["value"]) for r in merged] == [
        (r["task"], r["metric"], r["value"]) for r in report["results"]
    ]  # boolq scored again (the same value: the same weights), every other row and group kept
    assert sorted(p.name for p in (out / "samples").iterdir()) == samples
    other = write_model_checkpoint(tmp_path / "other", {"w": torch.zeros(4)}, load_recipe("pythia-tiny"))
    window = ["--max-length", str(WINDOW + 16)]  # scores change with the window: not to be mixed either
    cases = ((str(other), "1", [], "holds the results of other weights ("),
             (ckpt, "2", [], "with --limit 1, not 2: the table would mix them"),
             (ckpt, "1", window, f"with --max-length {WINDOW}, not {WINDOW + 16}"))  # fmt: skip
    for ckpt_arg, limit, more, says in cases:
        argv = ["eval", "run", "--ckpt", ckpt_arg, "--tasks", "boolq", "--limit", limit, *args, *more]
        refused = run_cli(*argv, env=OFFLINE)
        assert refused.returncode == 2 and says in refused.stderr, refused.stderr
    assert json.loads((out / "results.json").read_text())["results"] == merged
    short = run_cli("eval", "run", "--ckpt", ckpt, "--tasks", "boolq", "--limit", "1", "--max-length", "1",
                    "--out", str(tmp_path / "short"), env=OFFLINE)  # fmt: skip
    assert short.returncode == 2 and "lm-eval refused a request at --max-length 1" in short.stderr, short.stderr[-2000:]
