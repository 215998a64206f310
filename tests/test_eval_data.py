"""Offline eval data unpacked at setup (`trnrecipes eval prepare-data`): complete, and in the schemas lm-eval's
shipped MMLU and GSM8K prompts read."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import REPO

DATA = REPO / "data/eval"


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_mmlu_has_every_subject_and_split():
    subjects = sorted(p.name for p in (DATA / "mmlu").iterdir() if p.is_dir())
    assert len(subjects) == 57 and "abstract_algebra" in subjects and "world_religions" in subjects
    counts = {split: sum(len(rows(DATA / "mmlu" / s / f"{split}.jsonl")) for s in subjects)
              for split in ("dev", "validation", "test")}  # fmt: skip
    assert counts == {"dev": 285, "validation": 1531, "test": 14042}
    first = rows(DATA / "mmlu/abstract_algebra/dev.jsonl")[0]
    assert set(first) == {"question", "subject", "choices", "answer"} and len(first["choices"]) == 4
    assert first["answer"] in range(4) and first["subject"] == "abstract_algebra"


def test_gsm8k_test_split():
    problems = rows(DATA / "gsm8k/test.jsonl")
    assert len(problems) == 1319
    assert all(set(p) == {"question", "answer"} and "\n#### " in p["answer"] for p in problems)
    assert problems[0]["answer"].endswith("#### 18")  # Janet's ducks
