"""Storage failures lose nothing: a checkpoint that cannot be written (a full disk, a read-only dir) stops the run
with a clear error and leaves the previous checkpoint usable; a read-only run dir is refused before any work; a
rank whose write failed ends rank 0's wait for it at once; a second trainer on a run dir is refused; the crash hook
(TRNRECIPES_CRASH_ONCE) kills once and the rerun resumes.

Real OS errors, no mocks: a file size limit (RLIMIT_FSIZE; Python ignores SIGXFSZ, so writes fail with EFBIG), and
mode bits for an unprivileged user (root passes every mode bit, so as root the trainer runs as nobody)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO, rank_launcher

from trnrecipes.checkpoint import verify_training
from trnrecipes.checkpoint.format import CheckpointWriteError, latest_checkpoint, step_dirs
from trnrecipes.checkpoint.writer import RANK_WAIT_S, Checkpointer
from trnrecipes.config.recipe import load_recipe
from trnrecipes.config.sections import RecipeError
from trnrecipes.train.loop import _crash_once
from trnrecipes.train.run_dir import LOCK_FILE

pytestmark = pytest.mark.slow

SMALL = ["cluster.workers_per_node=1", "batch.seq_len=32", "batch.global_batch=4", "batch.micro_batch=2",
         "train.log_every=1", "train.val_every=1000"]  # fmt: skip
NOBODY = 65534
SETPRIV = Path("/usr/bin/setpriv")
AS_ROOT = os.geteuid() == 0


@pytest.fixture
def home(tmp_path: Path):
    """A dir the trainer's user owns. As root: one in the system temp dir (pytest's own is root-only) owned by
    nobody, as whom the trainer runs there (setpriv), so that mode bits bind it."""
    if not AS_ROOT:
        yield tmp_path
        return
    if not SETPRIV.exists():
        pytest.fail(f"running as root, these tests run the trainer as nobody with {SETPRIV} (util-linux): install it")
    path = Path(tempfile.mkdtemp(prefix="trnrecipes-storage-"))
    os.chown(path, NOBODY, NOBODY)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def config(home: Path, name: str, *overrides: str) -> Path:
    recipe = load_recipe("llama2-tiny", overrides=[*SMALL, f"run_dir={home / 'run'}", *overrides])
    path = home / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))
    return path


def start(cfg: Path, *, fsize: int | None = None, **env: str) -> subprocess.Popen:
    """`trnrecipes train` as users run it: as nobody when the tests run as root, with HOME and temp files in the
    user's own dir; under a file size limit of `fsize` bytes if given."""
    home = cfg.parent
    cmd = [sys.executable, "-m", "trnrecipes", "train", "--config", str(cfg)]
    own = {"HOME": home, "TMPDIR": home, "XDG_CACHE_HOME": home / ".cache", "MPLCONFIGDIR": home / ".cache"}
    env = {**os.environ, **{k: str(v) for k, v in own.items()}, "PYTHONDONTWRITEBYTECODE": "1", **env}
    if AS_ROOT:
        cmd = [str(SETPRIV), f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--", *cmd]

    def limit() -> None:
        if fsize is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            preexec_fn=limit)  # fmt: skip


def finish(proc: subprocess.Popen, returncode: int = 0) -> str:
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == returncode, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    return out


def logged_steps(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    return [json.loads(x)["step"] for x in path.read_text().splitlines()] if path.exists() else []


def hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()
    }


