"""Job dirs of classification recipes (family bert): eval.sbatch scores data.eval_path with `trnrecipes predict`,
infer.sbatch embeds a file with `trnrecipes embed` and requeues itself before the time limit. The scripts are run
here with plain bash, a stand-in interpreter for `python -m trnrecipes` and a stand-in `scontrol` (no Slurm)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from golden import render_case

from trnrecipes.config.recipe import load_recipe
from trnrecipes.jobs.render import CLASSIFICATION_SCRIPTS, SCRIPTS, render_job, render_warnings, write_job

# Logs its argv; as `embed` it first publishes one chunk in OUT.parts/, then finishes (FAKE_FINISH) or runs until
# stopped. The pre-flight's probe of the job's Python (-c) runs the real one.
FAKE_PYTHON = f"""#!/bin/bash
if [[ "$1" == -c ]]; then exec {sys.executable} "$@"; fi
out=""; prev=""
for a in "$@"; do [[ "$prev" == --out ]] && out=$a; prev=$a; done
if [[ "$3" == embed ]]; then
  mkdir -p "$out.parts"
  n=$(find "$out.parts" -name 'chunk_*.arrow' | wc -l)
  [[ -n "${{FAKE_NO_CHUNK:-}}" ]] || : >"$out.parts/chunk_$n.arrow"
  echo "$*" >>"$FAKE_LOG"
  if [[ -n "${{FAKE_FINISH:-}}" ]]; then rm -r "$out.parts"; : >"$out"; exit 0; fi
  exec sleep 60
fi
echo "$*" >>"$FAKE_LOG"
echo "accuracy 0.900 on 10 rows (majority class 0.500)"
"""
FAKE_SCONTROL = """#!/bin/bash
echo "scontrol $*" >>"$FAKE_LOG"
case "$1 $2" in
  "show hostnames") echo node1 ;;
  "show node") echo "NodeName=node1 NodeAddr=127.0.0.1 State=IDLE" ;;
