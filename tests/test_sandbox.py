"""The code-execution sandbox (eval/sandbox.py): adversarial programs are contained and the harness survives, a
program passes only if it runs to its end, sandbox uids are ones nobody else uses, one sample's failure (even in the
cleanup after it) stays that sample's; the unbiased pass@k estimator matches the Codex paper's formula."""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import REPO

from eval.sandbox import UID_RANGE, WORK_BASE, ExecutionNotAllowed, Limits, claim_uids, pass_at_k, run_program

QUICK = Limits(timeout_s=3)


def run(program: str, limits: Limits = QUICK):
    return run_program(program, limits, allow_code_execution=True)


def run_as_claimed_uid(program: str, limits: Limits = QUICK):
    """(outcome, the sandbox uid it ran as)."""
    with claim_uids(1) as (uid,):
        return run_program(program, limits, uid, allow_code_execution=True), uid


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
    out, uid = run_as_claimed_uid(bomb, Limits(timeout_s=2))
    assert out.status in ("timeout", "failed")
    assert uid_processes(uid) == []  # nothing left behind


def test_a_process_that_escapes_its_session_is_still_killed():
    escape = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(600)\n"
    out, uid = run_as_claimed_uid(escape)
    assert out.passed  # the parent runs to its end at once...
    assert uid_processes(uid) == []  # ...and its detached child is gone too


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
    out = run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n")
    server.setblocking(False)  # a connection that got through would wait in the backlog
    with pytest.raises(BlockingIOError):
        server.accept()
    server.close()
    assert out.status == "failed" and "unreachable" in out.detail.lower()


def test_killing_the_harness_is_not_permitted():
    out = run("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n")
    assert out.status == "failed" and "Operation not permitted" in out.detail
    assert run("print('still here')\n").passed


@pytest.mark.parametrize("early_exit", ["import sys\nsys.exit(0)", "import os\nos._exit(0)", "raise SystemExit"])
def test_exit_status_0_before_the_last_line_is_not_a_pass(early_exit):
    out = run(f"{early_exit}\nassert False, 'the tests'\n")
    assert out.status == "failed" and "before its last line ran" in out.detail


def test_sandbox_uids_skip_an_id_a_running_process_holds():
    """Cleanup kills every process of the sandbox uid: one that a process outside the sandbox runs as is never
    handed out (here: a process of the very uid the sandbox would otherwise take first)."""
    with claim_uids(1) as (uid,):
        pass

    def become() -> None:
        os.setgid(uid)
        os.setuid(uid)

    bystander = subprocess.Popen(["sleep", "60"], preexec_fn=become)
    try:
        out = run(f"import os\nassert os.getuid() != {uid}, os.getuid()\n")
        assert out.passed, out.detail
        time.sleep(0.2)
        assert bystander.poll() is None  # still running: not killed by the cleanup
    finally:
        bystander.kill()
        bystander.wait()


