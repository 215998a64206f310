"""`trnrecipes nccom`: Neuron's collective benchmark (nccom-test, from aws-neuronx-tools) across all nodes of the job,
run by run.sbatch after the health check on Neuron instances where the tool is installed.

It checks what the health check's collectives cannot see on their own: the EFA fabric at the sizes training uses,
with the runtime's own collectives. All-reduce and all-gather over every NeuronCore of the job, data checked, bus
bandwidth reported. The CLI by SDK as aws-neuron-sdk documents it (tools/neuron-sys-tools/nccom-test.rst):
`nccom-test <op> -r RANKS -N NODES -b MIN -e MAX -f STEP -n ITERS -w WARMUP -d TYPE`, then
- SDK 2.28 on: `--check all_ones`, and inside a Slurm job `--slurm-mode --slurm-job-id ID` (v2.28.0 "Slurm
  Execution");
- SDK 2.21 to 2.27: `-c` is a plain flag (fp32 data only) and there is no Slurm mode: several nodes run through
  `--hosts H1 H2 ...` with NEURON_RT_ROOT_COMM_ID=<this host's address>:<free port> (v2.21.0-v2.27.0, `-N`).
Its exit status on a failure is not documented, so the output is read too: "errors found" or "test failed" fail the
check even when it exits 0, and a run that printed no result at all (a usage error: these flags are from the docs,
not run on hardware here) is a loud warning, not a failure, so an unfamiliar tool version cannot requeue a job
until its restarts are spent.
No torch import.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

from trnrecipes.config.sections import RecipeError

OPERATIONS = ("all_reduce", "all_gather")
SIZES = ("-b", "8", "-e", "256MB", "-f", "4")  # 8 B .. 256 MB: latency-bound to bandwidth-bound
ITERS = ("-n", "5", "-w", "2")
AVG_BUS_BW = re.compile(r"Avg bus bandwidth:\s*([0-9.]+)\s*GB/s")
FAILED = re.compile(r"errors? found|test failed", re.I)
RESULT_ROW = re.compile(r"^\s*\d+\s+\d+\s+\w+\s+[0-9.]+\s+[0-9.]+\s+[0-9.]+", re.M)  # size count type time algbw busbw


SLURM_MODE_SDK = (2, 28)  # the first SDK whose nccom-test documents --check all_ones and --slurm-mode
ROOT_COMM_PORT = 44444  # the docs' example port for NEURON_RT_ROOT_COMM_ID, below Linux's ephemeral ports


def nccom_argv(
    op: str, ranks: int, nodes: int, job_id: str | None, sdk: tuple[int, int] = SLURM_MODE_SDK, hosts=()
) -> list[str]:
    """nccom-test's command line for Neuron SDK `sdk` (see the module docstring); `hosts`: the job's node addresses,
    for SDKs without a Slurm mode."""
    argv = ["nccom-test", op, "-r", str(ranks), "-N", str(nodes), *SIZES, *ITERS, "-d", "fp32"]
    if sdk >= SLURM_MODE_SDK:
        return argv + ["--check", "all_ones"] + (["--slurm-mode", "--slurm-job-id", job_id] if job_id else [])
    return argv + ["-c"] + (["--hosts", *hosts] if nodes > 1 else [])


def job_hosts() -> list[str]:
    """The addresses of this Slurm job's nodes, first node first (scontrol), or [] outside one."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST")
    if not nodelist or shutil.which("scontrol") is None:
        return []
    try:
        names = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=60
        ).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return []
    hosts = []
    for name in names:
        try:
            shown = subprocess.run(
                ["scontrol", "show", "node", name], capture_output=True, text=True, timeout=60
            ).stdout
        except (OSError, subprocess.TimeoutExpired):
            shown = ""
        found = re.search(r"NodeAddr=(\S+)", shown)
        hosts.append(found.group(1) if found else name)
    return hosts


def run_nccom(
    ranks: int, nodes: int, job_id: str | None = None, timeout_s: float = 600.0, sdk: tuple[int, int] = SLURM_MODE_SDK
) -> bool:
    """Run each operation; print its output and a summary line; True when all passed."""
    if ranks < 1 or nodes < 1 or ranks % nodes:
        raise RecipeError(f"nccom: --ranks {ranks} must be a positive multiple of --nodes {nodes}")
    if shutil.which("nccom-test") is None:
        raise RecipeError("nccom-test is not on PATH: it comes with the Neuron SDK's aws-neuronx-tools package")
    ok, env = True, None
    hosts = job_hosts() if sdk < SLURM_MODE_SDK and nodes > 1 else []
    if sdk < SLURM_MODE_SDK and nodes > 1 and len(hosts) != nodes:  # nothing to name the hosts with: not a failure
        print(f"[nccom] WARNING: found {len(hosts)} of the job's {nodes} node addresses (scontrol): check skipped")
        return True
    if hosts:  # the root of the collective is this host, the job's first node (run.sbatch runs it there)
        env = {**os.environ, "NEURON_RT_ROOT_COMM_ID": f"{hosts[0]}:{ROOT_COMM_PORT}"}
    for op in OPERATIONS:
        argv = nccom_argv(op, ranks, nodes, job_id, sdk, hosts)
        print(f"[nccom] {' '.join(argv)}", flush=True)
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=env)
        except subprocess.TimeoutExpired:
            print(f"[nccom] {op} over {ranks} ranks on {nodes} node(s): FAILED (no result in {timeout_s:.0f} s)")
            ok = False
            continue
        sys.stdout.write(done.stdout)
        sys.stderr.write(done.stderr)
        output = done.stdout + done.stderr
        bandwidth = AVG_BUS_BW.search(output)
        what = f"[nccom] {op} over {ranks} ranks on {nodes} node(s)"
        if FAILED.search(output) or (done.returncode != 0 and RESULT_ROW.search(output)):
            print(f"{what}: FAILED (exit {done.returncode}; see its output above)", flush=True)
            ok = False
        elif done.returncode != 0 or bandwidth is None:
            # Not a result at all: the tool could not run as called (another aws-neuronx-tools version, a usage
            # error). Not the fabric's fault, so not a reason to requeue: said loudly and skipped.
            print(f"{what}: WARNING, nccom-test gave no result (exit {done.returncode}): check skipped", flush=True)
        else:
            print(f"{what}: ok, avg bus bandwidth {bandwidth.group(1)} GB/s", flush=True)
    return ok


def main(ranks: int, nodes: int, sdk: tuple[int, int] = SLURM_MODE_SDK) -> int:
    return 0 if run_nccom(ranks, nodes, os.environ.get("SLURM_JOB_ID"), sdk=sdk) else 1
