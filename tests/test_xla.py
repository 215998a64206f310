"""The xla backend for real: torch-xla 2.9 on PJRT CPU, in .venv-xla (`make xla-venv`; torch-xla needs torch 2.9).

Same recipe on cpu and xla: the loss trajectories agree for 20 steps; after the warm-up steps (the first
validation and checkpoint passes included) XLA compiles nothing new, and a batch of another shape does compile.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from conftest import REPO

pytestmark = [pytest.mark.xla, pytest.mark.slow]

XLA_PYTHON = REPO / ".venv-xla/bin/python"
OVERRIDES = ["cluster.workers_per_node=1", "batch.seq_len=64", "batch.global_batch=4", "batch.micro_batch=2",
             "train.max_steps=20", "train.val_every=5", "checkpoint.every_steps=5", "train.log_every=5"]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    assert XLA_PYTHON.exists(), f"{XLA_PYTHON} is missing: `make xla-venv` builds it (`make test` does)"
    out = {}
    for backend in ("cpu", "xla"):
        tmp = tmp_path_factory.mktemp(backend)
        cmd = [str(XLA_PYTHON), str(REPO / "tests/xla_worker.py"), str(tmp / "r.json"), backend, str(tmp / "run")]
        env = {**os.environ, "PJRT_DEVICE": "CPU"}
        done = subprocess.run([*cmd, *OVERRIDES], cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        out[backend] = json.loads((tmp / "r.json").read_text())
        out[backend]["run_dir"] = str(tmp / "run")
    return out


def _continue(run_dir: str, backend: str, tmp_path) -> tuple[dict, str]:
    cmd = [str(XLA_PYTHON), str(REPO / "tests/xla_worker.py"), str(tmp_path / "c.json"), backend, run_dir]
    over = [o for o in OVERRIDES if not o.startswith("train.max_steps")] + ["train.max_steps=22"]
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    done = subprocess.run([*cmd, *over], cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((tmp_path / "c.json").read_text()), done.stdout


def test_cpu_and_xla_loss_trajectories_agree(runs):
    cpu, xla = runs["cpu"]["losses"], runs["xla"]["losses"]
    assert len(cpu) == len(xla) == 20
    assert xla == pytest.approx(cpu, rel=1e-4)
    assert runs["xla"]["val_losses"] == pytest.approx(runs["cpu"]["val_losses"], rel=1e-4)
    assert xla[-1] < xla[0] - 1.0  # and it learned something


def test_no_new_graphs_after_warmup_including_validation_and_checkpoints(runs):
    compiles = runs["xla"]["compilations"]
    # step 5 is the first validation and checkpoint pass; steps 6-20 (three more of each) must reuse graphs
    assert compiles[4] > 0 and compiles[4:] == [compiles[4]] * 16, compiles
    assert len(runs["xla"]["checkpoints"]) == 4 and runs["cpu"]["compilations"] == [None] * 20


def test_a_dynamic_shape_would_have_compiled_a_new_graph(runs):
    assert runs["xla"]["dynamic_shape_compiles"] >= 1


def test_neuron_backend_without_the_neuron_sdk_is_a_clear_error():
    code = "from trnrecipes.backends import make_backend; make_backend('neuron', 0)"
    done = subprocess.run([str(XLA_PYTHON), "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "cluster.backend neuron needs neuronx-distributed from the Neuron repository" in done.stderr
    assert "run the same recipe with cluster.backend=xla" in done.stderr


@pytest.mark.parametrize(("saved_on", "resumed_on"), [("xla", "cpu"), ("cpu", "xla")])
def test_a_checkpoint_saved_on_one_backend_resumes_on_the_other(runs, tmp_path, saved_on, resumed_on):
    report, out = _continue(runs[saved_on]["run_dir"], resumed_on, tmp_path)
    assert "(step 20)" in out and f"train: llama2-tiny on {resumed_on}" in out
    assert len(report["losses"]) == 2 and report["losses"][0] < runs[saved_on]["losses"][0] - 1.0


NEURON_METRICS = """
import torch, torch.distributed as dist, torch_xla, torch_xla.distributed.xla_backend
dist.init_process_group("xla", init_method="xla://")
from trnrecipes.parallel.dims import ParallelDims
d = ParallelDims.__new__(ParallelDims)
d.world, d.collectives_on_device = 2, True  # as on a Neuron rank: XLA's process group (NxD is not needed)
dev = torch_xla.device()
print(d.sum_over_ranks(torch.tensor([1.5, 2.0]), dev).tolist(), d.max_over_ranks([3, 1], dev))
try:
    dist.all_reduce(torch.tensor([1.0]))
except Exception as err:
    print("a CPU tensor is refused:", type(err).__name__)
"""


def test_metric_reductions_on_neuron_go_through_xlas_process_group_with_device_tensors():
    """On Neuron the default process group is XLA's, which reduces device tensors only: validation loss, the logged
    loss and rank agreement must move their CPU values to the device first (they crashed after step 1 before)."""
    env = {**os.environ, "PJRT_DEVICE": "CPU", "XLA_ALWAYS_ALLREDUCE": "1"}  # reduce even in a 1-process group
    done = subprocess.run([str(XLA_PYTHON), "-c", NEURON_METRICS], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-2:] == ["[1.5, 2.0] [3, 1]", "a CPU tensor is refused: RuntimeError"]


BERT = ["cluster.workers_per_node=1", "batch.global_batch=8", "batch.micro_batch=4", "train.max_steps=20",
        "train.val_every=5", "train.val_batches=2", "checkpoint.every_steps=5", "train.log_every=5"]  # fmt: skip


def test_classification_on_xla_compiles_nothing_after_warmup_and_continues_on_cpu_from_its_checkpoint(tmp_path):
    """bert-tiny (padded samples, masks, labels: static shapes) on xla, then incremental training from the
    xla-saved checkpoint on the cpu backend with another data file: it starts from those weights bitwise."""
    env = {**os.environ, "PJRT_DEVICE": "CPU", "XLA_WORKER_RECIPE": "bert-tiny"}
    reports = {}
    for name, backend, extra in (
        ("xla", "xla", []),
        ("cpu", "cpu", [f"train.init_from={tmp_path / 'xla/checkpoints/step_20'}", "data.path=data/cls/imdb.arrow",
                        "train.max_steps=5"]),
    ):  # fmt: skip
        cmd = [str(XLA_PYTHON), str(REPO / "tests/xla_worker.py"), str(tmp_path / f"{name}.json"), backend]
        cmd += [str(tmp_path / name), *BERT, *extra]
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        reports[name] = json.loads((tmp_path / f"{name}.json").read_text())
    compiles = reports["xla"]["compilations"]
    assert compiles[4] > 0 and compiles[4:] == [compiles[4]] * 16, compiles  # steps 6-20 reuse every graph
    assert reports["xla"]["dynamic_shape_compiles"] >= 1
    assert reports["cpu"]["init_equal"] is True and len(reports["cpu"]["losses"]) == 5
    phases = [json.loads(line)["phase"] for line in (tmp_path / "cpu/metrics.jsonl").read_text().splitlines()]
    assert phases == [1] * 20 + [2] * 5