def wait_for(condition, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + 120
    while not condition():
        assert proc.poll() is None, f"exited before {what}: " + proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline, f"no {what} within 120 s"
        time.sleep(0.02)


# ---- a checkpoint that cannot be written


def test_a_full_disk_stops_the_run_at_the_next_step_and_the_previous_checkpoint_resumes(home: Path):
    run = home / "run"
    finish(start(config(home, "first", "train.max_steps=10", "checkpoint.every_steps=10")))
    before = hashes(run / "checkpoints/step_10")
    # The limit, measured: half the weights file (the moments are twice its size), above every other file.
    fsize = (run / "checkpoints/step_10/model.safetensors").stat().st_size // 2
    assert max(p.stat().st_size for p in run.rglob("*") if p.suffix != ".safetensors") < fsize

    cfg = config(home, "long", "train.max_steps=40", "checkpoint.every_steps=10")
    out = finish(start(cfg, fsize=fsize), returncode=2)
    failed = run / "checkpoints/.step_20.tmp"
    assert re.search(
        rf"error: cannot write checkpoint step_20 to {re.escape(str(failed))}/\S+\.safetensors: \[Errno 27\] File too"
        r" large; the newest complete checkpoint, step_10, is intact\. Raise the file size limit",
        out,
    ), out[-3000:]
    # The writer's error stops the run at the next step; the writer runs at the lowest CPU priority, so on a busy
    # machine the next save (step 30), which waits for it, may be where it surfaces: never a save after it.
    assert 20 <= max(logged_steps(run)) <= 30, logged_steps(run)
    assert not list((run / "checkpoints").glob("*step_30*"))
    assert hashes(run / "checkpoints/step_10") == before
    verify_training(run / "checkpoints/step_10")
    assert latest_checkpoint(run / "checkpoints", print)[0] == 10  # the half-written one is not a checkpoint

    out = finish(start(config(home, "resume", "train.max_steps=25", "checkpoint.every_steps=10")))
    assert "removing incomplete checkpoint .step_20.tmp" in out and "(step 10)" in out, out[-3000:]
    verify_training(run / "checkpoints/step_25")


def test_checkpoints_made_read_only_mid_run_stop_it_with_a_clear_error(home: Path):
    run = home / "run"
    proc = start(config(home, "run", "train.max_steps=5000", "checkpoint.every_steps=50"))
    try:
        wait_for(lambda: (run / "checkpoints/step_50/done").exists(), proc, "step_50")
        (run / "checkpoints").chmod(0o555)  # normally 50 steps before the next save
        out = finish(proc, returncode=2)
    finally:
        proc.kill()
        (run / "checkpoints").chmod(0o755)
    # The first save to meet the read-only dir fails: step_100 unless this machine is so loaded that the run got
    # past it before the chmod. Which one is timing; what must hold is not.
    found = re.search(
        rf"error: cannot write checkpoint step_(\d+) to {re.escape(str(run))}/checkpoints/\.step_\1\.tmp: \[Errno 13\]"
        r" Permission denied; the newest complete checkpoint, step_(\d+), is intact\. Fix its permissions",
        out,
    )
    assert found, out[-3000:]
    failed, intact = int(found[1]), int(found[2])
    assert failed >= 100 and intact == failed - 50, found[0]
    # A background save's failure stops the run at the next step; the next save, which waits for the previous
    # one, is the latest it can surface however slow the write: never a save after the failed one.
    assert max(logged_steps(run)) <= failed + 50, logged_steps(run)[-3:]
    assert not list((run / "checkpoints").glob(f"*step_{failed + 50}*"))
    verify_training(run / f"checkpoints/step_{intact}")


def test_a_read_only_run_dir_is_refused_before_any_work_and_nothing_changes(home: Path):
    run = home / "run"
    finish(start(config(home, "first", "train.max_steps=5", "checkpoint.every_steps=5")))
    before = hashes(run)
    cfg = config(home, "more", "train.max_steps=10", "checkpoint.every_steps=5")
    for read_only in (run, run / "checkpoints"):
        read_only.chmod(0o555)
        try:
            out = finish(start(cfg), returncode=2)
        finally:
            read_only.chmod(0o755)
        assert f"error: run dir {run} is not writable: [Errno 13] Permission denied: '{read_only}/" in out, out
        assert "nothing was changed" in out and "train:" not in out  # refused before training began
        assert hashes(run) == before
    verify_training(run / "checkpoints/step_5")


# ---- several ranks


def save_complete(root: Path, step: int) -> None:
    """A complete one-rank checkpoint (the one a failed save must leave intact)."""
    state = {"step": step, "optimizer_steps": step, "dp": 1, "tp": 1, "world": 1}
    files = {"model.safetensors": {"w": torch.zeros(16)}, "shards.json": {"tp": 1, "dims": {}},
             "optim-tp00-of-01.safetensors": {"exp_avg.w": torch.zeros(16)}, "state.json": state}  # fmt: skip
    Checkpointer(root, load_recipe("llama2-tiny"), None, 0, 1, 2, async_save=False, log=print).save(step, files)


RANK_1 = """
import sys, torch
from pathlib import Path
from trnrecipes.checkpoint.format import CheckpointWriteError
from trnrecipes.checkpoint.writer import Checkpointer
from trnrecipes.config.recipe import load_recipe

writer = Checkpointer(Path(sys.argv[1]), load_recipe("llama2-tiny"), None, 1, 2, 2, async_save=False, log=print)
try:
    writer.save(10, {"model-tp01-of-02.safetensors": {"w": torch.zeros(1 << 18)}})  # 1 MiB
except CheckpointWriteError as err:
    print(err)
    sys.exit(2)
"""


def test_a_rank_that_cannot_write_ends_rank_0s_wait_at_once_naming_it(tmp_path: Path):
    root = tmp_path / "checkpoints"
    save_complete(root, 5)
    rank0 = Checkpointer(root, load_recipe("llama2-tiny"), None, 0, 2, 2, async_save=True, log=print)
    began = time.monotonic()
    rank0.save(10, {"model-tp00-of-02.safetensors": {"w": torch.zeros(16)}, "shards.json": {"tp": 2, "dims": {}}})
    limit = (1 << 16, 1 << 16)  # rank 1 alone, as its own process: its 1 MiB shard does not fit

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)

    cmd = [sys.executable, "-c", RANK_1, str(root)]
    rank1 = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, preexec_fn=small_files)
    assert rank1.returncode == 2, rank1.stdout + rank1.stderr
    rank0.join()
    assert time.monotonic() - began < 60 < RANK_WAIT_S and rank0.failed()
    expected = (
        f"rank 1 cannot write checkpoint step_10 to {root}/.step_10.tmp/model-tp01-of-02.safetensors: [Errno 27] File"
        " too large; the newest complete checkpoint, step_5, is intact"
    )
    assert expected in rank1.stdout
    with pytest.raises(CheckpointWriteError) as raised:
        rank0.raise_if_failed()
    assert expected in str(raised.value)  # rank 1's own message, from its .rank-1.failed marker
    assert [s for s, _ in step_dirs(root)] == [5]
    verify_training(root / "step_5")


