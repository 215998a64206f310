"""Every node of a job makes its own job Python ready, under the loopback Slurm: each emulated node's job Python is a
wrapper keyed on SLURMD_NODENAME. A node whose Python lacks PyYAML and tokenizers installs them from the job's
wheelhouse (trnrecipes/ops/ready.py) and the job trains; a node whose Neuron stack is another SDK's while the other
nodes' is right is a node fault (requeued without it); every node's the same is bad input (exit 2, no requeue)."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, run_cli
from neuron_standin import megatron_corpus, neuron_ls, standin_venv
from test_slurm import SMALL, job_info, slurm, submit, wait_done

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
LACKING = ("yaml", "_yaml", "tokenizers")  # modules node2's Python lacks: PyYAML's and tokenizers'


def per_node_python(path: Path, pythons: dict[str, Path], default: Path) -> Path:
    """A job Python that is `pythons[node]` on that emulated node, `default` elsewhere."""
    cases = "".join(f'  {node}) exec {python} "$@" ;;\n' for node, python in pythons.items())
    path.write_text(f'#!/bin/sh\ncase "$SLURMD_NODENAME" in\n{cases}  *) exec {default} "$@" ;;\nesac\n')
    path.chmod(0o755)
    return path


def python_lacking(root: Path, modules: tuple[str, ...]) -> Path:
    """A real venv that sees this venv's packages but `modules` (a .pth to a view of symbolic links), with its own
    site-packages for what gets installed into it."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    site = next(Path(p) for p in sys.path if p.endswith("site-packages") and Path(p).is_dir())
    view = root / "view"
    view.mkdir()
    for entry in site.iterdir():
        name = entry.name.split("-")[0].split(".")[0].lower()
        if name not in modules and name not in ("pyyaml", "tokenizers") and not entry.name.endswith(".pth"):
            (view / entry.name).symlink_to(entry)
    own = next((root / "lib").glob("python3*/site-packages"))
    (own / "view.pth").write_text(f"{view}\n")
    return root / "bin" / "python"


