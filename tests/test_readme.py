"""The README's commands work as written (litgpt's test_readme habit)."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess

import pytest
from conftest import REPO

from trnrecipes.config.recipe import load_recipe

pytestmark = pytest.mark.slow


def test_readme_names_the_two_commands():
    readme = (REPO / "README.md").read_text()
    assert re.search(r"^make demo\b", readme, flags=re.M) and re.search(r"^make test\b", readme, flags=re.M)


def test_make_demo_renders_and_runs_a_tiny_recipe_locally():
    done = subprocess.run(
        ["make", "--no-print-directory", "demo"], cwd=REPO, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (REPO / "jobs" / "demo" / "run.sbatch").exists()
    assert "train: pythia-tiny on cpu, 2 rank(s)" in done.stdout and "training exited with status 0" in done.stdout
    losses = [float(x) for x in re.findall(r"step +\d+/\d+ \| loss ([0-9.]+)", done.stdout)]
    vals = [float(x) for x in re.findall(r"\| val ([0-9.]+)", done.stdout)]
    # it learned: held-out loss far below a uniform guess over the vocabulary (ln 4096 = 8.3 for the demo tokenizer)
    assert len(losses) >= 10 and vals[-1] < math.log(load_recipe("pythia-tiny").model.vocab_size) - 2.0
    # and it ends with the evaluation table of the model it just trained
    # and it ends with the seven rows of the 128-node Llama 2 post's table (and CommonsenseQA), OpenLLaMA-2 7B's
    # numbers beside them
    table = done.stdout[done.stdout.index("| row | shots | metric | value (stderr) | baseline |") :]
    for row in (r"MMLU \| 5 \| acc \| [0-9.]+ \(\S+\) \| 0\.4110", r"BBH \| 3 \| exact_match",
                r"Common Reasoning \(average of 7\) \| 0 \| acc \| [0-9.]+ \(\S+\) \| 0\.5689",
                r"Common Reasoning \(average of 7\) \| 0 \| acc_norm \| [0-9.]+ \(\S+\) \| 0\.6126",
                r"World Knowledge \(average of 2\) \| 5 \| exact_match \| [0-9.]+ \(\S+\) \| 0\.3702",
                r"Reading Comprehension: boolq \| 0 \| acc \| [0-9.]+ \(\S+\) \| 0\.7242",
                r"Math: gsm8k \| 8 \| exact_match \| [0-9.]+ \(\S+\) \| 0\.0680",
                r"Code: humaneval \| 0 \| pass@1 \| [0-9.]+ \| 0\.0970", r"CommonsenseQA \| 7 \| acc"):  # fmt: skip
        assert re.search(r"^\| " + row, table, re.M), row
    assert "- --limit 2: the first 2 items of each task and subtask; a smoke check" in table


def test_plan_example_in_docs_reproduces_table_1():
    done = subprocess.run(
        [
            ".venv/bin/trnrecipes",
            "plan",
            "--recipe",
            "pythia6.9b",
            "--nodes",
            "1",
            "--seq-per-s",
            "10.4",
            "--price",
            "7.59",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert "10,102,387 tokens/$" in done.stdout
    assert (
        "trnrecipes plan --recipe pythia6.9b --nodes 1 --seq-per-s 10.4 --price 7.59"
        in (REPO / "docs" / "plan.md").read_text()
    )


def test_make_demo_cls_trains_the_tiny_classifier_and_scores_it_with_its_eval_sbatch():
    done = subprocess.run(
        ["make", "--no-print-directory", "demo-cls"], cwd=REPO, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "train: bert-tiny on cpu, 2 rank(s)" in done.stdout and "training exited with status 0" in done.stdout
    # Trained from scratch on the shipped Rotten Tomatoes sentences, its validation accuracy beats the majority class
    # of the very examples validated by 0.1, inside what every measured seed reached (docs/classification.md: the
    # smallest margin over seeds 1-5 was 0.195).
    final = re.search(r"step 300/300 \| loss [0-9.]+ \| acc [0-9.]+ \| val [0-9.]+ \| val acc ([0-9.]+)", done.stdout)
    majority = re.search(r"validation: majority class \d at ([0-9.]+) of the examples", done.stdout)
    assert final and majority, done.stdout[-3000:]
    assert 0.4 < float(majority[1]) < 0.6 and float(final[1]) > float(majority[1]) + 0.1, (final[0], majority[0])
    found = re.search(r"^accuracy ([0-9.]+) on 3708 rows \(majority class 0\.574\)$", done.stdout, re.M)
    assert found, done.stdout[-2000:]
    summary = json.loads((REPO / "runs/demo-cls/eval/predictions.summary.json").read_text())
    assert summary["rows"] == 3708 and summary["accuracy"] == pytest.approx(float(found[1]), abs=5e-4)


# What the README's "First run on a cluster" quotes of each command's output: (command, text). Each must be in the
# README as written and in what the command prints on a login node (no DLAMI venv, no wheelhouse yet).
FIRST_RUN_QUOTES = (
    ("sbatch", "parallelism  TP 8 x PP 1 x DP 4"),
    ("sbatch", "/jobs/llama2-smoke-trn1-1n/: compile.sbatch, eval.sbatch, provenance.json, recipe.yaml, run.sbatch"),
    ("sbatch", "make eval ckpt="),
    ("sbatch", "scontrol show partition train"),
    ("sbatch", "make wheels sdk=2.26"),
    (
        "doctor",
        "is not on this host (it is the venv of the Deep Learning AMI Neuron (Ubuntu 22.04) with Neuron SDK 2.26",
    ),
    ("doctor", "run ok: data, tokenizer, run dir and checkpoint space"),
)


def test_the_first_run_section_quotes_what_its_commands_print(tmp_path):
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## First run on a cluster") : readme.index("Then the real recipe:")]
    command = "make recipe=llama2-smoke-trn1 nodes=1 sbatch overrides='slurm.partition=train'"
    assert (
        command in section and ".venv/bin/trnrecipes doctor --config jobs/llama2-smoke-trn1-1n/recipe.yaml" in section
    )
    env = {**os.environ, "TRNRECIPES_RUNS": str(tmp_path / "runs")}
    shutil.rmtree(REPO / "jobs/llama2-smoke-trn1-1n", ignore_errors=True)  # a first run: what it warns of once
    sbatch = subprocess.run(["bash", "-c", f"{command} force=1"], cwd=REPO, capture_output=True, text=True, env=env,
                            timeout=300)  # fmt: skip
    assert sbatch.returncode == 0, sbatch.stdout[-2000:] + sbatch.stderr[-2000:]
    doctor = subprocess.run([str(REPO / ".venv/bin/trnrecipes"), "doctor", "--config",
                             "jobs/llama2-smoke-trn1-1n/recipe.yaml"], cwd=REPO, capture_output=True, text=True,
                            env=env, timeout=300)  # fmt: skip
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    printed = {"sbatch": sbatch.stdout + sbatch.stderr, "doctor": doctor.stdout + doctor.stderr}
    for step, quote in FIRST_RUN_QUOTES:
        assert " ".join(quote.split()) in " ".join(section.split()), f"the README no longer quotes {quote!r}"
        assert quote in printed[step], f"{step} no longer prints {quote!r}:\n{printed[step][-3000:]}"