def test_rank_0_stops_waiting_once_the_ranks_agree_that_one_failed_even_without_its_marker(tmp_path: Path):
    root = tmp_path / "checkpoints"
    rank0 = Checkpointer(root, load_recipe("llama2-tiny"), None, 0, 2, 2, async_save=True, log=print)
    rank0.save(10, {"model-tp00-of-02.safetensors": {"w": torch.zeros(16)}, "shards.json": {"tp": 2, "dims": {}}})
    time.sleep(0.2)
    assert rank0.busy()  # waiting for rank 1's files
    with pytest.raises(CheckpointWriteError, match=r"^rank 1 cannot write checkpoint step_10 to .*its write failed"):
        rank0.give_up(1, storage=True)  # what the loop does when the ranks' all-reduce says rank 1's storage failed
    assert not rank0.busy() and not step_dirs(root)


def test_a_rank_failing_for_another_reason_than_the_storage_is_not_reported_as_bad_input(tmp_path: Path):
    """An I/O hiccup on one rank (EIO, a timeout) may pass on a requeue: no CheckpointWriteError (a RecipeError,
    which run.sbatch never requeues) on rank 0 nor on the ranks that only learn of it."""
    root = tmp_path / "checkpoints"
    rank0 = Checkpointer(root, load_recipe("llama2-tiny"), None, 0, 2, 2, async_save=True, log=print)
    rank0.save(10, {"model-tp00-of-02.safetensors": {"w": torch.zeros(16)}, "shards.json": {"tp": 2, "dims": {}}})
    time.sleep(0.2)
    with pytest.raises(RuntimeError, match=r"rank 1 could not write checkpoint step_10") as raised:
        rank0.give_up(1, storage=False)
    assert not isinstance(raised.value, CheckpointWriteError)
    bystander = Checkpointer(root, load_recipe("llama2-tiny"), None, 2, 3, 2, async_save=True, log=print)
    with pytest.raises(RuntimeError, match="rank 1 cannot write its checkpoint files") as raised:
        bystander.give_up(1, storage=False)
    assert not isinstance(raised.value, CheckpointWriteError)


