"""What the scripts do to survive a real cluster, short of running them under Slurm (tests/test_slurm.py does that):
the pre-timeout window from the checkpoint size, AWS's flags and variables (each with its source in the script),
the per-user compile cache and its one-node-per-graph-set hand-off, the static rendezvous, local-rank-0 logs, the
failure record the scripts read, and the nccom-test step against a stand-in with the documented CLI and output."""

from __future__ import annotations

import errno
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, run_cli
from golden import render_case
from test_neuron_env import env_of

from trnrecipes.config.preemption import checkpoint_bytes, render_warnings, signal_seconds
from trnrecipes.config.recipe import load_recipe
from trnrecipes.config.sections import RecipeError
from trnrecipes.jobs.render import cache_leader_nodes, render_job
from trnrecipes.ops.nccom import nccom_argv, run_nccom
from trnrecipes.plan.layout import compute_layout

# ---- the pre-timeout window


def test_a_70b_checkpoint_gets_a_window_long_enough_to_write_it():
    r = load_recipe("llama2-70b", nodes=8)
    assert 680e9 < checkpoint_bytes(r) < 700e9  # 69B parameters x (2 bytes bf16 + 8 bytes of fp32 moments)
    assert signal_seconds(r) == 180 + 690  # finish the step, then 690 GB at 1 GB/s
    faster = load_recipe("llama2-70b", nodes=8, overrides="slurm.checkpoint_write_gbps=10")
    assert signal_seconds(faster) == 180 + 69
    assert signal_seconds(load_recipe("llama2-70b", nodes=8, overrides="slurm.signal_seconds=900")) == 900
    assert "#SBATCH --signal=B:USR1@870\n" in render_case("llama2-70b", 8)["run.sbatch"]


def test_fp32_weights_count_four_bytes_and_tiny_models_get_the_step_margin():
    bf16 = load_recipe("llama2-7b", nodes=1)
    fp32 = load_recipe("llama2-7b", nodes=1, overrides="precision.dtype=fp32 precision.stochastic_rounding=false")
    assert checkpoint_bytes(fp32) * 10 == checkpoint_bytes(bf16) * 12
    assert signal_seconds(load_recipe("llama2-tiny", nodes=1)) == 181  # 180 s + 7 MB


def test_the_time_limit_must_leave_room_for_the_derived_window():
    message = r"slurm.time_limit 00:15:00 leaves no time .* \(870 s before the end, derived"
    with pytest.raises(RecipeError, match=message):
        load_recipe("llama2-70b", nodes=8, overrides="slurm.time_limit=00:15:00")
    assert load_recipe("llama2-70b", nodes=8, overrides="slurm.time_limit=00:20:00").slurm.time_limit == "00:20:00"


def test_sbatch_warns_without_a_time_limit_or_with_a_too_short_window(tmp_path):
    runs = {"TRNRECIPES_RUNS": str(tmp_path / "runs")}
    done = run_cli("sbatch", "--recipe", "llama2-70b", "--nodes", "8", "--no-data-check", "--out", str(tmp_path / "a"),
                   "--overrides", "slurm.signal_seconds=300", env=runs)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "warning: slurm.time_limit is not set" in done.stderr
    assert "warning: slurm.signal_seconds 300 may not leave time to write a 690 GB checkpoint" in done.stderr
    assert (tmp_path / "a" / "run.sbatch").exists()  # a warning, not a refusal
    limited = load_recipe("llama2-70b", nodes=8, overrides="slurm.time_limit=2-00:00:00")
    assert render_warnings(limited) == []


# ---- AWS's compiler flags and variables


def flags(recipe: str, overrides: str = "") -> list[str]:
    return env_of(recipe, overrides)["NEURON_CC_FLAGS"].split()


