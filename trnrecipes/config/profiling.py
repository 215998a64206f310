"""monitor.profile_steps, the torch-free half: which steps and ranks are profiled, by what, and the Neuron runtime's
capture variables that run.sbatch sets on torch-xla + NxD (trnrecipes/train/profile.py profiles; its docstring says
how on each path).

torch-xla + NxD: the device work is in compiled graphs that torch.profiler does not see. The Neuron runtime captures
them itself when NEURON_RT_INSPECT_ENABLE=1 ("Neuron Explorer Environment Variables", Neuron SDK docs:
tools/neuron-explorer/environment-variables): run.sbatch sets the capture for the training step only, with one
device profile of each graph per core (model mode: the graph's first execution in the launch, after its compile)
and no system profile (it would grow for the whole job). That mode cannot be pointed at later steps on the stack's
SDKs (2.21-2.28; the variable that skips executions, NEURON_RT_INSPECT_DEVICE_PROFILE_NUM_WARMUP, is documented from
2.33), so there profile_steps turns the capture on for launches that train a step of the window and says that the
first executions are what is profiled. The same page warns against combining the capture with torch.profiler, so
nothing profiles in process there.
"""

from __future__ import annotations

from trnrecipes.config.sections import Recipe
from trnrecipes.config.stacks import XLA_NXD, sdk_version

PROFILE_DIR = "profile"  # under the run dir
NEURON_SUBDIR = "neuron"  # the Neuron runtime's capture, under PROFILE_DIR
ENV_DOC = "Neuron Explorer Environment Variables (Neuron SDK docs, tools/neuron-explorer/environment-variables)"


def profiles_in_process(r: Recipe) -> bool:
    """Whether torch.profiler profiles the window (everywhere but torch-xla + NxD, where the runtime does)."""
    return not (r.cluster.backend == "neuron" and r.stack == XLA_NXD)


def profiles_this_rank(r: Recipe, rank: int, local_rank: int) -> bool:
    return r.monitor.profile_steps is not None and (r.monitor.profile_ranks == "all" or local_rank == 0 or rank == 0)


def describe(r: Recipe) -> str | None:
    """One line for the plan and the trainer: which steps are profiled, how and where. None when none are."""
    if r.monitor.profile_steps is None:
        return None
    first, last = r.monitor.profile_steps
    ranks = "every rank" if r.monitor.profile_ranks == "all" else "the first rank of each node"
    steps = f"step {first}" if first == last else f"steps {first}-{last}"
    if profiles_in_process(r):
        # TorchNeuron's device activity needs its NeuronConfig (AWS's Neuron Explorer docs), not built here
        host = " (host-side ops only on TorchNeuron)" if r.cluster.backend == "neuron" else ""
        return f"profiling {steps} on {ranks} with torch.profiler{host}: Chrome traces in RUN_DIR/{PROFILE_DIR}/"
    return (
        f"profiling on {ranks} with the Neuron runtime's capture, for a launch that trains any of {steps}: one device"
        f" profile of each graph's first execution (its steps cannot be chosen on this SDK) in"
        f" RUN_DIR/{PROFILE_DIR}/{NEURON_SUBDIR}/, {viewer(r, f'RUN_DIR/{PROFILE_DIR}/{NEURON_SUBDIR}')}"
    )


def viewer(r: Recipe, directory: str) -> str:
    """The command that opens a Neuron capture: Neuron Explorer from SDK 2.28 (its docs' capture and view guides),
    neuron-profile (aws-neuronx-tools) before."""
    if sdk_version(r.cluster.neuron_sdk) >= (2, 28):
        return f"view with `neuron-explorer view -d {directory} --output-format perfetto`"
    return f"view with `neuron-profile view -d {directory}`"


def neuron_profile_env(r: Recipe, run_dir: str = "RUN_DIR") -> list[tuple[str, str, str]]:
    """(name, value, why) run.sbatch exports for the training step on torch-xla + NxD when steps are profiled,
    writing into `run_dir`."""
    if r.monitor.profile_steps is None or profiles_in_process(r):
        return []
    return [
        ("NEURON_RT_INSPECT_ENABLE", "1", f"the Neuron runtime's profile capture (monitor.profile_steps; {ENV_DOC})"),
        ("NEURON_RT_INSPECT_OUTPUT_DIR", f"{run_dir}/{PROFILE_DIR}/{NEURON_SUBDIR}", "where the capture is written"),
        ("NEURON_RT_INSPECT_SYSTEM_PROFILE", "0", "no system profile: it would record the whole job"),
        ("NEURON_RT_INSPECT_DEVICE_PROFILE", "1", "one device profile of each compiled graph per core (model mode)"),
    ]
