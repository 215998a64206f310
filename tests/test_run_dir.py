"""The run dir is never left without its newest valid checkpoint, is held by one trainer at a time, and a checkpoint
is only read through a manifest that lists and hashes every file (fast tests: no training; tests/test_resume.py
trains for real)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO, run_cli

from trnrecipes.checkpoint import CheckpointError, read_model_checkpoint, verify, write_model_checkpoint
from trnrecipes.checkpoint.format import latest_checkpoint, step_dirs
from trnrecipes.checkpoint.writer import Checkpointer
from trnrecipes.config.changes import check_allow_changes
from trnrecipes.config.recipe import load_recipe
from trnrecipes.config.sections import RecipeError
from trnrecipes.train.resume_compat import resume_differences
from trnrecipes.train.run_dir import LOCK_FILE, RunDirBusy, RunDirLock, settle_checkpoints

RECIPE = load_recipe("llama2-tiny")


def quiet(*_a, **_k) -> None:
    pass


def save(root: Path, step: int, keep_last: int = 3, newest_valid: int | None = None) -> None:
    """One complete checkpoint written by the real writer (rank 0 of 1)."""
    ck = Checkpointer(root, RECIPE, None, 0, 1, keep_last, async_save=False, log=quiet, newest_valid=newest_valid)
    state = {"step": step, "optimizer_steps": step, "dp": 1, "tp": 1, "world": 1}
    files = {"model.safetensors": {"w": torch.full((16,), float(step))}, "shards.json": {"tp": 1, "dims": {}},
             "optim-tp00-of-01.safetensors": {"exp_avg.w": torch.zeros(16)}, "state.json": state}  # fmt: skip
    ck.save(step, files)


def flip_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


def valid_steps(root: Path) -> list[int]:
    out = []
    for step, path in step_dirs(root):
        try:
            verify(path)
            out.append(step)
        except CheckpointError:
            pass
    return out


def listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


# ---- pruning and settling


def test_the_issue_repro_a_corrupt_newer_checkpoint_never_outlives_the_valid_ones(tmp_path: Path):
    root = tmp_path / "checkpoints"
    for step in (5, 10, 15, 20):
        save(root, step, keep_last=4)
    flip_byte(root / "step_20/model.safetensors")
    found = settle_checkpoints(root, resume=True, force_fresh=False, log=quiet)
    assert found == (15, root / "step_15")
    save(root, 17, keep_last=1, newest_valid=15)
    assert [s for s, _ in step_dirs(root)] == [17]  # the corrupt step_20 no longer outranks it
    assert (root / "unusable/step_20/model.safetensors").exists()  # kept as evidence, out of the way
    assert latest_checkpoint(root, quiet)[0] == 17


def test_a_reader_racing_the_runs_pruning_takes_the_newer_checkpoint_not_calling_one_unusable(tmp_path, monkeypatch):
    import trnrecipes.checkpoint.format as fmt

    root = tmp_path / "checkpoints"
    save(root, 5)
    real, said = fmt.verify, []

    def pruned_while_read(path):  # the run saves step_6 and prunes step_5 (keep_last 1) as eval verifies it
        if path.name == "step_5" and not (root / "step_6").exists():
            save(root, 6, keep_last=1)
            raise CheckpointError(f"{path}/recipe.yaml: missing")
        return real(path)

    monkeypatch.setattr(fmt, "verify", pruned_while_read)
    assert latest_checkpoint(root, said.append) == (6, root / "step_6")
    assert said == []  # it said 'step_5 is unusable', and then 'no complete checkpoint'


@pytest.mark.parametrize("seed", range(6))
def test_property_random_saves_corruptions_and_restarts_never_lose_the_newest_valid_checkpoint(
    tmp_path: Path, seed: int
):
    rng = random.Random(seed)
    run = tmp_path / "run"
    root = run / "checkpoints"
    for _ in range(40):
        before = valid_steps(root)
        op = rng.choice(["run", "run", "corrupt"])
        if op == "corrupt" and step_dirs(root):
            _, victim = rng.choice(step_dirs(root))
            kind = rng.choice(["flip", "done", "file", "unlisted"])
            if kind == "flip":
                flip_byte(victim / "model.safetensors")
            elif kind == "done":
                (victim / "done").unlink(missing_ok=True)
            elif kind == "file":
                (victim / "shards.json").unlink(missing_ok=True)
            else:
                (victim / "data-dp0000.json").write_text("{}")
            continue
        resume, force, keep = rng.random() < 0.8, rng.random() < 0.5, rng.randint(1, 3)
        saves = rng.randint(0, 4)
        untouched = listing(run)
        try:
            found = settle_checkpoints(root, resume, force, quiet)
        except RecipeError as err:
            # refused: resume off without force, or resume on and not one checkpoint verifies
            assert step_dirs(root) and ((not resume and not force) or (resume and not before)), err
            assert listing(run) == untouched  # a refusal changes nothing
            continue
        if resume:
            assert (found[0] if found else None) == (before[0] if before else None)
        elif before:  # force_fresh: the old run's checkpoints were moved aside whole, still valid
            archived = sorted((run / "archived").iterdir())[-1] / "checkpoints"
            assert valid_steps(archived)[0] == before[0]
        start = found[0] if found else 0
        for i in range(saves):
            save(root, start + 10 * (i + 1), keep, newest_valid=found[0] if found else None)
        after = valid_steps(root)
        expected_newest = start + 10 * saves if saves else (found[0] if found else None)
        assert (after[0] if after else None) == expected_newest, (seed, before, after)
        assert len(after) >= min(keep, saves + (1 if found else 0))


def test_when_no_checkpoint_verifies_the_run_is_refused_and_nothing_moves(tmp_path: Path):
    root = tmp_path / "checkpoints"
    for step in (5, 10):
        save(root, step)
    flip_byte(root / "step_10/model.safetensors")
    (root / "step_5/done").unlink()
    before = listing(root)
    with pytest.raises(RecipeError, match=r"none of its checkpoints \(step_10, step_5\) verifies.*checksum mismatch"):
        settle_checkpoints(root, resume=True, force_fresh=False, log=quiet)
    assert listing(root) == before  # before: both moved aside and the run silently started at step 0


def test_an_io_error_while_verifying_moves_nothing_aside(tmp_path: Path, monkeypatch):
    import trnrecipes.checkpoint.format as checkpoint

    root = tmp_path / "checkpoints"
    for step in (5, 10):
        save(root, step)
    before = listing(root)

    def flaky(path: Path) -> str:
        raise checkpoint.CheckpointReadError(f"{path}: cannot be read (Stale file handle)")

    monkeypatch.setattr(checkpoint, "_sha256", flaky)
    with pytest.raises(checkpoint.CheckpointReadError, match="Stale file handle"):
        settle_checkpoints(root, resume=True, force_fresh=False, log=quiet)
    assert listing(root) == before


def test_files_no_loader_reads_do_not_demote_a_checkpoint(tmp_path: Path):
    root = tmp_path / "checkpoints"
    save(root, 5)
    (root / "step_5/NOTES.txt").write_text("a note")
    (root / "step_5/.nfs000001").write_text("")
    assert settle_checkpoints(root, resume=True, force_fresh=False, log=quiet) == (5, root / "step_5")


def test_force_fresh_on_a_requeued_job_resumes_instead_of_archiving_again(tmp_path: Path):
    run = tmp_path / "run"
    save(run / "checkpoints", 20)
    found = settle_checkpoints(run / "checkpoints", resume=False, force_fresh=True, log=quiet, restarted=True)
    assert found == (20, run / "checkpoints/step_20") and not (run / "archived").exists()
    # resume false alone: the requeue of a job that saved before its time limit went on, not stopped with exit 2
    found = settle_checkpoints(run / "checkpoints", resume=False, force_fresh=False, log=quiet, restarted=True)
    assert found == (20, run / "checkpoints/step_20")


def test_a_restart_is_the_job_that_started_the_run_requeued_or_rerunning_its_step(tmp_path: Path):
    """HyperPod's --auto-resume reruns the step in the same run of the script, with no SLURM_RESTART_COUNT: before,
    a force_fresh run archived its own progress at each auto-resume. A job requeued before its run ever started
    is no restart of a run (it would have resumed another run's checkpoints)."""
    from trnrecipes.train.run_dir import record_fresh_start, restarted_job

    first = {"SLURM_JOB_ID": "7", "TRNRECIPES_LAUNCH_ID": "7.0.100.1"}
    assert not restarted_job(tmp_path, {"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "1"})  # no run started yet
    record_fresh_start(tmp_path, first)
    assert restarted_job(tmp_path, first)  # HyperPod's auto-resume: the step again, in the same launch
    assert restarted_job(tmp_path, {"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "1", "TRNRECIPES_LAUNCH_ID": "x"})
    assert not restarted_job(tmp_path, {"SLURM_JOB_ID": "7", "TRNRECIPES_LAUNCH_ID": "7.0.200.2"})  # salloc, again
    assert not restarted_job(tmp_path, {"SLURM_JOB_ID": "8", "SLURM_RESTART_COUNT": "3"})  # a new submission
    record_fresh_start(tmp_path, {})  # no Slurm (bash run.sbatch, EKS): nothing to tell a restart by
    assert not restarted_job(tmp_path, {}) and not restarted_job(tmp_path, first)


def test_force_fresh_alone_is_refused_not_silently_resumed():
    with pytest.raises(RecipeError, match=r"checkpoint.force_fresh true with checkpoint.resume true \(the default\)"):
        load_recipe("pythia-tiny", overrides=["checkpoint.force_fresh=true"])  # the docs' command once: it resumed
    assert load_recipe("pythia-tiny", overrides=["checkpoint.force_fresh=true", "checkpoint.resume=false"])


def test_a_run_dir_inside_a_checkpoint_or_checkpoints_is_refused_and_nothing_is_made(tmp_path: Path):
    from trnrecipes.train.run_dir import require_writable

    run = tmp_path / "run"
    save(run / "checkpoints", 20)
    before = listing(run)
    (tmp_path / "link").symlink_to(run / "checkpoints", target_is_directory=True)  # a link on the way
    slips = (run / "checkpoints/step_20", run / "checkpoints", run / "checkpoints/step_20/new", tmp_path / "link/r")
    for slip in slips:
        with pytest.raises(RecipeError, match=r"^run dir .*: it lies in (checkpoint|the run dir checkpoints) "):
            require_writable(slip)  # it wrote a run there, and the run it belongs to set step_20 aside
    assert listing(run) == before
    verify(run / "checkpoints/step_20")


def test_symlinked_step_dirs_are_refused_and_the_other_run_is_untouched(tmp_path: Path):
    other = tmp_path / "other/checkpoints"
    save(other, 30)
    before = listing(other)
    for name in ("step_1", ".step_2.tmp"):
        root = tmp_path / f"run-{name}/checkpoints"
        save(root, 5)
        (root / name).symlink_to(other / "step_30", target_is_directory=True)
        with pytest.raises(CheckpointError, match=rf"{name}.* is a symlink"):
            settle_checkpoints(root, resume=True, force_fresh=False, log=quiet)
    assert listing(other) == before
    verify(other / "step_30")


def test_resume_false_refuses_a_run_dir_with_checkpoints_unless_forced_and_then_archives(tmp_path: Path):
    run = tmp_path / "run"
    save(run / "checkpoints", 20)
    (run / "metrics.jsonl").write_text('{"step": 20}\n')
    before = listing(run)
    with pytest.raises(RecipeError, match=r"already has checkpoints \(step_20\).*checkpoint.force_fresh=true"):
        settle_checkpoints(run / "checkpoints", resume=False, force_fresh=False, log=quiet)
    assert listing(run) == before
    assert settle_checkpoints(run / "checkpoints", resume=False, force_fresh=True, log=quiet) is None
    (archive,) = (run / "archived").iterdir()
    verify(archive / "checkpoints/step_20")
    assert (archive / "metrics.jsonl").exists() and not (run / "metrics.jsonl").exists()
    save(run / "checkpoints", 5, keep_last=1)  # the new run's first save is not pruned by the old run's
    assert [s for s, _ in step_dirs(run / "checkpoints")] == [5]


# ---- the manifest


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return write_model_checkpoint(tmp_path / "ckpt", {"w": torch.ones(4), "b": torch.zeros(2)}, RECIPE)


def rewrite_manifest(path: Path, edit) -> None:
    manifest = json.loads((path / "manifest.json").read_text())
    edit(manifest["files"])
    (path / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("name", ["../escape.json", "/etc/passwd", "tokenizer/../../x", "", "a//b"])
def test_manifest_entries_must_name_files_inside_the_checkpoint(ckpt: Path, name: str):
    rewrite_manifest(ckpt, lambda files: files.update({name: "0" * 64}))
    with pytest.raises(CheckpointError, match="not a plain file name inside the dir"):
        verify(ckpt)


def test_files_not_in_the_manifest_are_refused(ckpt: Path):
    (ckpt / "data-dp0000.json").write_text('{"epoch": 0}')
    with pytest.raises(CheckpointError, match=r"data-dp0000\.json is not in the manifest"):
        verify(ckpt)


def test_weights_missing_from_manifest_and_disk_are_refused(ckpt: Path):
    rewrite_manifest(ckpt, lambda files: files.pop("model.safetensors"))
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model.safetensors \(weights, TP 1\) is not in the manifest"):
        verify(ckpt)


def test_a_symlink_inside_a_checkpoint_is_refused(ckpt: Path, tmp_path: Path):
    (tmp_path / "elsewhere.json").write_text("{}")
    (ckpt / "extra.json").symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(CheckpointError, match=r"extra\.json: a symlink inside a checkpoint"):
        verify(ckpt)


def test_malformed_safetensors_that_match_their_hash_give_a_message_not_a_traceback(ckpt: Path, tmp_path: Path):
    import hashlib

    (ckpt / "model.safetensors").write_bytes(b"\xff" * 64)
    digest = hashlib.sha256(b"\xff" * 64).hexdigest()
    rewrite_manifest(ckpt, lambda files: files.update({"model.safetensors": digest}))
    verify(ckpt)  # the hash matches: only reading it can tell
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a readable safetensors file"):
        read_model_checkpoint(ckpt)
    done = run_cli("convert", "to-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "hf"))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "not a readable safetensors file" in done.stderr


# ---- resume compatibility


def checkpoint_with_recipe(tmp_path: Path, tokenizer: Path | None = None) -> Path:
    path = tmp_path / "step_5"
    path.mkdir()
    (path / "recipe.yaml").write_text(yaml.safe_dump(RECIPE.to_dict()))
    if tokenizer is not None:
        import shutil

        shutil.copytree(tokenizer, path / "tokenizer")
    return path


def test_resume_lists_every_meaningful_difference_and_accepts_only_named_ones(tmp_path: Path):
    path = checkpoint_with_recipe(tmp_path)
    changed = load_recipe("llama2-tiny", overrides=["optim.lr=1e-2", "model.rotary_base=20000", "batch.seq_len=64",
                                                    "train.max_steps=999", "cluster.workers_per_node=2"])  # fmt: skip
    refused, accepted = resume_differences(path, changed.to_dict(), None, [])
    keys = sorted(line.split(":")[0] for line in refused)
    assert keys == ["batch.seq_len", "model.rotary_base", "optim.lr"]  # max_steps and the cluster are free
    refused, accepted = resume_differences(path, changed.to_dict(), None, ["optim", "batch.seq_len"])
    assert [line.split(":")[0] for line in refused] == ["model.rotary_base"]
    assert sorted(line.split(":")[0] for line in accepted) == ["batch.seq_len", "optim.lr"]
    shape = load_recipe("llama2-tiny", overrides=["model.num_layers=3"])
    refused, _ = resume_differences(path, shape.to_dict(), None, ["model"])
    assert len(refused) == 1 and refused[0].startswith("model.num_layers: "), refused
    assert refused[0].endswith("(cannot change on resume)")  # even with the whole model section allowed


def test_a_tokenizer_with_other_files_is_refused_even_at_the_same_path(tmp_path: Path):
    import shutil

    tok = REPO / RECIPE.data.tokenizer
    path = checkpoint_with_recipe(tmp_path, tok)
    assert resume_differences(path, RECIPE.to_dict(), tok, []) == ([], [])
    other = tmp_path / "tok"
    shutil.copytree(tok, other)
    with (other / "tokenizer.json").open("a") as f:
        f.write("\n")
    refused, _ = resume_differences(path, RECIPE.to_dict(), other, [])
    assert len(refused) == 1 and refused[0].startswith("data.tokenizer: its files")
    assert resume_differences(path, RECIPE.to_dict(), other, ["data.tokenizer"])[0] == []


def test_allow_changes_is_checked_when_the_recipe_loads():
    assert check_allow_changes(["optim.lr", "data", "batch.seq_len", "layout.dp"]) == []
    assert "covers the model's shape" in check_allow_changes(["model.hidden_size"])[0]
    assert "covers the model's shape" in check_allow_changes(["model.parallel_residual"])[0]
    assert "is not a recipe section or section.key" in check_allow_changes(["optim.lrr"])[0]
    with pytest.raises(RecipeError, match="covers the model's shape"):
        load_recipe("llama2-tiny", overrides=["checkpoint.allow_changes=[model]"])
    # an encoder's head: a resume at another num_labels failed loading its classifier; another pooling computes
    # something else; BERT's learned position table has max_seq_len rows (a rotary model's has none)
    for key in ("model.num_labels", "model.head", "model.pooling", "model.mlp_hidden_sizes", "model.max_seq_len"):
        with pytest.raises(RecipeError, match=f"'{key}' covers the model's shape"):
            load_recipe("bert-tiny", overrides=[f"checkpoint.allow_changes=[{key}]"])
    assert check_allow_changes(["model.max_seq_len"], "llama2") == []
    # launching only: a checkpoint saved with such an entry (or a mixture of experts on xla) before these rules
    # still loads for eval, predict, convert and init_from
    from trnrecipes.config.recipe import recipe_from_dict

    for name, overrides in (("bert-tiny", "model.max_seq_len"), ("m5-tiny", "model.num_labels")):
        saved = load_recipe(name).to_dict()
        saved["checkpoint"]["allow_changes"] = [overrides]
        assert list(recipe_from_dict(saved, "saved", launching=False).checkpoint.allow_changes) == [overrides]
        with pytest.raises(RecipeError, match="covers the model's shape"):
            recipe_from_dict(saved, "saved")
    saved = load_recipe("qwen3-moe-tiny").to_dict()
    saved["cluster"]["backend"] = "xla"
    assert recipe_from_dict(saved, "saved", launching=False).cluster.backend == "xla"


# ---- the lock


def test_a_second_holder_is_refused_with_the_first_ones_name(tmp_path: Path):
    with RunDirLock(tmp_path, quiet):
        with pytest.raises(RunDirBusy, match=rf"in use by another trainer \(pid {os.getpid()} on "):
            RunDirLock(tmp_path, quiet).acquire()
    RunDirLock(tmp_path, quiet).acquire().release()  # released on exit


def test_a_lock_left_by_a_killed_process_is_taken_over(tmp_path: Path):
    code = f"from trnrecipes.train.run_dir import RunDirLock; RunDirLock({str(tmp_path)!r}).acquire(); input()"
    holder = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdin=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not (tmp_path / LOCK_FILE).exists() or not (tmp_path / LOCK_FILE).stat().st_size:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with pytest.raises(RunDirBusy, match=f"pid {holder.pid}"):
        RunDirLock(tmp_path, quiet).acquire()
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    said: list[str] = []
    RunDirLock(tmp_path, said.append).acquire().release()
    assert said and f"left by pid {holder.pid}" in said[0] and "no longer running" in said[0]


def write_record(path: Path, **fields) -> dict:
    """A holder's record as RunDirLock writes it: in place, padded, never truncated first."""
    record = {"host": os.uname().nodename, "pid": os.getpid(), "since": "then", "heartbeat": time.time(), **fields}
    with open(path / LOCK_FILE, "r+b" if (path / LOCK_FILE).exists() else "wb") as f:
        f.write(json.dumps(record).ljust(512).encode())
    return record


def beat(path: Path, stop, **fields) -> None:
    while True:
        write_record(path, **fields)
        if stop.wait(0.05):
            return


@pytest.mark.parametrize("use_flock", [True, False])
def test_a_live_holder_elsewhere_is_seen_through_its_heartbeat_even_when_flock_succeeds(tmp_path: Path, use_flock):
    """flock on NFS with local_lock=flock or Lustre localflock only excludes this node: the heartbeat still does."""
    import threading

    stop = threading.Event()
    write_record(tmp_path, host="another-node", pid=7)
    beater = threading.Thread(target=beat, args=(tmp_path, stop), kwargs={"host": "another-node", "pid": 7})
    beater.start()
    try:
        with pytest.raises(RunDirBusy, match="pid 7 on 'another-node'"):
            RunDirLock(tmp_path, quiet, use_flock=use_flock, heartbeat_s=0.2).acquire()
    finally:
        stop.set()
        beater.join()
    said: list[str] = []
    lock = RunDirLock(tmp_path, said.append, use_flock=use_flock, heartbeat_s=0.2).acquire()  # its beat stopped
    assert "its heartbeat stopped" in said[-1]
    lock.release()


def test_the_heartbeat_fallback_refuses_a_live_holder_here_and_takes_over_a_dead_one_at_once(tmp_path: Path):
    import threading

    sleeper = subprocess.Popen(["sleep", "60"])
    stop = threading.Event()
    write_record(tmp_path, pid=sleeper.pid)
    beater = threading.Thread(target=beat, args=(tmp_path, stop), kwargs={"pid": sleeper.pid})
    beater.start()
    try:
        with pytest.raises(RunDirBusy, match=f"pid {sleeper.pid}"):
            RunDirLock(tmp_path, quiet, use_flock=False, heartbeat_s=0.2).acquire()
    finally:
        stop.set()
        beater.join()
        sleeper.kill()
        sleeper.wait()
    write_record(tmp_path, pid=sleeper.pid)  # fresh, but its pid is gone on this host: no need to wait
    said: list[str] = []
    lock = RunDirLock(tmp_path, said.append, use_flock=False, heartbeat_s=30).acquire()
    assert f"left by pid {sleeper.pid}" in said[-1] and "no longer running" in said[-1]
    lock.release()
    lock = RunDirLock(tmp_path, quiet, use_flock=False, heartbeat_s=0.2).acquire()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    time.sleep(0.5)  # it beats
    assert time.time() - json.loads((tmp_path / LOCK_FILE).read_text())["heartbeat"] < 0.5
    lock.release()
    assert (tmp_path / LOCK_FILE).read_text() == ""  # a clean release leaves no holder


def test_concurrent_acquirers_without_flock_get_one_lock(tmp_path: Path):
    """Four processes at once: one holds the lock until the other three have given up. (The holder used to let go
    after 2 s: on a loaded machine a fourth process could start after that and rightly take the lock over.)"""
    code = (
        "import os, sys, time; from trnrecipes.train.run_dir import RunDirLock, RunDirBusy\n"
        "try:\n    RunDirLock(sys.argv[1], lambda *_: None, use_flock=False, heartbeat_s=0.5).acquire()\n"
        "except RunDirBusy:\n    print('busy'); sys.exit(0)\n"
        "print('held'); sys.stdout.flush()\n"
        "while not os.path.exists(sys.argv[2]):\n    time.sleep(0.05)\n"
    )
    for trial in range(3):
        d, release = tmp_path / str(trial), tmp_path / f"release-{trial}"
        d.mkdir()
        procs = [subprocess.Popen([sys.executable, "-c", code, str(d), str(release)], cwd=REPO, stdout=subprocess.PIPE,
                                  text=True) for _ in range(4)]  # fmt: skip
        deadline = time.monotonic() + 120
        while sum(p.poll() is not None for p in procs) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        release.touch()
        outs = [p.communicate(timeout=60)[0].strip() for p in procs]
        assert sorted(outs) == ["busy", "busy", "busy", "held"], outs


def test_a_symlink_where_the_lock_goes_is_refused(tmp_path: Path):
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_FILE).symlink_to(target)
    with pytest.raises(RunDirBusy, match="cannot open the run dir lock"):
        RunDirLock(run, quiet).acquire()
    assert target.read_text() == "keep me"
