"""Pre-flight (trnrecipes/ops/doctor.py) through the real generated scripts: each failure kind is one line and exit
2 before anything is compiled or written to the run dir; the all-good stand-in Neuron venv passes and the script goes
on. The Neuron SDK is a stand-in (tests/neuron_standin.py): packages with AWS's versions, neuron-ls, and
neuron_parallel_compile."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, run_cli
from neuron_standin import env_with, megatron_corpus, neuron_ls, standin_venv

from trnrecipes.config.recipe import load_recipe
from trnrecipes.ops import doctor

SDK = "2.26"  # pythia-70m's


@pytest.fixture
def job(tmp_path: Path) -> Path:
    """pythia-70m on one trn1 node (Neuron SDK 2.26), its data a stand-in Megatron pair, its run dir under tmp."""
    prefix = megatron_corpus(tmp_path / "data/wiki")
    out = tmp_path / "job"
    overrides = f"data.path={prefix} run_dir={tmp_path / 'runs/p'}"
    done = run_cli("sbatch", "--recipe", "pythia-70m", "--nodes", "1", "--out", str(out), "--overrides", overrides)
    assert done.returncode == 0, done.stderr
    return out


def run_script(job: Path, name: str, python: Path | str, bin_dir: Path) -> subprocess.CompletedProcess[str]:
    env = env_with(bin_dir, TRNRECIPES_PYTHON=str(python))
    return subprocess.run(["bash", str(job / name)], capture_output=True, text=True, env=env, timeout=300)


def errors(done: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("error:")]


def test_the_all_good_stand_in_passes_and_the_compile_job_goes_on(job, tmp_path):
    python = standin_venv(tmp_path / "venv", SDK)
    neuron_ls(tmp_path / "bin", devices=16, cores_per_device=2)
    done = run_script(job, "compile.sbatch", python, tmp_path / "bin")
    out = done.stdout
    assert "compile ok: python " in out and "torch-neuronx 2.8.0.2.10.0" in out and "32 NeuronCores" in out, out
    assert "neuron_parallel_compile (stand-in): " in out  # it went on to compile
    assert not errors(done)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("no python", "the job's Python {python} does not exist here; set cluster.python (or TRNRECIPES_PYTHON)"),
        (
            "old sdk",
            "torch-neuronx 2.8.0.2.11.0 in {python}, but cluster.neuron_sdk 2.26 ships 2.8.0.2.10.*; that is Neuron SDK"
            " 2.27's: set cluster.neuron_sdk 2.27",
        ),
        ("no nxd", "neuronx-distributed is not installed in {python}: not Neuron SDK 2.26's environment"),
        ("no compiler", "neuron_parallel_compile is neither beside {python} nor on PATH"),
        ("few cores", "16 NeuronCores ({ls} -j), the recipe runs 32 workers per node, one per core"),
        ("no devices", "no Neuron devices (no neuron-ls, no /dev/neuron*): not a Trainium node?"),
        ("no data", "data.path {data}: {data}.bin and {data}.idx missing; make it with `trnrecipes data preprocess"),
        (
            "no pyyaml",
            "{python} lacks megatron-core, numpy, pyarrow, pyyaml, safetensors, tensorboard, tiktoken,"
            " tokenizers, tqdm; no wheelhouse at",
        ),
        ("run dir", "run dir {run}: {blocker} is a file, not a directory; set run_dir"),
    ],
)
def test_each_failure_is_one_line_exit_2_and_nothing_in_the_run_dir(job, tmp_path, case, message):
    """Exit 2 (bad input, never requeued), or 1 for a fault of the node itself."""
    bin_dir, versions, devices = tmp_path / "bin", {}, 16
    if case == "old sdk":
        versions["torch-neuronx"] = "2.8.0.2.11.0"  # SDK 2.27's build for the same torch 2.8
    if case == "no nxd":
        versions["neuronx-distributed"] = None
    python = standin_venv(tmp_path / "venv", SDK, versions, compile_tool=case != "no compiler")
    ls = neuron_ls(bin_dir, devices=8 if case == "few cores" else devices, cores_per_device=2)
    if case == "no devices":
        ls.unlink()
    if case == "no python":
        python = tmp_path / "nowhere/bin/python"
    if case == "no data":
        Path(f"{tmp_path / 'data/wiki'}.idx").unlink()
        Path(f"{tmp_path / 'data/wiki'}.bin").unlink()
    if case == "no pyyaml":  # this interpreter without its site-packages: trnrecipes' own needs are missing
        python.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    if case == "run dir":  # where the run dir's parent should be, a file: nothing can be made there
        (tmp_path / "runs").write_text("a file, not a directory\n")
    done = run_script(job, "compile.sbatch", python, bin_dir)
    node_fault = case in ("few cores", "no devices")  # this node's, not the input's: 1 (run.sbatch requeues)
    assert done.returncode == (1 if node_fault else 2), done.stdout + done.stderr
    (line,) = errors(done)
    expected = message.format(
        python=python, ls=ls, data=tmp_path / "data/wiki", run=tmp_path / "runs/p", blocker=tmp_path / "runs"
    )
    assert expected in line, line
    assert "neuron_parallel_compile (stand-in)" not in done.stdout
    assert not (tmp_path / "runs/p").exists()  # nothing written to the run dir, not even the dir


def test_the_run_script_checks_first_too_and_requeues_a_node_fault(job, tmp_path):
    python = standin_venv(tmp_path / "venv", SDK, {"torch-xla": "2.7.0"})
    neuron_ls(tmp_path / "bin", devices=16, cores_per_device=2)
    run = run_script(job, "run.sbatch", python, tmp_path / "bin")
    (line,) = errors(run)
    assert (
        run.returncode == 2
        and "torch-xla 2.7.0 in " in line
        and "ships 2.8.*; that is Neuron SDK 2.24 or 2.25's" in line
    )
    python.parent.parent.rename(tmp_path / "old-venv")
    python = standin_venv(tmp_path / "venv", SDK)
    neuron_ls(tmp_path / "bin", devices=4, cores_per_device=2)  # a node short of cores
    run = run_script(job, "run.sbatch", python, tmp_path / "bin")
    assert run.returncode == 1 and "8 NeuronCores" in errors(run)[0]
    assert "the pre-flight failed (above) (the pre-flight names " in run.stdout + run.stderr
    assert "(not under Slurm: nothing to requeue)" in run.stdout + run.stderr  # under Slurm: requeued without it


def test_doctor_on_a_login_node_checks_the_jobs_interpreter(job, tmp_path):
    """Without the DLAMI venv (a login node), the files are checked from this Python and one line says what only
    the nodes check and which AMI they need."""
    missing = run_cli("doctor", "--config", str(job / "recipe.yaml"))
    assert missing.returncode == 0 and missing.stdout.count("\n") == 2, missing.stdout + missing.stderr
    note, ok = missing.stdout.splitlines()
    assert note.endswith(
        "the job's Python /opt/aws_neuronx_venv_pytorch_2_8_nxd_training/bin/python is not on this host (it is the"
        " venv of the Deep Learning AMI Neuron (Ubuntu 22.04) with Neuron SDK 2.26, the AMI the job's trn1.32xlarge"
        " nodes need (trn1 trains on SDK 2.21-2.28, trn2/trn3 on 2.33); set cluster.python (or TRNRECIPES_PYTHON) if"
        " its interpreter is elsewhere); its packages, neuron_parallel_compile and the NeuronCores are checked on"
        " every node when the job starts"
    ) and note.startswith("note: ")
    assert ok.endswith("run ok: data, tokenizer, run dir and checkpoint space; devices not checked off the nodes"
                       " (each job checks its own)")  # fmt: skip
    python = standin_venv(tmp_path / "venv", SDK)
    done = run_cli("doctor", "--config", str(job / "recipe.yaml"), env={"TRNRECIPES_PYTHON": str(python)})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "run ok: python " in done.stdout and "devices not checked off the nodes" in done.stdout
    (tmp_path / "data/wiki.idx").unlink()  # what a login node without the DLAMI still checks
    gone = run_cli("doctor", "--config", str(job / "recipe.yaml"))
    assert gone.returncode == 2 and "wiki.idx missing" in gone.stdout


def test_a_full_compile_cache_disk_is_refused_by_the_models_size(monkeypatch, tmp_path):
    """7B's NEFFs need room; pythia-70m's few hundred MB do not: a node with 3 GiB free compiles it (the CI
    machine itself had 8.8 GiB free, and a 10 GiB rule for every model refused it)."""
    monkeypatch.setenv("NEURON_COMPILE_CACHE_URL", str(tmp_path / "cache"))
    real = doctor.shutil.disk_usage
    free = {"bytes": 3 * 2**30}
    monkeypatch.setattr(doctor.shutil, "disk_usage", lambda p: real(p)._replace(free=free["bytes"]))
    monkeypatch.setattr(doctor, "stack_problems", lambda r, p: ([], []))
    monkeypatch.setattr(doctor, "neuron_cores", lambda: (32, "stand-in", None))

    def cache_problems(name: str) -> list[str]:
        problems, _ = doctor.check(load_recipe(name, nodes=1), "compile", tmp_path / "run", node=True)
        return [p.removeprefix(doctor.NODE_FAULT) for p in problems if "compile cache" in p]

    assert cache_problems("pythia-70m") == []
    big = f"compile cache {tmp_path / 'cache'}: 3.0 GiB free at {tmp_path}, under 10 GiB: free space there"
    assert cache_problems("pythia6.9b") == [big]
    free["bytes"] = 2**30
    small = f"compile cache {tmp_path / 'cache'}: 1.0 GiB free at {tmp_path}, under 2 GiB: free space there"
    assert cache_problems("pythia-70m") == [small]


def test_cpu_jobs_need_no_neuron_packages(tmp_path):
    recipe = load_recipe("llama2-tiny", nodes=1)
    problems, notes = doctor.check(recipe, "run", tmp_path / "run", node=True)
    assert problems == [] and notes == [f"python {sys.executable}"]
    assert REPO.is_dir()


def test_a_missing_default_venv_names_the_releases_other_dlami_when_this_host_has_it(monkeypatch):
    """SDK 2.27/2.28 ship PyTorch 2.9 on Ubuntu 24.04 (the default) and 2.8 on 22.04: on a 22.04 host, say so."""
    recipe = load_recipe("pythia6.9b", overrides="cluster.neuron_sdk=2.28")
    other = "/opt/aws_neuronx_venv_pytorch_2_8_nxd_training/bin/python"
    real = doctor.os.access
    monkeypatch.setattr(doctor.os, "access", lambda p, mode: p == other or real(p, mode))
    assert doctor._fix_python(recipe) == f"this host has SDK 2.28's other DLAMI venv: set cluster.python={other}"


def test_a_tracker_whose_packages_are_missing_is_a_problem_naming_the_tracking_extra(monkeypatch, tmp_path):
    """The run would stop at its start on the missing package: the pre-flight names it first, with the install."""
    recipe = load_recipe("llama2-tiny", nodes=1, overrides="monitor.trackers=[tensorboard,mlflow]")
    real = doctor._installed
    monkeypatch.setattr(doctor, "_installed", lambda module: module != "sqlalchemy" and real(module))
    problems, _ = doctor.check(recipe, "run", tmp_path / "run", node=False)
    assert len(problems) == 1 and problems[0].startswith(f"SQLAlchemy not installed in {sys.executable}"), problems
    assert problems[0].endswith("'[tracking]'")
    assert doctor.check(load_recipe("llama2-tiny", nodes=1), "run", tmp_path / "run", node=False)[0] == []


def test_a_batch_the_nodes_cannot_split_is_the_recipes_error_not_the_checks_crash(job, capsys):
    recipe = job / "recipe.yaml"
    text = recipe.read_text()
    assert "  global_batch: 1024\n" in text
    recipe.write_text(text.replace("  global_batch: 1024\n", "  global_batch: 1023\n"))  # a user's edit
    assert doctor.main(["--config", str(recipe), "--node"]) == 2
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("error: ") and ": batch.global_batch 1023 is not divisible by micro_batch" in line, line
    assert "could not finish" not in line


def test_a_full_compile_cache_is_the_nodes_fault_only_on_its_own_disk(tmp_path):
    """trn2's cache is JOB_DIR/neff-cache on FSx: full there, every node fails alike, and excluding nodes at each
    requeue (exit 1) would not help."""
    import shutil

    cache = tmp_path / "job/neff-cache"
    need = shutil.disk_usage(tmp_path).free + 2**30  # more than there is
    lustre = f"36 1 0:51 / {tmp_path} rw,relatime shared:1 - lustre 10.0.0.1@tcp:/fsx rw\n"
    on_fsx = doctor.cache_space_problem(str(cache), lustre, need)
    own_disk = doctor.cache_space_problem(str(cache), lustre.replace(" lustre ", " ext4 "), need)
    assert on_fsx.startswith("compile cache ") and "(shared storage, lustre: every node)" in on_fsx
    assert own_disk.startswith(doctor.NODE_FAULT + "compile cache ")
    assert doctor.cache_space_problem(str(cache), lustre, need=1) is None


def test_doctor_checks_the_files_the_job_reads_not_its_own_checkouts(job, monkeypatch, capsys, tmp_path):
    """Another checkout's job dir: its data paths are relative to that checkout (a false 'missing', or a false 'ok');
    a recipe outside a job dir: its run dir under TRNRECIPES_RUNS, as sbatch puts it; the eval job: data/eval."""
    script = job / "run.sbatch"
    script.write_text(script.read_text().replace(f"REPO={REPO}\n", "REPO=/fsx/alice/trnrecipes\n"))
    assert doctor.main(["--config", str(job / "recipe.yaml")]) == 2
    (line,) = capsys.readouterr().out.splitlines()
    assert (
        f"was rendered from the checkout /fsx/alice/trnrecipes, whose files its jobs read; this doctor is {REPO}'s"
        in line
    )
    assert "run /fsx/alice/trnrecipes/.venv/bin/trnrecipes doctor --config " in line, line
    (tmp_path / "runs").write_text("a file, not a directory")
    monkeypatch.setenv("TRNRECIPES_RUNS", str(tmp_path / "runs"))
    assert doctor.main(["--config", str(REPO / "recipes/llama2/llama2-tiny.yaml")]) == 2
    assert f"run dir {tmp_path / 'runs'}/" in capsys.readouterr().out  # before: the checkout's runs/, "run ok"
    from trnrecipes.jobs.data_check import eval_data_problem

    monkeypatch.setattr(doctor, "REPO_ROOT", tmp_path)
    for make in (False, True):  # missing, then empty
        if make:
            (tmp_path / "data/eval").mkdir(parents=True)
        problem = eval_data_problem(tmp_path)
        assert problem.startswith(f"{tmp_path / 'data/eval'} (the evaluation's offline data) is missing: eval.sbatch")
        notes = doctor.check(load_recipe("llama2-tiny"), "eval", tmp_path / "run", node=False)[1]
        assert f"{doctor.NOTE}{problem} (unless the job is given --data-dir)" in notes  # eval.sbatch --data-dir DIR


def test_the_note_names_the_dlami_of_the_venv_the_job_runs_or_calls_it_the_recipes_own():
    """SDK 2.28's Ubuntu 22.04 venv was said to be the 24.04 DLAMI's; a mistyped cluster.python was said to be
    the DLAMI's venv (exit 0, and the nodes' pre-flight failed after the allocation)."""
    twin = "/opt/aws_neuronx_venv_pytorch_2_8_nxd_training/bin/python"
    recipe = load_recipe("pythia6.9b", overrides=f"cluster.neuron_sdk=2.28 cluster.python={twin}")
    assert doctor._fix_python(recipe, twin).startswith("it is the venv of the Deep Learning AMI Neuron (Ubuntu 22.04)")
    default = "/opt/aws_neuronx_venv_pytorch_2_9_nxd_training/bin/python"
    assert doctor._fix_python(recipe, default).startswith(
        "it is the venv of the Deep Learning AMI Neuron (Ubuntu 24.04)"
    )
    typo = "/fsx/venv-tpyo/bin/python"
    assert doctor._fix_python(recipe, typo).startswith("it is no DLAMI venv of Neuron SDK 2.28 but cluster.python's")


def test_a_login_doctor_whose_job_python_lacks_pyyaml_counts_on_the_wheelhouse(job, tmp_path, monkeypatch, capfd):
    """The job's Python cannot run a doctor without PyYAML, which each node installs from a current wheelhouse
    before its own pre-flight: that is a note, not an error (the files are still checked from this Python)."""
    python = standin_venv(tmp_path / "venv", SDK)
    python.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')  # this interpreter without site-packages
    monkeypatch.setenv("TRNRECIPES_PYTHON", str(python))
    config = ["--config", str(job / "recipe.yaml")]
    assert doctor.main(config) == 2  # no wheelhouse: its doctor stops on it
    assert f"pyyaml not installed in {python}" in capfd.readouterr().out
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "tokenizers-0.21.0-cp39-abi3-manylinux_2_17_x86_64.whl").write_bytes(b"")
    monkeypatch.setattr(doctor, "_wheelhouse", lambda recipe: str(wheels))
    assert doctor.main(config) == 2  # a wheelhouse without it: the same
    capfd.readouterr()
    (wheels / "PyYAML-6.0.2-cp311-cp311-manylinux_2_17_x86_64.whl").write_bytes(b"")
    assert doctor.main(config) == 0
    note, ok = capfd.readouterr().out.splitlines()
    assert note.endswith(f"pyyaml is not installed in {python}: each node installs it from {wheels} when the job"
                         " starts, then checks the job's packages") and note.startswith("note: ")  # fmt: skip
    assert "run ok: data, tokenizer, run dir and checkpoint space" in ok
    (tmp_path / "data/wiki.idx").unlink()  # the files are still checked
    assert doctor.main(config) == 2 and "wiki.idx missing" in capfd.readouterr().out