@pytest.mark.parametrize(("dtype", "auto_cast_none"), [("fp32", True), ("bf16-mixed", True), ("bf16", False)])
@pytest.mark.parametrize("sdk", ["2.21", "2.26", "2.28"])
def test_auto_cast_none_unless_pure_bf16(dtype, auto_cast_none, sdk):
    """neuronx-cc casts fp32 matmuls to bf16 by default up to SDK 2.26: fp32 and bf16-mixed must say none."""
    sr = "true" if dtype == "bf16" else "false"
    got = flags("pythia6.9b", f"cluster.neuron_sdk={sdk} precision.dtype={dtype} precision.stochastic_rounding={sr}")
    assert ("--auto-cast none" in " ".join(got)) is auto_cast_none
    # TorchNeuron passes --auto-cast=none itself (its NEURON_CC_FLAGS are appended to that)
    native = env_of("llama2-7b-trn2", f"precision.dtype={dtype} precision.stochastic_rounding={sr}")
    assert "--auto-cast" not in native.get("NEURON_CC_FLAGS", "")


@pytest.mark.parametrize(
    ("sdk", "zero1", "expected"),
    [("2.21", False, True), ("2.21", True, True), ("2.22", False, False), ("2.22", True, False),
     ("2.28", False, False), ("2.28", True, False)],
)  # fmt: skip
def test_distribution_strategy_llm_training_only_before_sdk_2_22(sdk, zero1, expected):
    """neuronx-distributed dropped it from every Llama script, ZeRO-1 ones included, in SDK 2.22."""
    got = " ".join(flags("pythia6.9b", f"cluster.neuron_sdk={sdk} layout.zero1={str(zero1).lower()}"))
    assert ("--distribution-strategy llm-training" in got) is expected


@pytest.mark.parametrize("recipe", ["pythia6.9b", "llama2-7b-trn2"])
def test_exec_timeout_on_both_neuron_stacks(recipe):
    assert env_of(recipe)["NEURON_RT_EXEC_TIMEOUT"] == "100"


def test_xla_thread_pools_are_bounded_for_32_workers_per_node_only():
    assert env_of("pythia6.9b")["XLA_THREAD_POOL_SIZE"] == "4"
    assert "XLA_IO_THREAD_POOL_SIZE" not in env_of("pythia6.9b")  # torch-xla has not read it since 2023 (v2.2.0)
    few = env_of("pythia6.9b", "cluster.workers_per_node=8 layout.tp=8 batch.global_batch=8 batch.micro_batch=1")
    assert "XLA_THREAD_POOL_SIZE" not in few
    assert not [n for n in env_of("llama2-7b-trn2") if n.startswith("XLA_")]  # torch-xla's; TorchNeuron has none


@pytest.mark.parametrize(
    ("name", "source"),
    [("NEURON_CC_FLAGS", "neuronx-nemo-megatron"), ("NEURON_RT_EXEC_TIMEOUT", "neuronx-nemo-megatron"),
     ("XLA_THREAD_POOL_SIZE", "PROCESSES_PER_NODE=32")],
)  # fmt: skip
def test_each_aws_variable_names_its_source_in_the_script(name, source):
    script = render_case("pythia6.9b", 4)["run.sbatch"]
    line = next(x for x in script.splitlines() if x.startswith(f"export {name}="))
    assert "(AWS: " in line and source in line.split("(AWS: ")[1], line


def test_both_scripts_raise_the_open_files_soft_limit_on_every_node_and_never_lower_it():
    for script in ("compile.sbatch", "run.sbatch"):
        assert "        raise_open_files_limit\n" in render_case("neox20b", 4)[script]  # in each node's srun task
    text = render_case("neox20b", 4)["run.sbatch"]
    function = re.search(r"^raise_open_files_limit\(\) \{.*?^\}$", text, re.S | re.M).group(0)
    hard = int(subprocess.run(["bash", "-c", "ulimit -Hn"], capture_output=True, text=True).stdout)

    def limits_after(soft: int) -> list[int]:
        script = f'ulimit -Sn {soft}\n{function}\nraise_open_files_limit\necho "$(ulimit -Sn) $(ulimit -Hn)"'
        done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True)
        return [int(x) for x in done.stdout.split()]

    assert limits_after(1024) == [min(65535, hard), hard]  # raised, within the hard limit, which stays
    if hard > 65535:
        assert limits_after(hard) == [hard, hard]  # a higher soft limit is kept