RANK_1_SMALL_FILES = """
import os, resource, sys
if os.environ["RANK"] == "1":  # rank 1 cannot write its ZeRO-1 moments (over 4 KB); its small files fit
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
from trnrecipes.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_two_ranks_stop_together_at_the_next_step_when_rank_1_cannot_write(tmp_path: Path):
    recipe = load_recipe("llama2-tiny", overrides=[*SMALL, "cluster.workers_per_node=2", f"run_dir={tmp_path / 'run'}",
                                                   "train.max_steps=40", "checkpoint.every_steps=4",
                                                   "layout.zero1=true"])  # fmt: skip
    cfg = tmp_path / "recipe.yaml"
    cfg.write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))
    script = tmp_path / "rank1_small_files.py"
    script.write_text(RANK_1_SMALL_FILES)
    cmd = [*rank_launcher(2), str(script), "train", "--config", str(cfg)]  # fmt: skip
    began = time.monotonic()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and time.monotonic() - began < 120, done.stdout[-3000:] + done.stderr[-3000:]
    failed = tmp_path / "run/checkpoints/.step_4.tmp/optim-tp00-of-01-dp0001-of-0002.safetensors"
    expected = f"error: rank 1 cannot write checkpoint step_4 to {failed}: [Errno 27] File too large"
    # Both ranks stop with rank 1's message (rank 0 read it from rank 1's .rank-1.failed marker) at the first step
    # after the background write is known to have failed: mostly step 5, at the latest step 8, whose save waits for
    # step 4's write (on a loaded machine that thread may not reach the failing file during steps 5 to 7). No save
    # starts after the failed one, and the run does not train on to its 40 steps.
    assert done.stderr.count(expected) == 2, done.stderr[-3000:]
    assert max(logged_steps(tmp_path / "run")) <= 8
    assert sorted(p.name for p in (tmp_path / "run/checkpoints").iterdir()) == [".step_4.tmp"]


# ---- one trainer per run dir


def test_a_second_trainer_is_refused_and_the_first_trains_on_to_a_clean_finish(home: Path):
    run, stop = home / "run", home / "stop"
    cfg = config(home, "run", "train.max_steps=100000", "checkpoint.every_steps=100000")
    first = start(cfg, TRNRECIPES_STOP_FILE=str(stop))
    try:

        def held() -> bool:
            try:
                return json.loads((run / LOCK_FILE).read_text() or "null")["pid"] == first.pid
            except (OSError, ValueError, TypeError, KeyError):
                return False

        wait_for(held, first, "the run dir lock")
        out = finish(start(cfg), returncode=2)
        assert f"run dir {run} is in use by another trainer (pid {first.pid} on " in out, out[-3000:]
        assert first.poll() is None
        stop.write_text("")
        out = finish(first)
    finally:
        first.kill()
    saved = int(re.search(r"saved at step (\d+), exiting", out).group(1))
    verify_training(run / "checkpoints" / f"step_{saved}")
    assert logged_steps(run) == list(range(1, saved + 1))  # one writer: each step once, in order


# ---- the crash hook for the Slurm requeue test


def test_the_crash_hook_kills_once_and_the_rerun_resumes(home: Path):
    run, marker = home / "run", home / "crashed"
    cfg = config(home, "run", "train.max_steps=8", "checkpoint.every_steps=2")
    out = finish(start(cfg, TRNRECIPES_CRASH_ONCE=f"{marker}:5:0"), returncode=-signal.SIGKILL)
    assert marker.read_text() == "5\n" and logged_steps(run) == [1, 2, 3, 4, 5], out[-3000:]
    out = finish(start(cfg, TRNRECIPES_CRASH_ONCE=f"{marker}:5:0"))
    assert re.search(r"resuming from \S+ \(step (2|4)\)", out), out[-3000:]
    verify_training(run / "checkpoints/step_8")


@pytest.mark.parametrize("value", ["nonsense", "/tmp/x:five:0", "/tmp/x:0:0", ":5:0", "/tmp/x:5:-1"])
def test_the_crash_hook_names_a_malformed_value_and_the_expected_form(value: str):
    with pytest.raises(RecipeError, match=r"TRNRECIPES_CRASH_ONCE=.*expected <path>:<step>:<rank>"):
        _crash_once(value)
    assert _crash_once("/tmp/a:b/x:5:1") == (Path("/tmp/a:b/x"), 5, 1) and _crash_once("") is None
