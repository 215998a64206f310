"""The health check on the xla backend, in .venv-xla (torch-xla on PJRT CPU, one process: torchrun's workers there
each see a world of one, so XLA's collectives run in a 1-process group, as tests/test_xla.py does)."""

from __future__ import annotations

import os
import subprocess

import pytest
from conftest import REPO

pytestmark = [pytest.mark.xla, pytest.mark.slow]

XLA_PYTHON = REPO / ".venv-xla/bin/python"
SCRIPT = """
import torch.distributed as dist, torch_xla.distributed.xla_backend
from trnrecipes.ops.health import Findings, _check_size, check_node
from trnrecipes.config.recipe import load_recipe
recipe = load_recipe("llama2-tiny", overrides=["cluster.backend=xla", "cluster.workers_per_node=1"])
print("exit", check_node(recipe, collectives=True))
dist.init_process_group("xla", init_method="xla://")
from trnrecipes.backends import make_backend
for fault in (0.0, 1000.0):
    findings = Findings(0, 1)
    rows = _check_size(make_backend("xla", 0), findings, 1, fault)
    print("fault", fault, [op for op, *_ in rows], findings.local)
"""


def test_the_matmul_runs_on_the_xla_device_and_the_collectives_check_lazy_tensors():
    assert XLA_PYTHON.exists(), f"{XLA_PYTHON} is missing: `make xla-venv` builds it (`make test` does)"
    env = {**os.environ, "PJRT_DEVICE": "CPU", "XLA_ALWAYS_ALLREDUCE": "1", "SLURMD_NODENAME": "nodeQ"}
    cmd = [str(XLA_PYTHON), "-c", SCRIPT]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[health] nodeQ rank 0/1: xla:0 matmul 512^3 ok (max rel err" in done.stdout
    assert "limit 1e-05 for fp32" in done.stdout and "exit 0" in done.stdout
    # in place in one buffer (views of a lazy tensor), checked: right data passes, wrong data is caught in each op
    ops = "['all_gather', 'all_reduce', 'reduce_scatter']"
    clean = "{'matmul': [0], 'device error': [0], 'all_gather': [0], 'all_gather received': [0], 'all_reduce': [0]"
    assert f"fault 0.0 {ops} {clean}, 'reduce_scatter': [0]}}" in done.stdout
    faulty = "'all_gather': [1], 'all_gather received': [1], 'all_reduce': [1], 'reduce_scatter': [1]}"
    assert f"fault 1000.0 {ops} {{'matmul': [0], 'device error': [0], {faulty}" in done.stdout
