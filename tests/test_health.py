"""`trnrecipes health --collectives` under real torchrun with gloo: checked, timed, the same memory at 2 and 4 ranks,
and a lying rank or node named (in the bad-nodes file too). The pure rules: tests/test_health_rules.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import yaml

from trnrecipes.config.recipe import load_recipe

pytestmark = pytest.mark.slow

BUFFERS = re.compile(r"^\[health\] buffers: (\d+) bytes per rank", re.M)
# The health check of a backend whose process group reduces device tensors only (nccl, XLA): node names and the
# verdict then go over a gloo group of their own. Here the device is the CPU and that group is gloo as well.
DEVICE_ONLY_COLLECTIVES = """
import os, sys
from trnrecipes.backends.torch import TorchBackend
from trnrecipes.ops.health import check_node
from trnrecipes.config.recipe import load_recipe
TorchBackend.collectives_on_device = True
code = check_node(load_recipe("llama2-tiny"), collectives=True)
print(f"rank {os.environ['RANK']} exits {code}", flush=True)
sys.exit(code)
"""


def health(tmp_path, ranks: int = 2, device_only: bool = False, **env: str) -> subprocess.CompletedProcess[str]:
    config = "llama2-tiny"
    if ranks != 2:  # llama2-tiny runs 2 workers on its one node
        recipe = load_recipe(config, overrides=[f"cluster.workers_per_node={ranks}"])
        (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))
        config = str(tmp_path / "recipe.yaml")
    entry = ["-m", "trnrecipes", "health", "--config", config, "--collectives"]
    if device_only:
        (tmp_path / "device_only.py").write_text(DEVICE_ONLY_COLLECTIVES)
        # torchrun stops the other workers once one has failed: give them time to print their exit code
        entry = ["--monitor-interval=2", str(tmp_path / "device_only.py")]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", "--rdzv-backend=c10d",
           "--rdzv-endpoint=127.0.0.1:0", *entry]  # fmt: skip
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(("TRNRECIPES_HEALTH_", "SLURMD_"))}
    inherited.pop("TRNRECIPES_BAD_NODES_FILE", None)
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**inherited, **env})


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    """Two healthy ranks on node `nodeY`, with a fault injected on another node (nodeX) that must not matter."""
    tmp = tmp_path_factory.mktemp("healthy")
    bad = tmp / "bad-nodes"
    done = health(
        tmp, SLURMD_NODENAME="nodeY", TRNRECIPES_HEALTH_FAULT_NODE="nodeX", TRNRECIPES_BAD_NODES_FILE=str(bad)
    )
    return done, bad


def test_matmul_on_the_backends_device_and_collectives_checked_and_timed(healthy):
    done, bad = healthy
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    for rank in (0, 1):  # the recipe's backend is cpu: the device is the host
        assert re.search(rf"^\[health\] nodeY rank {rank}/2: cpu matmul 512\^3 ok \(max rel err \S+, limit 1e-05 for"
                         r" fp32, .*\); rendezvous host \S+$", done.stdout, re.M)  # fmt: skip
    for op in ("all_gather", "all_reduce", "reduce_scatter"):
        for mb in (1, 16):
            assert re.search(
                rf"\[health\] {op} +{mb} MiB x 2 ranks: +[0-9.]+ ms  algbw +[0-9.]+ GB/s  busbw", done.stdout
            )
    assert "collectives over 2 ranks: ok" in done.stdout
    assert "FAILED" not in done.stdout + done.stderr and not bad.exists()  # nodeX's fault is not this node's


def test_collective_memory_is_the_same_at_any_world_size(healthy, tmp_path):
    four = health(tmp_path, ranks=4)
    assert four.returncode == 0, four.stdout[-2000:] + four.stderr[-2000:]
    assert "collectives over 4 ranks: ok" in four.stdout
    at_2, at_4 = (int(BUFFERS.search(done.stdout).group(1)) for done in (healthy[0], four))
    assert at_2 == at_4 <= 16 << 20  # 16 MiB in all for the largest op, not 16 MiB per rank of the world


def test_a_rank_returning_wrong_data_is_named(tmp_path):
    done = health(tmp_path, device_only=True, SLURMD_NODENAME="nodeZ", TRNRECIPES_HEALTH_FAULT_RANK="1")
    assert done.returncode != 0
    blamed = r"^\[health\] FAILED on node nodeZ \(rank 1\): its all_gather data came back wrong on 2 of 2 ranks$"
    assert re.search(blamed, done.stderr, re.M)
    assert "(rank 0)" not in done.stderr  # the honest rank is not blamed, but it fails the launch too
    assert "collectives over 2 ranks: FAILED" in done.stdout
    assert "rank 0 exits 1" in done.stdout and "rank 1 exits 1" in done.stdout


def test_a_faulty_node_goes_to_the_bad_nodes_file(tmp_path):
    bad = tmp_path / "logs" / "bad-nodes"
    bad.parent.mkdir()
    bad.write_text("node7\n")  # from an earlier launch: appended to, not replaced
    done = health(
        tmp_path, SLURMD_NODENAME="nodeX", TRNRECIPES_HEALTH_FAULT_NODE="nodeX", TRNRECIPES_BAD_NODES_FILE=str(bad)
    )
    assert done.returncode != 0
    # Each rank's line whole, at a line start: ranks share the stream (health.say writes a line in one write).
    assert len(re.findall(r"^\[health\] nodeX rank [01]/2: cpu matmul 512\^3 FAILED", done.stderr, re.M)) == 2, (
        done.stderr
    )
    for rank in (0, 1):  # the collectives ran all the same, and both ranks' data came back wrong
        assert re.search(rf"^\[health\] FAILED on node nodeX \(rank {rank}\): matmul result wrong; its all_gather",
                         done.stderr, re.M), done.stderr  # fmt: skip
    assert "collectives over 2 ranks: FAILED" in done.stdout
    assert bad.read_text() == "node7\nnodeX\n"
