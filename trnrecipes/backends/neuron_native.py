"""Trainium 2/3 through TorchNeuron: native PyTorch on device `neuron` (Neuron SDK 2.33, trn2 and trn3; the stack
is chosen in trnrecipes.config.stacks). It is the cpu/cuda code (TorchBackend: DTensor TP/SP, FSDP2, ZeRO-1,
torch.distributed.pipelining, our AdamW) with four class attributes changed: the device type, the process-group
backend string, the DeviceMesh device type and torch.compile's backend. The tests run this class for real with
those four set to the CPU's (tests/test_neuron_native.py); the Neuron SDK installs only on Trainium hosts.

What TorchNeuron asks, from its docs (awsdocs-neuron torch/index, torch/guides/torch-distributed, torch/compile/
reference-torch-compile; Neuron 2.33) and torch-neuronx's source where the docs say less:
- `import torch_neuronx` registers the `neuron` device (PrivateUse1, also autoloaded) and the `neuron`
  process-group backend.
- init_process_group before any tensor exists on the device: its backend asserts that the runtime is not yet
  initialised. `create` therefore touches no device API, and the trainer builds ParallelDims (which initialises the
  group) before anything else. TorchNeuron then sets NEURON_RT_VISIBLE_CORES to LOCAL_RANK (one core per process,
  which it asserts), so every worker's device is `neuron:0`.
  Once it exists, `select_device` makes `neuron:0` current before DeviceMesh would pick LOCAL_RANK.
- The `neuron` process group reduces device tensors; CPU tensors (metrics, object collectives, checkpoint
  bookkeeping) go over gloo through the combined backend string. The combined string is standard
  torch.distributed; that TorchNeuron accepts it beside its own backend is not shown in its docs (unverified on
  hardware).
- torch.compile(backend="neuron") with static shapes (dynamic=True is rejected; every new shape recompiles), mode
  default only: train.compile compiles each block that way (trnrecipes/parallel/compile.py). Unset, train.compile
  stays off here: eager mode with Adaptive Eager Execution is TorchNeuron's default.
- torch.autocast("neuron") for bf16-mixed (the trainer autocasts on the device's type).
- No documented stochastic-rounding switch: our AdamW rounds bf16 in software (rounds_stochastically False).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from trnrecipes.backends.torch import TorchBackend
from trnrecipes.config.sections import RecipeError

# Where the real package comes from: PyPI's `torch-neuronx` is a placeholder whose import raises "WRONG PACKAGE".
WHERE_FROM = (
    "TorchNeuron (torch-neuronx 2.13/2.14 from the Neuron pip repository https://pip.repos.neuron.amazonaws.com, not"
    " PyPI, whose torch-neuronx is a placeholder) is preinstalled in the Deep Learning AMI Neuron's virtualenv, e.g."
    " /opt/aws_neuronx_venv_torch_neuronx_2_14_0: run with that Python (cluster.python or TRNRECIPES_PYTHON)"
)


class NeuronNativeBackend(TorchBackend):
    """`neuron` on the TorchNeuron stack: one logical NeuronCore per rank."""

    device_type: ClassVar[str] = "neuron"
    dist_backend = "cpu:gloo,neuron:neuron"
    mesh_device_type: ClassVar[str] = "neuron"
    compile_backend = "neuron"
    compiles_by_default = False  # eager with Adaptive Eager Execution unless train.compile is true
    # Metric reductions and decisions (int64 MAX among them) as CPU tensors over the gloo half of the process group:
    # which reductions the neuron backend supports for which dtypes is not documented. Gradients, ZeRO-1 rows and
    # FSDP's collectives are device tensors on the neuron half.
    collectives_on_device = False
    package: ClassVar[str] = "torch_neuronx"

    @classmethod
    def create(cls, name: str, local_rank: int) -> NeuronNativeBackend:
        cls.check_installed()
        # No device call here (not even set_device): the process group must come first. Index 0: TorchNeuron shows
        # each worker only its own core (NEURON_RT_VISIBLE_CORES = LOCAL_RANK).
        return cls(name, torch.device(cls.device_type, 0))

    def select_device(self) -> None:
        # DeviceMesh sets the device itself when the device module says none is initialised: to LOCAL_RANK, a core
        # this worker cannot see (TorchNeuron shows each worker only its own). Select ours first, now that the
        # process group exists (before it, TorchNeuron's runtime must not start).
        torch.get_device_module(self.device_type).set_device(self.device.index)

    @classmethod
    def check_installed(cls) -> None:
        try:
            __import__(cls.package)  # registers the device and the process-group backend
        except Exception as err:  # ImportError, or the PyPI placeholder's own exception
            raise RecipeError(
                f"cluster.neuron_sdk 2.33 on trn2/trn3 trains through TorchNeuron, which this Python cannot import"
                f" ({type(err).__name__}: {err}). {WHERE_FROM}. Off Trainium, run the same recipe with"
                " cluster.instance=local-cpu cluster.backend=cpu (or a GPU instance and cuda)"
            ) from None
