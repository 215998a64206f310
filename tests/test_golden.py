"""Generated scripts equal the checked-in golden files, and every one passes shellcheck and `bash -n`."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from golden import CASES, GOLDEN_DIR, case_dir, launch_lines, render_case


@pytest.mark.parametrize(("name", "nodes", "variant"), CASES, ids=[case_dir(*c) for c in CASES])
def test_rendered_job_equals_golden(name, nodes, variant):
    rendered = render_case(name, nodes, variant)
    for file_name, text in rendered.items():
        golden = GOLDEN_DIR / case_dir(name, nodes, variant) / file_name
        assert golden.exists(), f"missing {golden}; run `make golden`"
        assert text == golden.read_text(), f"{golden} differs from the rendered file; review, then `make golden`"


def test_every_golden_dir_is_a_case():
    assert {p.name for p in GOLDEN_DIR.iterdir()} == {case_dir(*c) for c in CASES}


def test_golden_scripts_pass_shellcheck_and_parse():
    shellcheck = shutil.which("shellcheck")
    assert shellcheck, "shellcheck is missing: `make setup` installs Debian's package"
    scripts = sorted(str(p) for p in GOLDEN_DIR.glob("*/*.sbatch"))
    # compile, run, eval; and infer for classification recipes
    assert len(scripts) == sum(len([f for f in render_case(*c) if f.endswith(".sbatch")]) for c in CASES)
    # shellcheck uses one core: a process per core over its share of the scripts (about 1 s a script)
    cores = len(os.sched_getaffinity(0))
    checks = [
        subprocess.Popen([shellcheck, "--severity=info", *scripts[i::cores]], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
        for i in range(min(cores, len(scripts)))
    ]  # fmt: skip
    for check in checks:
        out, _ = check.communicate(timeout=600)
        assert check.returncode == 0, out
    for script in scripts:
        parsed = subprocess.run(["bash", "-n", script], capture_output=True, text=True)
        assert parsed.returncode == 0, f"{script}: {parsed.stderr}"


def test_neuron_compile_wraps_the_very_same_launch():
    files = render_case("neox20b", 4)
    assert 'COMPILE=(neuron_parallel_compile "${TRAIN[@]}" --compile)' in files["compile.sbatch"]

    assert len(launch_lines(files["run.sbatch"])) == 3
    assert launch_lines(files["run.sbatch"]) == launch_lines(files["compile.sbatch"])


def test_run_script_has_the_slurm_contract():
    run = render_case("llama2-7b", 16)["run.sbatch"]
    for line in (
        "#SBATCH --nodes=16",
        "#SBATCH --exclusive",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        "#SBATCH --signal=B:USR1@248",  # 180 s + a 67.4 GB checkpoint (bf16 weights, fp32 moments) at 1 GB/s
        "trap 'request_stop timeout' USR1",
        'scontrol requeue "$JOB_ID"',
        'srun --nodes="$NNODES" --ntasks="$NNODES" --ntasks-per-node=1',
        "-m trnrecipes health --config",
        '-m trnrecipes train --config "$RECIPE"',
    ):
        assert line in run, line
    # sbatch stops reading #SBATCH lines at the first command.
    header = run.split("set -euo pipefail")[0]
    assert all(line.startswith("#") for line in header.splitlines() if line)