esac
"""


@pytest.mark.parametrize(("name", "nodes"), [("bert-base-cls", 1), ("m5-encoder-mlp", 2)])
def test_classification_job_dirs_add_infer_and_score_the_holdout(name, nodes):
    files = render_case(name, nodes)
    assert [f for f in files if f.endswith(".sbatch")] == list(CLASSIFICATION_SCRIPTS)
    recipe = load_recipe(name, nodes=nodes)
    holdout = f"/opt/trnrecipes/{recipe.data.eval_path}"
    evaluation = files["eval.sbatch"]
    assert f"EVAL_DEFAULT={holdout}\n" in evaluation
    assert (
        '-m trnrecipes predict --ckpt "$RUN_DIR" --in "$EVAL_IN" --out "$RUN_DIR/eval/predictions.jsonl"' in evaluation
    )
    assert "eval run" not in evaluation and "#SBATCH --nodes=1\n" in evaluation
    infer = files["infer.sbatch"]
    for line in (
        "#SBATCH --nodes=1\n",
        "#SBATCH --requeue\n",
        "#SBATCH --signal=B:USR1@120\n",
        "trap 'stop_embed timeout' USR1",
        '-m trnrecipes embed --ckpt "$RUN_DIR" --in "$INFER_IN" --out "$INFER_OUT" "$@")',
        'scontrol requeue "$JOB_ID"',
    ):
        assert line in infer, line
    # Neither starts torchrun: one process on the host CPUs.
    assert "TORCHRUN=(" not in evaluation + infer


def test_language_model_job_dirs_keep_three_scripts_and_lm_eval():
    files = render_case("pythia-tiny", 1)
    assert [f for f in files if f.endswith(".sbatch")] == list(SCRIPTS)
    assert "-m trnrecipes eval run" in files["eval.sbatch"] and "predict" not in files["eval.sbatch"]
    assert "infer.sbatch" not in files["run.sbatch"]


def test_without_eval_path_sbatch_warns_and_eval_stops_unless_given_a_file(tmp_path):
    recipe = load_recipe("bert-base-cls", nodes=1, overrides=f"data.eval_path=null run_dir={tmp_path}/run")
    assert any(w.startswith("data.eval_path is not set") for w in render_warnings(recipe))
    assert not any("eval_path" in w for w in render_warnings(load_recipe("bert-base-cls", nodes=1)))
    assert not any("eval_path" in w for w in render_warnings(load_recipe("pythia-tiny", nodes=1)))
    job = render_job(recipe, tmp_path / "job", "test")
    write_job(job, {})
    env = _fake_env(tmp_path)
    done = _bash(job.job_dir / "eval.sbatch", env)
    assert done.returncode == 2
    assert "the recipe sets no data.eval_path" in done.stdout
    done = _bash(job.job_dir / "eval.sbatch", env | {"EVAL_IN": "holdout.jsonl"}, "--batch-size", "16")
    assert done.returncode == 0, done.stdout
    assert f"predict --ckpt {tmp_path}/run --in {tmp_path}/holdout.jsonl --out {tmp_path}/run/eval/predictions.jsonl" \
        " --batch-size 16" in (tmp_path / "calls.log").read_text()  # fmt: skip


def test_infer_needs_a_file_and_writes_the_default_output(tmp_path):
    job_dir = _job(tmp_path)
    env = _fake_env(tmp_path)
    done = _bash(job_dir / "infer.sbatch", env)
    assert done.returncode == 2 and "set INFER_IN to the file to embed" in done.stdout
    done = _bash(job_dir / "infer.sbatch", env | {"INFER_IN": "in/queries.jsonl", "FAKE_FINISH": "1"})
    assert done.returncode == 0, done.stdout
    assert (tmp_path / "run" / "embeddings" / "queries.arrow").exists()  # relative to where it was submitted from
    assert f"embed --ckpt {tmp_path}/run --in {tmp_path}/in/queries.jsonl" in (tmp_path / "calls.log").read_text()


@pytest.mark.parametrize(
    ("sig", "extra", "rc", "requeued", "says"),
    [
        (signal.SIGUSR1, {}, 0, True, "1 chunk(s) finished in this run: requeueing job 4242"),
        (signal.SIGUSR1, {"FAKE_NO_CHUNK": "1"}, 1, False, "no chunk finished in this run before the time limit"),
        (signal.SIGTERM, {}, 143, False, "embed stopped by TERM"),
    ],
    ids=["timeout-with-progress", "timeout-without-progress", "cancelled"],
)
def test_infer_requeues_before_the_time_limit_only_after_progress(tmp_path, sig, extra, rc, requeued, says):
    job_dir = _job(tmp_path)
    slurm = {
        "SLURM_JOB_ID": "4242",
        "SLURM_NNODES": "1",
        "SLURM_JOB_NODELIST": "node1",
        "SLURM_SUBMIT_DIR": str(tmp_path),
    }
    env = _fake_env(tmp_path) | slurm | {"INFER_IN": "queries.txt"} | extra
    log = tmp_path / "calls.log"
    with subprocess.Popen(
        ["bash", str(job_dir / "infer.sbatch")], env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    ) as proc:
        deadline = time.monotonic() + 30
        while "embed" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(sig)
        out = proc.communicate(timeout=30)[0].decode()
    assert proc.returncode == rc, out
    assert says in out
    assert ("scontrol requeue 4242" in log.read_text()) == requeued


def _job(tmp_path):
    job = render_job(load_recipe("bert-base-cls", nodes=1, overrides=f"run_dir={tmp_path}/run"), tmp_path / "job", "t")
    write_job(job, {})
    return job.job_dir


def _fake_env(tmp_path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("python", FAKE_PYTHON), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return os.environ | {
        "TRNRECIPES_PYTHON": str(bin_dir / "python"),
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "FAKE_LOG": str(tmp_path / "calls.log"),
    }


def _bash(script, env, *args) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(script), *args], env=env, cwd=env.get("SLURM_SUBMIT_DIR", script.parent.parent),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