# ---- the compile cache: per user and job, handed off by one node per distinct graph set


def test_the_node_local_cache_is_per_user_and_job_and_expands_in_bash(tmp_path):
    script = render_case("neox20b", 4)["run.sbatch"]
    line = next(x for x in script.splitlines() if x.startswith("export NEURON_COMPILE_CACHE_URL="))
    assert line.startswith('export NEURON_COMPILE_CACHE_URL="/var/tmp/neuron-compile-cache-${JOB_USER}/neox20b-4n"')
    user = subprocess.run(["id", "-un"], capture_output=True, text=True).stdout.strip()
    shown = subprocess.run(["bash", "-c", f'JOB_USER=$(id -un)\n{line}\necho "$NEURON_COMPILE_CACHE_URL"'],
                           capture_output=True, text=True)  # fmt: skip
    assert shown.stdout.strip() == f"/var/tmp/neuron-compile-cache-{user}/neox20b-4n"
    explicit = env_of("neox20b", "compile.cache_dir=/scratch/cache")["NEURON_COMPILE_CACHE_URL"]
    assert explicit == "/scratch/cache"


@pytest.mark.parametrize(
    ("recipe", "nodes", "leaders"),
    [("llama2-7b", 16, [0]),  # no pipeline: every node compiles the same graphs
     ("neox20b", 4, [0, 1, 2, 3]),  # PP 4 x DP 4 x TP 8: one stage per node
     ("neox20b", 16, [0, 4, 8, 12]),  # PP 4 x DP 16 x TP 8: four nodes per stage
     ("llama2-70b", 8, [0, 1, 2, 3, 4, 5, 6, 7])],
)  # fmt: skip
def test_one_node_per_distinct_graph_set_copies_the_cache(recipe, nodes, leaders):
    assert cache_leader_nodes(compute_layout(load_recipe(recipe, nodes=nodes))) == leaders
    files = render_case(recipe, nodes)
    assert f"CACHE_LEADERS={shlex.quote(' '.join(map(str, leaders)))}\n" in files["run.sbatch"]
    assert 'copy_dir_from_leaders "$NEURON_COMPILE_CACHE_URL" "$CACHE_COPY"' in files["compile.sbatch"]
    assert 'copy_dir_from_leaders "$NEURON_COMPILE_CACHE_URL" "$JOB_DIR/neuron-cache"' in files["run.sbatch"]
    assert 'merge_dir_on_each_node "$NEURON_COMPILE_CACHE_URL"' not in files["compile.sbatch"]


# ---- rendezvous and logs


def test_static_rendezvous_with_node_rank_from_slurm_and_local_rank_0_logs():
    run = render_case("llama2-tiny", 2)["run.sbatch"]
    assert '--rdzv-backend=static --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT"' in run
    assert 'export PET_NODE_RANK="$SLURM_NODEID"' in run and "--rdzv-backend=c10d" not in run
    assert "--tee=3 --local-ranks-filter=0" in run and '--log-dir="$LOG_DIR"' not in run.split("TORCHRUN_LOGS=(")[1]
    r = load_recipe("llama2-tiny", nodes=2, overrides="slurm.log_all_ranks=true")
    every = render_job(r, Path("/opt/x/jobs/j"), "cmd", Path("/opt/x")).files["run.sbatch"]
    assert 'TORCHRUN_LOGS=(--log-dir="$LOG_DIR" --tee=3)' in every and "--local-ranks-filter" not in every


# ---- the failure record run.sbatch reads