def test_a_node_lacking_packages_installs_them_from_the_wheelhouse_and_the_job_trains(slurm_env, tmp_path):
    lock = tmp_path / "lock.txt"  # what node2 lacks, at this venv's versions, for this Python and machine
    lock.write_text(
        f"# python: {sys.version_info[0]}.{sys.version_info[1]}\n# platform: manylinux_2_36_x86_64\n"
        f"pyyaml=={importlib.metadata.version('pyyaml')}\ntokenizers=={importlib.metadata.version('tokenizers')}\n"
    )
    wheels = tmp_path / "wheels"
    made = subprocess.run([sys.executable, "-m", "trnrecipes.ops.wheels", "--lock", str(lock), "--out", str(wheels)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert made.returncode == 0 and len(list(wheels.glob("*.whl"))) == 2, made.stdout + made.stderr
    lacking = python_lacking(tmp_path / "node2-venv", LACKING)
    assert subprocess.run([lacking, "-c", "import yaml"], capture_output=True).returncode != 0
    python = per_node_python(tmp_path / "python", {"node2": lacking}, Path(sys.executable))
    job, run = tmp_path / "job", tmp_path / "run"
    done = run_cli("sbatch", "--recipe", "llama2-tiny", "--nodes", "2", "--out", str(job), "--overrides",
                   f"{SMALL} train.max_steps=3 run_dir={run} cluster.python={python}")  # fmt: skip
    assert done.returncode == 0, done.stderr
    job_id = submit({**slurm_env, "TRNRECIPES_WHEELS": str(wheels)}, str(job / "run.sbatch"))
    log = job / "logs" / f"llama2-tiny-2n-{job_id}.out"
    info = wait_done(slurm_env, job_id, log, timeout=300)
    out = log.read_text()
    assert info["Restarts"] == "0" and "step 3/3" in out, out[-3000:]
    assert f"[ready] node2: installed pyyaml, tokenizers into {python} from {wheels}" in out
    assert "[ready] node1" not in out  # nothing lacking there: nothing installed
    assert subprocess.run([lacking, "-c", "import yaml, tokenizers"], capture_output=True).returncode == 0


def neuron_job(tmp_path: Path, python: Path) -> tuple[Path, dict[str, str]]:
    """pythia-70m on 2 trn1 nodes over a stand-in Megatron corpus, with a stand-in neuron-ls on PATH."""
    prefix = megatron_corpus(tmp_path / "data/wiki")
    job = tmp_path / "job"
    done = run_cli("sbatch", "--recipe", "pythia-70m", "--nodes", "2", "--out", str(job), "--no-data-check",
                   "--overrides", f"data.path={prefix} run_dir={tmp_path / 'run'} cluster.python={python}")  # fmt: skip
    assert done.returncode == 0, done.stderr
    neuron_ls(tmp_path / "bin", devices=16, cores_per_device=2)
    return job, {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}


@pytest.mark.parametrize("wrong", [("node2",), ("node1", "node2", "node3")])
def test_a_wrong_neuron_stack_on_one_node_is_a_node_fault_and_on_every_node_bad_input(slurm_env, tmp_path, wrong):
    right = standin_venv(tmp_path / "sdk-2.26", "2.26")
    other = standin_venv(tmp_path / "sdk-2.27", "2.26", {"torch-neuronx": "2.8.0.2.11.0"})  # SDK 2.27's build
    python = per_node_python(tmp_path / "python", dict.fromkeys(wrong, other), right)
    job, env = neuron_job(tmp_path, python)
    job_id = submit({**slurm_env, **env}, str(job / "run.sbatch"))
    log = job / "logs" / f"pythia-70m-2n-{job_id}.out"
    if len(wrong) == 1:  # requeued without node2; then nothing here can run Neuron: stop it there
        deadline = time.monotonic() + 180
        while f"excluded node(s) node2 from job {job_id}" not in (log.read_text() if log.exists() else ""):
            assert time.monotonic() < deadline, log.read_text() if log.exists() else "no log"
            time.sleep(0.5)
        info = job_info(slurm_env, job_id)
        slurm(slurm_env, "scancel", job_id)
        out = log.read_text()
        assert info["ExcNodeList"] == "node2", info
        assert "torch-neuronx 2.8.0.2.11.0 in " in out and "that is Neuron SDK 2.27's" in out
        requeued = "the pre-flight failed (above) (the pre-flight names node2): requeueing job"
        assert f"{requeued} {job_id}" in out
        return
    info = wait_done(slurm_env, job_id, log, state="FAILED", timeout=180)
    out = log.read_text()
    assert info["Restarts"] == "0" and info["ExitCode"] == "2:0", out[-3000:]
    assert "the pre-flight fails on every node of the job (above): bad input, not a node fault; not requeued" in out
    assert "requeueing" not in out and not (job / "logs" / f"{job_id}.failures").exists()


@pytest.mark.parametrize(
    ("codes", "exit_code", "named"),
    [
        ({"node1": 0, "node2": 0}, 0, ""),  # ready everywhere
        ({"node1": 0, "node2": 2}, 0, "node2"),  # data missing on one node only (a mount): that node's
        ({"node1": 4, "node2": 0}, 0, "node1"),  # one node's Python
        ({"node1": 137, "node2": 0}, 0, "node1"),  # a crash on one node
        ({"node1": 2, "node2": 2}, 2, None),  # the same on every node: bad input, never requeued
        ({"node1": 4, "node2": 2}, 2, None),
        ({"node1": 1, "node2": 1}, 0, "node1\nnode2"),  # devices on every node: run.sbatch's majority rule says
        ({}, 0, ""),  # nobody answered (the step did not start): a fault of the moment
    ],
)
def test_the_scripts_verdict_over_the_nodes_pre_flights(tmp_path, codes, exit_code, named):
    """The rendered preflight_verdict, run by bash over one file a node as the nodes write them."""
    job = tmp_path / "job"
    done = run_cli("sbatch", "--recipe", "llama2-tiny", "--nodes", "2", "--out", str(job), "--no-data-check",
                   "--overrides", f"{SMALL} run_dir={tmp_path / 'run'}")  # fmt: skip
    assert done.returncode == 0, done.stderr
    script = (job / "run.sbatch").read_text()
    verdict = script[script.index("preflight_verdict() {") : script.index("\n}\n", script.index("preflight_verdict"))]
    verdicts = tmp_path / "verdicts"
    verdicts.mkdir()
    for node, code in codes.items():
        (verdicts / node).write_text(f"{code}\n")
    probe = (
        f'set -euo pipefail\nNNODES=2\nPREFLIGHT_RC=7\n{verdict}\n}}\npreflight_verdict "$1"\necho "rc=$PREFLIGHT_RC"\n'
    )
    run = subprocess.run(["bash", "-c", probe, "verdict", str(verdicts)], capture_output=True, text=True)
    assert run.returncode == exit_code, run.stdout + run.stderr
    if exit_code == 2:
        assert "the pre-flight fails on every node of the job" in run.stderr
        return
    failed = verdicts / "failed-nodes"
    assert run.stdout.strip() == f"rc={1 if named or not codes else 0}"
    assert (failed.read_text().strip() if failed.exists() else "") == named


def test_ready_says_why_in_one_line_and_never_crashes(tmp_path, capsys):
    """A wheelhouse record that is not one, no wheelhouse and no lock, another Python's wheels: exit 4, one line."""
    from trnrecipes.ops import ready

    lacking = {"module_that_is_not_installed_here": "not-installed-dist"}
    wheels = tmp_path / "neuron-2.99"
    wheels.mkdir()
    (wheels / "wheels.json").write_text("[]")
    why = ready.make_ready(wheels, "py", lacking)
    assert why == (
        f"py lacks not-installed-dist; no wheelhouse at {wheels}, and no wheel lock for this SDK: install"
        " requirements/neuron.txt into it on every node (docs/jobs.md, 'The job's Python'), or bake it into the AMI"
    )
    (wheels / "wheels.json").write_text('{"python": "2.7"}')
    assert "the wheels in" in ready.make_ready(wheels, "py", lacking) and "are for Python 2.7" in ready.make_ready(
        wheels, "py", lacking
    )
    assert ready.make_ready(wheels, "py", {"json": "json"}) is None  # nothing lacking: nothing read, nothing done
    assert ready.main(["--wheels", str(tmp_path / "nowhere")]) == 0  # this venv lacks nothing of TRAIN_MODULES


def test_make_wheels_refuses_bad_input_with_exit_2_in_one_line(tmp_path, capsys):
    """An unknown SDK, a lock without its header, an --out of someone else's files or one that cannot be written:
    exit 2 and one line (it was exit 1, as for a failed download, and tracebacks for the last two)."""
    from trnrecipes.ops import wheels

    lock = tmp_path / "lock.txt"
    lock.write_text("pyyaml==6.0.2\n")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro" / "file").write_text("")
    cases = ((["--sdk", "2.99"], "no wheel lock"), (["--lock", str(lock), "--out", str(tmp_path / "w")], "names no"),
             (["--lock", str(lock.with_name("none.txt")), "--out", str(theirs)], "no wheel lock"),
             (["--sdk", "2.26", "--out", str(theirs)], "holds files this command did not make"),
             (["--sdk", "2.26", "--out", str(tmp_path / "ro/file/w")], "cannot write beside it"))  # fmt: skip
    for argv, says in cases:
        assert wheels.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and says in err and err.count("\n") == 1, err
    assert (theirs / "notes.txt").read_text() == "mine"


def test_the_other_dlami_venv_of_a_release_is_told_no_wheelhouse_fits_it():
    """SDK 2.28's Ubuntu 22.04 venv is Python 3.10, its lock the 24.04 venv's 3.12: sbatch offered `make wheels
    sdk=2.28`, whose wheels every node then refused after the allocation (exit 2)."""
    from trnrecipes.config.recipe import load_recipe
    from trnrecipes.jobs.wheelhouse import wheels_problem

    twin = "/opt/aws_neuronx_venv_pytorch_2_8_nxd_training/bin/python"
    recipe = load_recipe("llama2-smoke-trn1", overrides=["cluster.neuron_sdk=2.28", f"cluster.python={twin}"])
    assert wheels_problem(recipe, REPO).startswith(
        f"cluster.python {twin} is the Deep Learning AMI Neuron (Ubuntu 22.04) venv of Neuron SDK 2.28 (Python 3.10);"
        " its wheel lock is for the default venv's Python 3.12: no wheelhouse can make its nodes ready"
    )
    default = load_recipe("llama2-smoke-trn1", overrides=["cluster.neuron_sdk=2.28"])
    assert "default venv" not in (wheels_problem(default, REPO) or "")  # the lock's own: make wheels sdk=2.28


def test_a_tracker_on_a_neuron_stack_is_warned_at_render_not_found_on_every_node():
    """Neither the DLAMI venv nor the wheelhouse has the tracking extra, and the login node's doctor cannot look in
    the nodes' venv: each node's pre-flight stopped the job after the allocation."""
    from trnrecipes.config.recipe import load_recipe
    from trnrecipes.jobs.render import render_warnings

    neuron = load_recipe("llama2-smoke-trn1", overrides=["monitor.trackers=[tensorboard,mlflow]"])
    (warning,) = [w for w in render_warnings(neuron) if w.startswith("monitor.trackers")]
    assert warning.startswith("monitor.trackers mlflow: the DLAMI venv has no mlflow-skinny, SQLAlchemy, alembic")
    cpu = load_recipe("llama2-tiny", overrides=["monitor.trackers=[mlflow]"])  # the checkout's .venv: make setup's
    assert not [w for w in render_warnings(cpu) if w.startswith("monitor.trackers")]


@pytest.mark.parametrize(
    ("hyperpod", "why", "namer", "bad", "code", "says"),
    [
        # every node failing its pre-flight: a shared cause, pointed at the pre-flight's lines, not health lines
        (0, "the pre-flight failed (above)", "the pre-flight", "node1\nnode2", 2,
         "the pre-flight fails on 2 of 2 nodes (node1,node2): a shared cause (software,"),
        # HyperPod's auto-resume covers the training step, not the health check: say so, and name the node
        (1, "health check failed", "the health check", "node2", 1,
         "HyperPod's auto-resume covers the training step only: resubmit with --exclude=node2"),
        (1, "training failed (exit status 1)", "the health check", "", 1, "auto-resume restarts the failed training"),
    ],
)  # fmt: skip
def test_the_scripts_word_after_a_failure_names_what_failed_and_what_restarts(
    tmp_path, hyperpod, why, namer, bad, code, says
):
    job = tmp_path / "job"
    done = run_cli("sbatch", "--recipe", "llama2-tiny", "--nodes", "2", "--out", str(job), "--no-data-check",
                   "--overrides", f"{SMALL} run_dir={tmp_path / 'run'}")  # fmt: skip
    assert done.returncode == 0, done.stderr
    script = (job / "run.sbatch").read_text()
    functions = [script[script.index(f"{name}() {{") : script.index("\n}\n", script.index(f"{name}() {{")) + 3]
                 for name in ("bad_nodes", "requeue_after_failure")]  # fmt: skip
    (tmp_path / "bad").write_text(bad + "\n" if bad else "")
    probe = (f"set -euo pipefail\nNNODES=2\nHYPERPOD={hyperpod}\nHYPERPOD_WHY=marker\nSTOP_REASON=\n"
             f"TRNRECIPES_BAD_NODES_FILE={tmp_path / 'bad'}\n{''.join(functions)}\n"
             'requeue_after_failure "$1" "$2"\n')  # fmt: skip
    run = subprocess.run(["bash", "-c", probe, "probe", why, namer], capture_output=True, text=True)
    assert run.returncode == code and says in run.stderr, run.stderr
    assert "See the [health] lines" not in run.stderr
