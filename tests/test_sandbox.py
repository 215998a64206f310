"""The code-execution sandbox (eval/sandbox.py): adversarial programs are contained and the harness survives;
the unbiased pass@k estimator matches the Codex paper's formula."""

from __future__ import annotations

import json
import math
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from eval.sandbox import UID_BASE, ExecutionNotAllowed, Limits, pass_at_k, run_program

QUICK = Limits(timeout_s=3)


def run(program: str, limits: Limits = QUICK):
    return run_program(program, limits, allow_code_execution=True)


def uid_processes(uid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    pids.append(int(entry))
            except FileNotFoundError:
                pass
    return pids


def test_nothing_runs_without_the_opt_in():
    with pytest.raises(ExecutionNotAllowed, match="explicit opt-in"):
        run_program("print(1)")


def test_correct_and_wrong_programs():
    ok = run("def add(a, b):\n    return a + b\nassert add(2, 3) == 5\n")
    assert ok.passed and ok.isolation == "namespaces+uid+rlimits"  # CI runs as root: full isolation
    bad = run("def add(a, b):\n    return a - b\nassert add(2, 3) == 5, 'wrong sum'\n")
    assert bad.status == "failed" and "AssertionError: wrong sum" in bad.detail


def test_infinite_loop_times_out():
    start = time.monotonic()
    out = run("while True:\n    pass\n", Limits(timeout_s=1.5))
    assert out.status == "timeout" and time.monotonic() - start < 10


def test_fork_bomb_is_bounded_and_cleaned_up():
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    out = run(bomb, Limits(timeout_s=2))
    assert out.status in ("timeout", "failed")
    assert uid_processes(UID_BASE) == []  # nothing left behind


def test_a_process_that_escapes_its_session_is_still_killed():
    escape = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(600)\n"
    out = run(escape)
    assert out.passed  # the parent exits 0 at once...
    assert uid_processes(UID_BASE) == []  # ...and its detached child is gone too


def test_memory_hog_fails_cleanly():
    out = run("x = bytearray(8 * 1024**3)\n", Limits(timeout_s=5, memory_mb=512))
    assert out.status == "failed" and "MemoryError" in out.detail


def test_writing_outside_the_working_dir_is_refused():
    target = Path(f"/var/tmp/trnrecipes-pwned-{os.getpid()}")  # on the root file system (/tmp is replaced)
    out = run(f"open({str(target)!r}, 'w').write('x')\n")
    assert out.status == "failed" and "Read-only file system" in out.detail and not target.exists()
    # /tmp inside the sandbox is a private tmpfs: writes succeed there but never reach the host
    out = run("open('/tmp/trnrecipes-pwned', 'w').write('x')\nopen('here.txt', 'w').write('ok')\n")
    assert out.passed and not os.path.exists("/tmp/trnrecipes-pwned")


def test_no_network_not_even_loopback():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    accepted = []
    threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
    out = run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n")
    server.close()
    assert out.status == "failed" and "unreachable" in out.detail.lower() and not accepted


def test_killing_the_harness_is_not_permitted():
    out = run("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n")
    assert out.status == "failed" and "Operation not permitted" in out.detail
    assert run("print('still here')\n").passed


@pytest.mark.parametrize(("n", "c", "k"), [(1, 1, 1), (10, 0, 1), (5, 1, 1), (10, 3, 2), (200, 17, 10), (20, 19, 5)])
def test_pass_at_k_matches_the_codex_formula(n, c, k):
    expected = 1.0 - math.comb(n - c, k) / math.comb(n, k)
    assert pass_at_k(n, c, k) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_pass_at_k_known_values_and_errors():
    assert pass_at_k(5, 1, 1) == pytest.approx(0.2)
    assert pass_at_k(10, 3, 2) == pytest.approx(1 - 21 / 45)
    assert pass_at_k(10, 9, 2) == 1.0  # fewer failures than k: some draw always passes
    with pytest.raises(ValueError, match="0 <= c <= n"):
        pass_at_k(3, 4, 1)


# ---------------------------------------------------------------- HumanEval scoring (trnrecipes eval code)

PROBLEMS = Path(__file__).resolve().parent.parent / "data/eval/humaneval/HumanEval.jsonl.gz"


def _samples(tmp_path, completions) -> Path:
    path = tmp_path / "samples.jsonl"
    path.write_text("".join(json.dumps({"task_id": t, "completion": c}) + "\n" for t, c in completions))
    return path


def test_canonical_solutions_pass_and_wrong_ones_fail(tmp_path, cli):
    from eval.code import load_problems

    problems = load_problems(PROBLEMS)
    assert len(problems) == 164
    good = _samples(tmp_path, [(t, p["canonical_solution"]) for t, p in problems.items()])
    done = cli("eval", "code", "--samples", str(good), "--problems", str(PROBLEMS), "--allow-code-execution",
               "--k", "1", "--out", str(tmp_path / "r.json"))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "pass@1: 1.0000" in done.stdout and "164 samples over 164 tasks" in done.stdout
    wrong = _samples(tmp_path, [(t, "    return None\n") for t in list(problems)[:20]])
    done = cli("eval", "code", "--samples", str(wrong), "--problems", str(PROBLEMS), "--allow-code-execution")
    assert done.returncode == 0 and "pass@1: 0.0000" in done.stdout and "pass@10: n/a" in done.stdout


def test_pass_at_k_over_several_samples_per_task(tmp_path):
    from eval.code import load_problems, score

    problems = load_problems(PROBLEMS)
    task = "HumanEval/0"
    right, wrong = problems[task]["canonical_solution"], "    return None\n"
    samples = [{"task_id": task, "completion": c} for c in [right] * 3 + [wrong] * 7]
    report = score(samples, problems, ks=(1, 5, 10), allow_code_execution=True)
    assert report["pass@1"] == pytest.approx(0.3)
    assert report["pass@5"] == pytest.approx(1 - math.comb(7, 5) / math.comb(10, 5))
    assert report["pass@10"] == 1.0


def test_eval_code_needs_the_opt_in_and_valid_input(tmp_path, cli):
    samples = _samples(tmp_path, [("HumanEval/0", "    return True\n")])
    done = cli("eval", "code", "--samples", str(samples), "--problems", str(PROBLEMS))
    assert done.returncode == 2 and "explicit opt-in" in done.stderr
    bad = _samples(tmp_path, [("HumanEval/999", "")])
    done = cli("eval", "code", "--samples", str(bad), "--problems", str(PROBLEMS), "--allow-code-execution")
    assert done.returncode == 2 and "unknown task_id 'HumanEval/999'" in done.stderr
    done = cli("eval", "code", "--samples", str(samples), "--problems", str(tmp_path / "none.jsonl.gz"),
               "--allow-code-execution")  # fmt: skip
    assert done.returncode == 2 and "eval prepare-data" in done.stderr