def test_bad_input_is_recorded_as_a_failure_a_requeue_would_repeat(tmp_path):
    fatal = tmp_path / "logs" / "fatal"
    env = {**os.environ, "TRNRECIPES_FATAL_FILE": str(fatal)}
    overrides = ["cluster.workers_per_node=1", f"run_dir={tmp_path}/run", f"data.path={tmp_path}/missing.arrow"]
    done = subprocess.run([sys.executable, "-m", "trnrecipes", "train", "--config", "llama2-tiny", *overrides],
                          cwd=REPO, capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert done.returncode == 2
    record = fatal.read_text()
    missing = re.escape(f"{tmp_path}/missing.arrow")
    assert re.fullmatch(rf"\S+ rank 0: error: Arrow file {missing} does not exist\n", record), record
    assert done.stderr.strip().splitlines()[-1] in record


# ---- nccom-test (a stand-in with the documented CLI and output: the real one needs Neuron devices)

STAND_IN = r"""#!/usr/bin/env python3
import json, os, sys
with open(os.environ["NCCOM_ARGS_LOG"], "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\n")
mode = os.environ.get("NCCOM_MODE", "ok")
if mode == "usage":  # a version of the tool that does not take these flags: no result at all
    print("usage: nccom-test [-h] ...", file=sys.stderr)
    sys.exit(2)
print("       size(B)    count(elems)    type    time(us)    algbw(GB/s)    busbw(GB/s)")
print("     268435456        67108864    fp32      4242.1          63.28         123.94")
if mode == "errors":
    print("1 errors found - test failed")
    sys.exit(0)  # the exit status on failure is not documented: the output must decide
if mode == "exit":
    sys.exit(3)
print("Avg bus bandwidth:      97.5120GB/s")
"""


@pytest.fixture
def nccom_stand_in(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "nccom-test"
    tool.write_text(STAND_IN.replace("#!/usr/bin/env python3", f"#!{sys.executable}"))
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("NCCOM_ARGS_LOG", str(tmp_path / "args.jsonl"))
    return tmp_path / "args.jsonl"


def test_nccom_runs_all_reduce_and_all_gather_across_the_job(nccom_stand_in, capsys):
    assert run_nccom(64, 2, job_id="123") is True
    calls = nccom_stand_in.read_text().splitlines()
    assert [c.split(",")[0] for c in calls] == ['["all_reduce"', '["all_gather"']
    assert nccom_argv("all_reduce", 64, 2, "123") == [
        "nccom-test", "all_reduce", "-r", "64", "-N", "2", "-b", "8", "-e", "256MB", "-f", "4", "-n", "5", "-w", "2",
        "-d", "fp32", "--check", "all_ones", "--slurm-mode", "--slurm-job-id", "123",
    ]  # fmt: skip
    # Before SDK 2.28 nccom-test documents no Slurm mode and `-c` takes no value: the hosts are named instead.
    assert nccom_argv("all_reduce", 64, 2, "123", (2, 26), ["10.0.0.1", "10.0.0.2"])[-4:] == [
        "-c",
        "--hosts",
        "10.0.0.1",
        "10.0.0.2",
    ]
    assert nccom_argv("all_gather", 32, 1, None, (2, 21))[-2:] == ["fp32", "-c"]
    out = capsys.readouterr().out
    assert "[nccom] all_reduce over 64 ranks on 2 node(s): ok, avg bus bandwidth 97.5120 GB/s" in out


@pytest.mark.parametrize("mode", ["errors", "exit"])
def test_nccom_failures_are_caught_from_the_output_or_the_exit_status(nccom_stand_in, monkeypatch, capsys, mode):
    monkeypatch.setenv("NCCOM_MODE", mode)
    assert run_nccom(64, 2) is False
    assert "[nccom] all_gather over 64 ranks on 2 node(s): FAILED" in capsys.readouterr().out


def test_an_nccom_test_that_gives_no_result_is_a_warning_not_a_failure(nccom_stand_in, monkeypatch, capsys):
    """Flags from the docs that an installed version rejects must not requeue a job until its restarts are spent."""
    monkeypatch.setenv("NCCOM_MODE", "usage")
    assert run_nccom(64, 2) is True
    assert "[nccom] all_reduce over 64 ranks on 2 node(s): WARNING, nccom-test gave no result (exit 2)" in (
        capsys.readouterr().out
    )


def test_nccom_refuses_a_missing_tool_and_bad_counts(monkeypatch):
    with pytest.raises(RecipeError, match="--ranks 63 must be a positive multiple of --nodes 2"):
        run_nccom(63, 2)
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(RecipeError, match=r"nccom-test is not on PATH: .*aws-neuronx-tools"):
        run_nccom(64, 2)


@pytest.mark.parametrize(("recipe", "nodes", "present"), [("neox20b", 4, True), ("llama2-7b-trn2", 16, True),
                                                          ("llama2-tiny", 2, False)])  # fmt: skip
def test_the_run_script_calls_nccom_on_neuron_only_and_only_where_installed(recipe, nodes, present):
    run = render_case(recipe, nodes)["run.sbatch"]
    assert ("if command -v nccom-test >/dev/null; then" in run) is present
    assert ('-m trnrecipes nccom --ranks $((NNODES * WORKERS_PER_NODE)) --nodes "$NNODES"' in run) is present


# ---- which errors a requeue may pass


def test_errors_a_requeue_may_pass_are_told_from_bad_input():
    from trnrecipes.checkpoint.format import CheckpointReadError
    from trnrecipes.cli import requeue_may_pass
    from trnrecipes.config.sections import NodeError
    from trnrecipes.data import DataError

    def wrapped(errno_: int) -> DataError:
        try:
            try:
                raise OSError(errno_, "simulated")
            except OSError as err:
                raise DataError("data/x.arrow: not a readable Arrow IPC stream or file") from err
        except DataError as err:
            return err

    assert requeue_may_pass(wrapped(errno.EIO)) and requeue_may_pass(wrapped(errno.ESTALE))
    assert not requeue_may_pass(wrapped(errno.ENOENT))
    assert not requeue_may_pass(DataError("Arrow file x does not exist"))
    assert requeue_may_pass(CheckpointReadError("EIO while reading step_10"))
    assert requeue_may_pass(NodeError("no CUDA device"))


def test_a_node_without_its_device_names_itself_and_is_not_recorded_as_bad_input(tmp_path):
    """cluster.backend cuda on this CPU-only machine: the health check stops with a NodeError, names this node for
    run.sbatch to exclude, and records nothing in the fatal file (a requeue onto other nodes may pass)."""
    cuda = "cluster.instance=p5.48xlarge cluster.backend=cuda cluster.workers_per_node=2"
    shown = run_cli("show", "--recipe", "llama2-tiny", "--nodes", "1", "--overrides", cuda)
    assert shown.returncode == 0, shown.stderr
    (tmp_path / "recipe.yaml").write_text(shown.stdout)
    env = {**os.environ, "SLURMD_NODENAME": "node7", "TRNRECIPES_BAD_NODES_FILE": str(tmp_path / "bad-nodes"),
           "TRNRECIPES_FATAL_FILE": str(tmp_path / "fatal")}  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "trnrecipes", "health", "--config", str(tmp_path / "recipe.yaml")],
                          cwd=REPO, capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert done.returncode == 1 and "has no CUDA device" in done.stderr
    assert (tmp_path / "bad-nodes").read_text() == "node7\n"
    assert not (tmp_path / "fatal").exists()


def test_nccom_before_sdk_2_28_names_the_hosts_or_says_it_skipped(nccom_stand_in, monkeypatch, capsys):
    """No Slurm mode before SDK 2.28: the hosts come from scontrol; without them the check is skipped, in a line."""
    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
    assert run_nccom(64, 2, sdk=(2, 26)) is True
    assert "[nccom] WARNING: found 0 of the job's 2 node addresses (scontrol): check skipped" in capsys.readouterr().out
    assert not nccom_stand_in.exists()  # not run with a bare --hosts
    assert run_nccom(32, 1, sdk=(2, 26)) is True  # one node: no hosts needed
    assert json.loads(nccom_stand_in.read_text().splitlines()[0])[-2:] == ["fp32", "-c"]
    bad = run_cli("nccom", "--ranks", "64", "--nodes", "2", "--sdk", "2")
    assert bad.returncode == 2 and bad.stderr == "error: nccom --sdk '2': expected a Neuron SDK version such as 2.26\n"
