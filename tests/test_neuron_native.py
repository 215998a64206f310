"""The TorchNeuron backend (trnrecipes/backends/neuron_native.py) runs for real here: its code is the torch
backend's, so with its device type, process-group backend string and mesh device type set to the CPU's it trains
exactly as backend cpu does (gloo, TP 2 + sequence parallel, bf16 with software stochastic rounding). The stand-ins
prove the rest: the process group comes before any tensor, creating the backend touches no device API (a `neuron`
PrivateUse1 device registered as torch_neuronx does), train.compile compiles each block with the backend's
torch.compile backend and never recompiles after warm-up, and a missing or placeholder torch_neuronx is a clear
error naming where the real one comes from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch._dynamo
from conftest import REPO, rank_launcher
from torch._dynamo.testing import CompileCounterWithBackend
from train_worker import fixed_steps

from trnrecipes.backends import make_backend
from trnrecipes.backends.neuron_native import NeuronNativeBackend
from trnrecipes.config.recipe import load_recipe
from trnrecipes.config.sections import RecipeError
from trnrecipes.parallel.compile import is_compiled
from trnrecipes.plan.layout import compute_layout
from trnrecipes.train.loop import Trainer

NATIVE = ["cluster.instance=trn2.48xlarge", "cluster.backend=neuron", "cluster.neuron_sdk=2.33"]
SMALL = ["batch.seq_len=32", "batch.global_batch=8", "batch.micro_batch=2"]


def run_worker(tmp_path: Path, script: str, overrides: list[str], tag: str) -> dict:
    out = tmp_path / f"{tag}.pt"
    cmd = [*rank_launcher(2), str(REPO / "tests" / script), str(out), "llama2-tiny",
           "cluster.workers_per_node=2", *SMALL, *overrides]  # fmt: skip
    env = {**os.environ, "TRAIN_WORKER_STEPS": "3", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return torch.load(out, weights_only=True)


@pytest.mark.slow
def test_native_backend_code_trains_as_backend_cpu_with_the_process_group_before_any_tensor(tmp_path: Path):
    layout = [
        "layout.tp=2",
        "layout.sequence_parallel=true",
        "precision.dtype=bf16",
        "precision.stochastic_rounding=true",
    ]
    want = run_worker(tmp_path, "train_worker.py", layout, "cpu")
    got = run_worker(tmp_path, "native_worker.py", [*NATIVE, *layout], "native")
    assert got["norms"] == want["norms"]
    for name, p in want["params"].items():
        assert torch.equal(got["params"][name], p), name
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"native.pt.native{rank}.json").read_text())
        assert seen["ops_before_process_group"] == [], seen["ops_before_process_group"][:10]
        assert seen["process_group_backend"] == "cpu:gloo"  # the class attribute, passed on unchanged
        assert seen["mesh_device_type"] == "cpu"
        # neuron:0 selected once the group exists and before DeviceMesh, which would select LOCAL_RANK (rank 1: a
        # core that worker cannot see).
        assert seen["order"] == ["init_process_group", "set_device(0)", "init_device_mesh"]


def test_creating_the_backend_touches_no_device_api_of_a_registered_neuron_device():
    # As torch_neuronx registers it: PrivateUse1 renamed "neuron" with a device module. Process-global: a subprocess.
    code = """
import sys, types, torch
calls = []
module = types.ModuleType("neuron_device_stand_in")
for name in ("is_available", "is_initialized", "device_count", "current_device", "set_device", "synchronize"):
    setattr(module, name, lambda *a, _name=name, **k: calls.append(_name) or 1)
module.get_amp_supported_dtype = lambda: [torch.float16, torch.bfloat16, torch.float32]
torch.utils.rename_privateuse1_backend("neuron")
torch._register_device_module("neuron", module)
sys.modules["torch_neuronx"] = types.ModuleType("torch_neuronx")
from trnrecipes.backends import make_backend
backend = make_backend("neuron-native", 5)
assert calls == [], calls  # before the process group: no device call, not even set_device
assert backend.device == torch.device("neuron", 0), backend.device  # each worker sees only its own core
assert (backend.dist_backend, backend.mesh_device_type) == ("cpu:gloo,neuron:neuron", "neuron")
assert (backend.compile_backend, backend.compiles_by_default, backend.rounds_stochastically) == ("neuron", False, False)
with torch.autocast(backend.device.type, dtype=torch.bfloat16):  # the trainer's bf16-mixed autocast
    pass
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr


