"""The README's commands work as written (litgpt's test_readme habit)."""

from __future__ import annotations

import re
import subprocess

import pytest
from conftest import REPO

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
    assert len(losses) >= 10 and vals[-1] < losses[0] - 2.0  # it learned: held-out loss far below the start
    # and it ends with the evaluation table of the model it just trained
    assert "| task | shots | metric | value (stderr) | baseline |" in done.stdout
    for row in ("| trn_mmlu | 5 | acc,none |", "| trn_bbh_cot | 3 | exact_match,get-answer |",
                "| trn_gsm8k_cot | 8 | exact_match,strict-match |", "| humaneval | 0 | pass@1 |"):  # fmt: skip
        assert row in done.stdout, row


def test_plan_example_in_readme_reproduces_table_1():
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
        in (REPO / "README.md").read_text()
    )
