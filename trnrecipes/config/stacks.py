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
from pathlib import Path

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


UBUNTU_22, UBUNTU_24 = "Deep Learning AMI Neuron (Ubuntu 22.04)", "Deep Learning AMI Neuron (Ubuntu 24.04)"
AMI_PYTHON = {UBUNTU_22: "3.10", UBUNTU_24: "3.12"}  # each Ubuntu's Python, which its DLAMI's venvs are made with


@dataclass(frozen=True)
class SdkRelease:
    """What one Neuron SDK release ships for training, as AWS publishes it: the Deep Learning AMI virtualenv the job
    scripts run by default, and the version prefixes of the packages `trnrecipes doctor` expects in it."""

    venvs: tuple[str, ...]  # the DLAMI virtualenvs (the first is the default), newest OS image first
    packages: dict[str, tuple[str, ...]]  # distribution -> allowed version prefixes
    source: str
    amis: tuple[str, ...] = (UBUNTU_22,)  # the DLAMI holding each of `venvs`, by AWS's name for it


def _xla(torch_neuronx: str, cc: str, nxd: str, venvs: tuple[str, ...], source: str) -> SdkRelease:
    """An XLA/NxD release. torch-neuronx A.B.C.x.y encodes torch A.B.C; torch and torch-xla (from PyPI, a dependency
    of torch-neuronx) are held to its minor version, A.B."""
    builds = torch_neuronx.split("|")
    minors = tuple(".".join(b.split(".")[:2]) + "." for b in builds)
    return SdkRelease(
        venvs,
        {
            "torch": minors,
            "torch-xla": minors,
            "torch-neuronx": tuple(f"{b}." for b in builds),
            "neuronx-cc": (f"{cc}.",),
            "neuronx-distributed": (f"{nxd}.",),
        },
        source,
        (UBUNTU_24, UBUNTU_22) if len(venvs) == 2 else (UBUNTU_22,),
    )


_VENV = "/opt/aws_neuronx_venv_pytorch_{}_nxd_training"
# Sources: aws-neuron-sdk v2.NN.0 dlami/index.rst ("Virtual Environments pre-installed", the multi-framework DLAMI:
# the PyTorch NxD Training venv) and src/helperscripts/n2-manifest.json (the packages of each release, as
# release-notes/releasecontent.rst lists them); torch-xla's minor from the torch-neuronx "introducing PyTorch 2.x"
# app notes. From 2.27 the Ubuntu 24.04 DLAMI has PyTorch 2.9 (its venv first here) and the Ubuntu 22.04 one 2.8.
SDK_RELEASES: dict[tuple[int, int], SdkRelease] = {
    (2, 21): _xla("2.5.1.2.4", "2.16", "0.10", (_VENV.format("2_5"),), "aws-neuron-sdk v2.21.0"),
    (2, 22): _xla("2.5.1.2.6", "2.17", "0.11", (_VENV.format("2_5"),), "aws-neuron-sdk v2.22.0"),
    (2, 23): _xla("2.6.0.2.7", "2.18", "0.12", (_VENV.format("2_6"),), "aws-neuron-sdk v2.23.0"),
    (2, 24): _xla("2.7.0.2.8", "2.19", "0.13", (_VENV.format("2_7"),), "aws-neuron-sdk v2.25.0 (2.24.0's manifest)"),
    (2, 25): _xla("2.7.0.2.9", "2.20", "0.14", (_VENV.format("2_7"),), "aws-neuron-sdk v2.25.0"),
    (2, 26): _xla("2.8.0.2.10", "2.21", "0.15", (_VENV.format("2_8"),), "aws-neuron-sdk v2.26.0"),
    (2, 27): _xla(
        "2.9.0.2.11|2.8.0.2.11", "2.22", "0.16", (_VENV.format("2_9"), _VENV.format("2_8")), "aws-neuron-sdk v2.27.0"
    ),
    (2, 28): _xla(
        "2.9.0.2.12|2.8.0.2.12", "2.23", "0.17", (_VENV.format("2_9"), _VENV.format("2_8")), "aws-neuron-sdk v2.28.0"
    ),
    # TorchNeuron: "Deep Learning AMI Neuron torch-neuronx 2.14.0" (awsdocs-neuron v2.33.0 setup/pytorch/update-dlami;
    # torch-neuronx 2.14.3.0 with torch 2.14.0, or 2.13.3.0 with 2.13: release-notes/components/torchneuron; neuronx-cc
    # 2.28.7631.0: release-notes/components/index). No torch-xla, no neuronx-distributed on this stack.
    (2, 33): SdkRelease(
        ("/opt/aws_neuronx_venv_torch_neuronx_2_14_0",),
        {"torch": ("2.14.", "2.13."), "torch-neuronx": ("2.14.3.", "2.13.3."), "neuronx-cc": ("2.28.",)},
        "awsdocs-neuron v2.33.0",
        ("Deep Learning AMI Neuron torch-neuronx 2.14.0",),
    ),
}


def dlami_python(sdk: str) -> str:
    """The interpreter the job scripts run by default on a Neuron stack: the python of that release's DLAMI venv.
    cluster.python or TRNRECIPES_PYTHON overrides it; trnrecipes' training dependencies are installed into it
    (docs/jobs.md: "Trainium stacks")."""
    return SDK_RELEASES[sdk_version(sdk)].venvs[0] + "/bin/python"


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


def default_python(recipe, repo_root: Path, scoring: bool = False) -> str | Path:
    """The interpreter the scripts run (TRNRECIPES_PYTHON overrides it at submit time): cluster.python, else on a
    Neuron stack the virtualenv of that SDK's Deep Learning AMI (SDK_RELEASES), else (cpu,
    cuda, xla) the checkout's .venv. `scoring` (eval.sbatch, infer.sbatch): on a Neuron stack the checkout's .venv,
    whatever cluster.python says, since scoring runs on the host CPU with lm-eval and transformers pins that a Neuron
    venv must not take."""
    if recipe.cluster.backend == "neuron" and scoring:
        return repo_root / ".venv" / "bin" / "python"
    if recipe.cluster.python:
        return recipe.cluster.python
    if recipe.cluster.backend == "neuron":
        return dlami_python(recipe.cluster.neuron_sdk)
    return repo_root / ".venv" / "bin" / "python"
