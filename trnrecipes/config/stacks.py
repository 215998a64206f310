"""Which Neuron software stack trains a recipe: it follows from cluster.neuron_sdk, and the instance must run it.
Torch-free (the rendering path reads it).

- `xla-nxd`: torch-xla + neuronx-distributed (trnrecipes/backends/neuron_xla.py), Neuron SDK 2.21 to 2.28, on trn1,
  trn1n and trn2. 2.28 is the last release with NxD Core training APIs and PyTorch/XLA training ("Announcing end of
  support for NxDT and NxD Core Training APIs starting with Neuron SDK release 2.29", AWS, February 2026; 2.30:
  PyTorch/XLA no longer supported for training; 2.32: XLA torch-neuronx no longer in the DLAMIs). trn1 stays here.
  2.21 is the first SDK with PyTorch 2.5, whose torch-xla has torch_xla.device() and torch_xla.sync().
- `torchneuron`: native PyTorch on device `neuron` (trnrecipes/backends/neuron_native.py), Neuron SDK 2.33, trn2
  and trn3 only (TorchNeuron public beta, Neuron 2.33 release notes; awsdocs-neuron torch/index.html). The same
  plain-PyTorch + DTensor code as the cpu/cuda backends.
- SDK 2.29 to 2.32 have neither (XLA training retired, TorchNeuron not yet released): refused.

Off Neuron (cpu, cuda, xla) there is no SDK: the recipe's backend is all there is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from trnrecipes.config.cluster import INSTANCES

XLA_NXD, TORCHNEURON = "xla-nxd", "torchneuron"
SdkRange = tuple[tuple[int, int], tuple[int, int]]


@dataclass(frozen=True)
class NeuronStack:
    name: str
    title: str  # for messages and script comments
    sdks: SdkRange  # oldest and newest Neuron SDK the env/flag table (trnrecipes.jobs.neuron_env) describes for it
    instances: tuple[str, ...]  # catalog instances it trains on
    runtime_backend: str  # the trnrecipes.backends name that runs it


STACKS: dict[str, NeuronStack] = {
    s.name: s
    for s in (
        NeuronStack(
            XLA_NXD,
            "torch-xla + neuronx-distributed",
            ((2, 21), (2, 28)),
            ("trn1.32xlarge", "trn1n.32xlarge", "trn2.48xlarge"),
            "neuron",
        ),
        NeuronStack(
            TORCHNEURON,
            "TorchNeuron, native PyTorch",
            ((2, 33), (2, 33)),
            ("trn2.48xlarge", "trn3.48xlarge"),
            "neuron-native",
        ),
    )
}

# The interpreter run.sbatch uses by default on the TorchNeuron stack: the virtualenv of AWS's "Deep Learning AMI
# Neuron torch-neuronx" for that SDK (Neuron 2.33: PyTorch 2.14, torch-neuronx 2.14.x; awsdocs-neuron v2.33.0
# setup/pytorch/update-dlami). cluster.python or TRNRECIPES_PYTHON overrides it. trnrecipes' own dependencies must be
# installed into it (docs/jobs.md: "Trainium stacks").
DLAMI_PYTHON: dict[tuple[int, int], str] = {(2, 33): "/opt/aws_neuronx_venv_torch_neuronx_2_14_0/bin/python"}

_SDK_TEXT = re.compile(r"2\.[0-9]{1,2}")


def sdk_version(text: str) -> tuple[int, int]:
    """'2.26' -> (2, 26)."""
    major, minor = text.split(".")
    return int(major), int(minor)


def sdk_span(sdks: SdkRange) -> str:
    """((2, 21), (2, 28)) -> '2.21 to 2.28'; one release -> '2.33'."""
    (lo_major, lo), (hi_major, hi) = sdks
    return f"{lo_major}.{lo}" if sdks[0] == sdks[1] else f"{lo_major}.{lo} to {hi_major}.{hi}"


def valid_sdks(instance: str) -> str:
    """What cluster.neuron_sdk may be on this instance, e.g. '2.21 to 2.28 (torch-xla + neuronx-distributed)'."""
    options = [f"{sdk_span(s.sdks)} ({s.title})" for s in STACKS.values() if instance in s.instances]
    return " or ".join(options) or "none (no Neuron stack trains on it)"


def stack_for_sdk(sdk: str) -> NeuronStack | None:
    """The stack a Neuron SDK version selects, or None for one no stack supports (or malformed text)."""
    if not _SDK_TEXT.fullmatch(sdk):
        return None
    version = sdk_version(sdk)
    return next((s for s in STACKS.values() if s.sdks[0] <= version <= s.sdks[1]), None)


def stack_problem(instance: str, sdk: str) -> str | None:
    """Why this instance x Neuron SDK cannot train on backend neuron, naming what would be valid; None if it can."""
    if instance not in INSTANCES:
        return None  # the recipe check names the unknown instance
    valid = f"valid on {instance}: cluster.neuron_sdk {valid_sdks(instance)}"
    if not _SDK_TEXT.fullmatch(sdk):
        return f"cluster.neuron_sdk {sdk!r}: expected a release such as 2.28 (major.minor); {valid}"
    stack = stack_for_sdk(sdk)
    if stack is None:
        version = sdk_version(sdk)
        if STACKS[XLA_NXD].sdks[1] < version < STACKS[TORCHNEURON].sdks[0]:
            why = (
                "XLA/NxD training ended after Neuron SDK 2.28 and TorchNeuron (native PyTorch) begins at 2.33,"
                " so no training stack exists for it"
            )
        else:
            why = "outside the releases this project's env/flag table describes"
        return f"cluster.neuron_sdk {sdk}: {why}; {valid}"
    if instance not in stack.instances:
        return (
            f"cluster.neuron_sdk {sdk} selects {stack.title}, which trains on {', '.join(stack.instances)} only,"
            f" not {instance}; {valid}"
        )
    return None


def neuron_stack(instance: str, sdk: str) -> NeuronStack:
    """The stack a valid backend-neuron recipe trains on (the recipe check has refused the rest)."""
    problem = stack_problem(instance, sdk)
    stack = stack_for_sdk(sdk)
    if problem is not None or stack is None:
        raise ValueError(problem or f"cluster.neuron_sdk {sdk!r}: no stack")
    return stack