@pytest.fixture
def native_on_cpu(monkeypatch):
    """NeuronNativeBackend with the CPU's device and mesh type and a stand-in torch_neuronx, in this process."""
    monkeypatch.setitem(sys.modules, "torch_neuronx", types.ModuleType("torch_neuronx"))
    monkeypatch.setattr(NeuronNativeBackend, "device_type", "cpu")
    monkeypatch.setattr(NeuronNativeBackend, "mesh_device_type", "cpu")
    return monkeypatch


@pytest.mark.slow
def test_train_compile_compiles_blocks_and_optimizer_with_the_backend_no_recompile(tmp_path: Path, native_on_cpu):
    counter = CompileCounterWithBackend("aot_eager")  # stands in for backend="neuron"
    native_on_cpu.setattr(NeuronNativeBackend, "compile_backend", counter)
    torch._dynamo.reset()
    over = [*NATIVE, *SMALL, "cluster.workers_per_node=1", "train.compile=true", f"run_dir={tmp_path}"]
    trainer = Trainer(load_recipe("llama2-tiny", overrides=over))
    try:
        assert isinstance(trainer.backend, NeuronNativeBackend)
        assert all(is_compiled(block) for block in trainer.model.layers)
        steps, accum = fixed_steps(trainer, 3), compute_layout(trainer.recipe).grad_accum

        def step(i: int) -> None:
            trainer.accumulate(iter(steps[i]), accum)
            trainer.reduce_and_clip()
            trainer.optimizer_step(i)

        step(0)
        trainer.validate()
        warm = counter.frame_count
        assert trainer.optimizer.compiled_update is not None
        assert warm >= 2  # the blocks and the optimizer step went through the backend this class names
        with torch.compiler.set_stance("fail_on_recompile"):
            step(1)
            trainer.validate()
            step(2)
        assert counter.frame_count == warm
    finally:
        trainer.close()


def test_unset_train_compile_stays_eager_and_bf16_rounds_in_software(native_on_cpu):
    backend = make_backend("neuron-native", 0)
    recipe = load_recipe("llama2-7b-trn2")
    assert recipe.train.compile is None and not backend.compiles(recipe)
    assert backend.compiles(
        load_recipe("llama2-7b-trn2", overrides="train.compile=true layout.tp=1 layout.sequence_parallel=false")
    )
    # TorchNeuron has no documented stochastic-rounding switch: our AdamW rounds (on trn1 the runtime does).
    model = torch.nn.Linear(4, 4).to(torch.bfloat16)
    optimizer = backend.make_optimizer(model, recipe, types.SimpleNamespace(zero1=False, tp=1, tp_rank=0))
    assert optimizer.stochastic_rounding


@pytest.mark.parametrize(
    ("package", "raised"),
    [(None, "No module named 'torch_neuronx'"), ("raise ImportError('WRONG PACKAGE: see the Neuron docs')", "WRONG")],
    ids=["missing", "pypi-placeholder"],
)
def test_without_torchneuron_the_error_names_where_the_real_one_comes_from(tmp_path, monkeypatch, package, raised):
    monkeypatch.delitem(sys.modules, "torch_neuronx", raising=False)
    if package is not None:  # PyPI's torch-neuronx 1.0: a module whose import raises
        (tmp_path / "torch_neuronx").mkdir()
        (tmp_path / "torch_neuronx" / "__init__.py").write_text(package + "\n")
        monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RecipeError) as err:
        make_backend("neuron-native", 0)
    text = str(err.value)
    assert raised in text
    assert "pip.repos.neuron.amazonaws.com" in text and "/opt/aws_neuronx_venv_torch_neuronx_2_14_0" in text
    assert "cluster.instance=local-cpu cluster.backend=cpu" in text
