"""Run under tests/ranks.py by tests/test_neuron_native.py: tests/train_worker.py's training, but through the
TorchNeuron backend's code (trnrecipes/backends/neuron_native.py) with its device type, process-group backend string
and DeviceMesh device type set to the CPU's, and a stand-in `torch_neuronx` module. Records, in OUT.nativeN.json,
every tensor operation that ran before the process group was created (TorchNeuron requires none on its device; on the
CPU stand-in none at all may run), the backend string init_process_group got, the device type of the mesh, and the
order of process group, device selection and mesh.

    python tests/native_worker.py OUT.pt RECIPE [k=v ...]
"""

from __future__ import annotations

import json
import os
import sys
import types

import torch
import torch.distributed as dist
import torch.distributed.device_mesh as device_mesh
import train_worker
from torch.utils._python_dispatch import TorchDispatchMode

from trnrecipes.backends.neuron_native import NeuronNativeBackend

CPU_STAND_IN = {"device_type": "cpu", "dist_backend": "cpu:gloo", "mesh_device_type": "cpu"}


class RecordOps(TorchDispatchMode):
    """Every aten operation dispatched while active."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def main() -> None:
    sys.modules["torch_neuronx"] = types.ModuleType("torch_neuronx")  # what check_installed imports
    for name, value in CPU_STAND_IN.items():
        setattr(NeuronNativeBackend, name, value)
    with RecordOps() as check:  # the probe sees a factory call, as it would one on the device
        torch.zeros(1)
    assert check.ops == ["aten.zeros.default"], check.ops
    seen: dict[str, object] = {}
    probe = RecordOps()
    probe.__enter__()  # left in init_process_group below, which pops it off the mode stack
    real_init, real_mesh = dist.init_process_group, device_mesh.init_device_mesh

    order: list[str] = []
    seen["order"] = order
    device_module = torch.get_device_module("cpu")
    real_set_device = device_module.set_device

    def init_process_group(backend=None, *args, **kwargs):
        probe.__exit__(None, None, None)
        seen["ops_before_process_group"], seen["process_group_backend"] = probe.ops, backend
        order.append("init_process_group")
        return real_init(backend, *args, **kwargs)

    def set_device(device):
        order.append(f"set_device({device})")
        return real_set_device(device)

    def init_device_mesh(device_type, *args, **kwargs):
        seen["mesh_device_type"] = device_type
        order.append("init_device_mesh")
        return real_mesh(device_type, *args, **kwargs)

    dist.init_process_group, device_mesh.init_device_mesh = init_process_group, init_device_mesh
    device_module.set_device = set_device
    train_worker.main()  # builds the Trainer from sys.argv, trains, saves OUT and OUT.rankN
    with open(f"{sys.argv[1]}.native{os.environ.get('RANK', '0')}.json", "w") as f:
        json.dump(seen, f)


if __name__ == "__main__":
    main()
