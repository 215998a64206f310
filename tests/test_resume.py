"""Checkpoints never lose work: bitwise-deterministic resume after SIGKILL, a campaign of kills at random moments
(during async saves too), corrupt checkpoints skipped, resume with another DP/TP layout, keep-last-K."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO, rank_launcher
from safetensors.torch import load_file

from trnrecipes.checkpoint import verify
from trnrecipes.checkpoint.format import latest_checkpoint, step_dirs
from trnrecipes.config.recipe import load_recipe

pytestmark = pytest.mark.slow

SMALL = ["cluster.workers_per_node=1", "batch.seq_len=32", "batch.global_batch=4", "batch.micro_batch=2",
         "train.log_every=1", "train.val_every=1000"]  # fmt: skip


def config(tmp_path: Path, *overrides: str) -> Path:
    recipe = load_recipe("llama2-tiny", overrides=[*SMALL, f"run_dir={tmp_path / 'run'}", *overrides])
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))
    return path


def start(cfg: Path, slow_saves: bool = False, **env: str) -> subprocess.Popen:
    launcher = [str(REPO / "tests" / "slow_saves.py")] if slow_saves else ["-m", "trnrecipes"]
    cmd = [sys.executable, *launcher, "train", "--config", str(cfg)]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **env})  # fmt: skip


def finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    return out


def logged_steps(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def last_losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in logged_steps(run)}  # a replayed step's later entry wins


def saving(checkpoints: Path, after: int = 0) -> bool:
    """A save of a step past `after` is in flight: its .step_N.tmp is there."""
    try:
        names = [p.name for p in checkpoints.iterdir()]
    except FileNotFoundError:
        return False
    return any(int(m.group(1)) > after for n in names if (m := re.fullmatch(r"\.step_(\d+)\.tmp", n)))


def wait_for_save(checkpoints: Path, after: int, proc: subprocess.Popen) -> None:
    """This process saved, or is saving, a step past `after`. (Not metrics.jsonl: until the new process has loaded
    and truncated it, it still holds the steps its killed predecessor logged past its checkpoint.)"""
    while not saving(checkpoints, after) and max([s for s, _ in step_dirs(checkpoints)], default=0) <= after:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.001)


def wait_for_step(run: Path, step: int, proc: subprocess.Popen) -> None:
    while not any(r["step"] >= step for r in logged_steps(run)):
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.02)


def final_weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(run / "checkpoints" / f"step_{step}" / "model.safetensors")


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """The uninterrupted reference: 30 steps."""
    tmp = tmp_path_factory.mktemp("straight")
    finish(start(config(tmp, "train.max_steps=30", "checkpoint.every_steps=5", "checkpoint.keep_last=3")))
    return tmp / "run"


def test_resume_after_sigkill_is_bitwise_identical(straight: Path, tmp_path: Path):
    cfg = config(tmp_path, "train.max_steps=30", "checkpoint.every_steps=5")
    run = tmp_path / "run"
    proc = start(cfg)
    wait_for_step(run, 17, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    out = finish(start(cfg))
    # the newest complete checkpoint: step 15 (or 10, if the kill came while step 15 was still being written)
    assert re.search(r"resuming from \S+ \(step (10|15)\)", out), out
    ours, ref = last_losses(run), last_losses(straight)
    assert [ours[s] for s in range(18, 31)] == [ref[s] for s in range(18, 31)]  # exactly, not approximately
    assert_bitwise_equal(final_weights(run, 30), final_weights(straight, 30))


def test_fault_campaign_of_random_sigkills(straight: Path, tmp_path: Path):
    # a checkpoint every step, written asynchronously; the aimed kills' runs slow it (tests/slow_saves.py)
    cfg = config(tmp_path, "train.max_steps=30", "checkpoint.every_steps=1", "checkpoint.keep_last=2")
    run, rng, kills, mid_save, had_one = tmp_path / "run", random.Random(0), 0, 0, False
    while kills < 20:
        done_before = max([s for s, _ in step_dirs(run / "checkpoints")], default=0)
        if done_before >= 29:
            break
        aimed = kills % 2 == 1  # every other kill aims at a save in flight, slowed so that it cannot be missed
        proc = start(cfg, slow_saves=aimed)
        wait_for_save(run / "checkpoints", done_before, proc)  # it resumed and made progress
        if aimed:
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline and proc.poll() is None and not saving(run / "checkpoints"):
                time.sleep(0.001)
        else:
            time.sleep(rng.uniform(0.0, 0.6))
        if proc.poll() is not None:
            break
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills += 1
        mid_save += any(p.name.startswith(".step_") for p in (run / "checkpoints").iterdir())
        # whatever the moment, every step dir that claims to be complete verifies, and one is the latest
        for _, path in step_dirs(run / "checkpoints"):
            if (path / "done").exists():
                verify(path)
        # and once a complete checkpoint exists, a kill never leaves none (pruning runs after the new one is done)
        latest = latest_checkpoint(run / "checkpoints")
        had_one = had_one or latest is not None
        assert latest is not None or not had_one
    assert kills >= 20 and mid_save >= 8, (kills, mid_save)  # the aimed kills interrupted a save in flight
    finish(start(cfg))
    assert_bitwise_equal(final_weights(run, 30), final_weights(straight, 30))
    assert [last_losses(run)[s] for s in range(1, 31)] == [last_losses(straight)[s] for s in range(1, 31)]
    assert len([p for _, p in step_dirs(run / "checkpoints")]) == 2  # keep_last


def test_a_corrupt_checkpoint_is_reported_and_the_previous_one_used(straight: Path, tmp_path: Path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(straight, run)
    newest = run / "checkpoints/step_30/model.safetensors"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    newest.write_bytes(bytes(data))
    (run / "checkpoints/step_25/optim-tp00-of-01.safetensors").write_bytes(b"truncated")
    cfg = config(tmp_path, "train.max_steps=31", "checkpoint.every_steps=5", "checkpoint.keep_last=3")
    out = finish(start(cfg))
    assert "step_30 is unusable" in out and "step_30/model.safetensors: checksum mismatch" in out
    assert "step_25 is unusable" in out and "optim-tp00-of-01.safetensors: checksum mismatch" in out
    assert "resuming from" in out and "(step 20)" in out
    assert last_losses(run)[25] == last_losses(straight)[25]  # steps 21-25 replayed exactly


def test_resume_with_another_dp_and_tp_layout(tmp_path: Path):
    """Saved by 1 process, resumed by 2 (DP 2, then TP 2): weights and moments re-sliced, training goes on."""
    base = ["batch.seq_len=32", "batch.global_batch=4", "batch.micro_batch=2", "train.val_every=1000",
            "checkpoint.every_steps=5", "checkpoint.allow_changes=[layout.dp]"]  # fmt: skip
    for i, layout in enumerate([[], ["layout.tp=2"]]):
        run = tmp_path / f"run{i}"
        one = load_recipe("llama2-tiny", overrides=[*base, "cluster.workers_per_node=1", f"run_dir={run}"])
        cfg = tmp_path / f"one{i}.yaml"
        cfg.write_text(yaml.safe_dump({**one.to_dict(), "train": {**one.to_dict()["train"], "max_steps": 5}}))
        finish(start(cfg))
        two = load_recipe("llama2-tiny", overrides=[*base, "cluster.workers_per_node=2", f"run_dir={run}", *layout])
        cfg2 = tmp_path / f"two{i}.yaml"
        cfg2.write_text(yaml.safe_dump({**two.to_dict(), "train": {**two.to_dict()["train"], "max_steps": 8}}))
        cmd = [*rank_launcher(2), "-m", "trnrecipes", "train", "--config", str(cfg2)]  # fmt: skip
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert "resuming from" in done.stdout and "(step 5)" in done.stdout
        steps = [r["step"] for r in logged_steps(run)]
        assert steps == [1, 2, 3, 4, 5, 6, 7, 8]
        if not layout:
            assert "data parallel size changed (1 -> 2)" in done.stdout
        assert (run / "checkpoints/step_8/done").exists()


def copy_run(straight: Path, tmp_path: Path) -> Path:
    import shutil

    shutil.copytree(straight, tmp_path / "run")
    (tmp_path / "run" / ".trnrecipes.lock").unlink(missing_ok=True)
    return tmp_path / "run"


def test_the_issue_repro_a_corrupt_newest_checkpoint_does_not_get_the_new_saves_pruned(straight: Path, tmp_path: Path):
    run = copy_run(straight, tmp_path)
    newest = run / "checkpoints/step_30/model.safetensors"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    out = finish(start(config(tmp_path, "train.max_steps=27", "checkpoint.every_steps=5", "checkpoint.keep_last=1")))
    assert "(step 25)" in out and "step_30 is unusable, moved to" in out
    assert [s for s, _ in step_dirs(run / "checkpoints")] == [27]  # before: only the corrupt step_30 was left
    assert (run / "checkpoints/unusable/step_30").is_dir()
    out = finish(start(config(tmp_path, "train.max_steps=29", "checkpoint.every_steps=5", "checkpoint.keep_last=1")))
    assert "(step 27)" in out  # before: the next run silently started from step 1
    assert last_losses(run)[29] == last_losses(straight)[29]


def test_a_second_trainer_on_the_same_run_dir_is_refused(tmp_path: Path):
    cfg = config(tmp_path, "train.max_steps=400", "checkpoint.every_steps=1000")
    run = tmp_path / "run"
    first = start(cfg)
    try:
        wait_for_step(run, 2, first)
        second = start(cfg)
        out = finish_failing(second)
        assert f"is in use by another trainer (pid {first.pid} on " in out and "Traceback" not in out, out
        assert first.poll() is None  # the first one trains on
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    steps = [r["step"] for r in logged_steps(run)]
    assert steps == list(range(1, len(steps) + 1))  # one writer: no interleaved metrics
    out = finish(start(config(tmp_path, "train.max_steps=3", "checkpoint.every_steps=1000")))
    assert f"taking over the run dir lock left by pid {first.pid}" in out


def finish_failing(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 2, out[-3000:]
    return out


def test_resume_refuses_a_changed_recipe_and_lists_the_differences(straight: Path, tmp_path: Path):
    run = copy_run(straight, tmp_path)
    changed = ["train.max_steps=31", "model.rotary_base=20000", "optim.lr=0.01", "data.val_fraction=0.2"]
    out = finish_failing(start(config(tmp_path, *changed)))
    assert "cannot resume from" in out and "Traceback" not in out, out
    for key in ("model.rotary_base: 10000.0 -> 20000", "optim.lr: ", "data.val_fraction: "):
        assert key in out, out
    assert not (run / "checkpoints/step_31").exists()
    shape = finish_failing(start(config(tmp_path, "train.max_steps=31", "model.ffn_hidden_size=96")))
    assert "model.ffn_hidden_size" in shape and "cannot change on resume" in shape and "Traceback" not in shape
    allowed = finish(
        start(config(tmp_path, "train.max_steps=31", "optim.lr=0.01", "checkpoint.allow_changes=[optim.lr]"))
    )
    assert "resuming with a changed recipe (checkpoint.allow_changes): optim.lr:" in allowed
    assert "(step 30)" in allowed and (run / "checkpoints/step_31/done").exists()
    # a larger batch from step 31 on: tokens_seen counts on from step 31's record (31 x 4 x 32), each step at 8 x 32
    bigger = ["train.max_steps=33", "optim.lr=0.01", "batch.global_batch=8", "checkpoint.every_steps=5"]
    finish(start(config(tmp_path, *bigger, "checkpoint.allow_changes=[optim.lr,batch.global_batch]")))
    seen = {r["step"]: r["tokens_seen"] for r in logged_steps(run)}
    assert [seen[s] for s in (31, 32, 33)] == [31 * 128, 31 * 128 + 256, 31 * 128 + 512]


def test_resume_false_on_a_run_dir_with_checkpoints_refuses_unless_forced(straight: Path, tmp_path: Path):
    run = copy_run(straight, tmp_path)
    out = finish_failing(start(config(tmp_path, "train.max_steps=5", "checkpoint.resume=false")))
    assert "already has checkpoints (step_30, step_25, step_20)" in out and "Traceback" not in out
    assert [s for s, _ in step_dirs(run / "checkpoints")] == [30, 25, 20]
    (run / "eval/step_30").mkdir(parents=True)  # the old weights' results: the new run's eval would be refused there
    (run / "eval/step_30/results.json").write_text("{}")
    forced = ["train.max_steps=5", "checkpoint.every_steps=5", "checkpoint.resume=false", "checkpoint.force_fresh=true"]
    inside = finish_failing(start(config(tmp_path, *forced, f"train.init_from={run}/checkpoints/step_25")))
    assert f"train.init_from {run}/checkpoints/step_25 is in this run dir's {run}/checkpoints" in inside, inside
    assert not (run / "archived").exists() and [s for s, _ in step_dirs(run / "checkpoints")] == [30, 25, 20]
    launch = {"SLURM_JOB_ID": "41", "TRNRECIPES_LAUNCH_ID": "41.0.1.1"}  # as run.sbatch exports them
    out = finish(start(config(tmp_path, *forced), **launch))
    assert "moved the previous run's checkpoints and metrics to" in out
    assert [s for s, _ in step_dirs(run / "checkpoints")] == [5]  # before: the new run's save was pruned
    (archive,) = (run / "archived").iterdir()
    verify(archive / "checkpoints/step_30")
    assert (archive / "eval/step_30/results.json").is_file() and not (run / "eval").exists()
    assert [r["step"] for r in logged_steps(run)] == [1, 2, 3, 4, 5]
    # the same job launched again (HyperPod's auto-resume: no SLURM_RESTART_COUNT) resumes, archiving nothing
    out = finish(start(config(tmp_path, *forced[1:], "train.max_steps=6"), **launch))
    assert "(step 5)" in out and len(list((run / "archived").iterdir())) == 1
    assert [r["step"] for r in logged_steps(run)] == [1, 2, 3, 4, 5, 6]


def test_another_corpus_at_the_same_path_is_refused_unless_named(tmp_path: Path):
    import pyarrow as pa

    source = pa.memory_map(str(REPO / "data/demo/pythondocs.arrow"))
    try:
        table = pa.ipc.open_stream(source).read_all()
    except pa.ArrowInvalid:
        table = pa.ipc.open_file(pa.memory_map(str(REPO / "data/demo/pythondocs.arrow"))).read_all()
    corpus = tmp_path / "corpus.arrow"

    def write(rows: int) -> None:
        with pa.OSFile(str(corpus), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table.slice(0, rows))

    write(table.num_rows)
    finish(start(config(tmp_path, "train.max_steps=3", "checkpoint.every_steps=3", f"data.path={corpus}")))
    write(table.num_rows // 2)  # the same path, another corpus: the saved positions would index other documents
    out = finish_failing(start(config(tmp_path, "train.max_steps=4", f"data.path={corpus}")))
    assert f"trained on a corpus of {table.num_rows} documents, but data.path now has" in out and "Traceback" not in out
    allow = ["train.max_steps=4", f"data.path={corpus}", "checkpoint.allow_changes=[data.path]"]
    out = finish(start(config(tmp_path, *allow)))
    assert "the corpus changed" in out and "the data stream restarts at epoch 1" in out and "(step 3)" in out