def test_sandbox_uids_skip_accounts_and_groups(tmp_path):
    """Inside a private mount namespace /etc/passwd gives every uid of the range but the last two to an account and
    /etc/group the second last to a group: only the last one is free."""
    if not shutil.which("unshare") or os.geteuid() != 0:
        pytest.skip("needs root and unshare")
    accounts = [f"u{uid}:x:{uid}:0::/:/bin/false" for uid in UID_RANGE[:-2]]
    (tmp_path / "passwd").write_text(Path("/etc/passwd").read_text() + "\n".join(accounts) + "\n")
    (tmp_path / "group").write_text(Path("/etc/group").read_text() + f"g:x:{UID_RANGE[-2]}:\n")
    code = (
        "from eval.sandbox import SandboxError, claim_uids\n"
        "with claim_uids(1) as uids:\n    print(uids)\n"
        "try:\n    with claim_uids(2):\n        pass\nexcept SandboxError as err:\n    print(err)\n"
    )
    script = (
        f"mount --bind {tmp_path / 'passwd'} /etc/passwd && mount --bind {tmp_path / 'group'} /etc/group"
        f' && exec {sys.executable} -c "$0"'
    )
    done = subprocess.run(
        ["unshare", "--mount", "sh", "-c", script, code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == f"[{UID_RANGE[-1]}]", done.stdout
    assert f"2 sandbox uids asked for, 1 free in {UID_RANGE.start}-{UID_RANGE[-1]}" in done.stdout


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


@pytest.mark.parametrize(
    "completion",
    [
        "    return False\nimport sys\nsys.exit(0)\n",  # exits 0 when the module is loaded, before the tests
        "    return False\nimport os\nos._exit(0)\n",
        "    raise SystemExit(0)\n",  # exits 0 when the tests first call it
    ],
)
def test_a_completion_that_exits_0_before_its_tests_finish_fails(completion):
    from eval.code import load_problems, score

    problems = load_problems(PROBLEMS)
    report = score([{"task_id": "HumanEval/0", "completion": completion}], problems, ks=(1,), allow_code_execution=True)
    assert report["pass@1"] == 0.0 and report["outcomes"][0]["status"] == "failed", report


def test_one_sample_failing_in_the_harness_does_not_stop_the_run(tmp_path, cli):
    """A completion that leaves a tree nested deeper than Python's recursion limit (shutil.rmtree raised
    RecursionError on it, which took the whole run down) and one the harness cannot even write out (a lone
    surrogate: not encodable as UTF-8): the run goes on and reports each sample."""
    from eval.code import load_problems

    problems = load_problems(PROBLEMS)
    nest = "import os\nfor _ in range(3000):\n    os.mkdir('d')\n    os.chdir('d')\nos.chdir(os.environ['HOME'])\n"
    samples = _samples(
        tmp_path,
        [
            ("HumanEval/0", problems["HumanEval/0"]["canonical_solution"] + nest),
            ("HumanEval/1", "    return '\ud800'\n"),
            ("HumanEval/2", problems["HumanEval/2"]["canonical_solution"]),
        ],
    )
    report_file = tmp_path / "report.json"
    done = cli("eval", "code", "--samples", str(samples), "--problems", str(PROBLEMS), "--allow-code-execution",
               "--k", "1", "--out", str(report_file))  # fmt: skip
    assert done.returncode == 0, done.stderr
    outcomes = json.loads(report_file.read_text())["outcomes"]
    assert [o["status"] for o in outcomes] == ["passed", "error", "passed"], outcomes
    assert "UnicodeEncodeError" in outcomes[1]["detail"]
    assert "pass@1: 0.6667" in done.stdout and "1 sample(s) could not be run or cleaned up" in done.stderr


def test_a_working_dir_that_cannot_be_removed_fails_that_sample_only(tmp_path):
    """The sample's file is made immutable (chattr +i) while the program runs, so the cleanup cannot remove it:
    that sample is reported as an error naming the directory, and the next sample still runs."""
    from eval.code import load_problems, score

    probe = WORK_BASE / f"chattr-probe-{os.getpid()}"
    WORK_BASE.mkdir(parents=True, exist_ok=True)
    probe.touch()
    try:
        if not shutil.which("chattr") or subprocess.run(["chattr", "+i", probe], capture_output=True).returncode:
            pytest.skip("chattr +i is not supported here")
    finally:
        subprocess.run(["chattr", "-i", probe], capture_output=True)
        probe.unlink()
    problems = load_problems(PROBLEMS)
    name = f"stuck-{os.getpid()}-{time.monotonic_ns()}"
    stuck = f"\nimport time\nopen({name!r}, 'w').close()\ntime.sleep(2)\n"
    made_immutable: list[Path] = []

    def pin_it() -> None:
        deadline = time.monotonic() + 10
        while not made_immutable and time.monotonic() < deadline:
            for found in WORK_BASE.glob(f"run-*/{name}"):
                subprocess.run(["chattr", "+i", found], check=True)
                made_immutable.append(found)
            time.sleep(0.02)

    pinner = threading.Thread(target=pin_it)
    pinner.start()
    canonical = problems["HumanEval/0"]["canonical_solution"]
    samples = [{"task_id": "HumanEval/0", "completion": canonical + stuck}, {"task_id": "HumanEval/0",
               "completion": canonical}]  # fmt: skip
    try:
        report = score(samples, problems, ks=(1,), workers=1, limits=Limits(timeout_s=5), allow_code_execution=True)
    finally:
        pinner.join()
        for path in made_immutable:
            subprocess.run(["chattr", "-i", path], check=True)
            shutil.rmtree(path.parent)
    assert made_immutable, "the program's file never showed up"
    first, second = report["outcomes"]
    assert first["status"] == "error" and f"{made_immutable[0].parent} could not be removed" in first["detail"]
    assert second["status"] == "passed" and report["pass@1"] == 0.5
