"""The one table of Neuron environment variables and compiler flags, keyed by Neuron SDK version.

compile.sbatch and run.sbatch both export exactly `backend_env(recipe)`, so the two can never drift apart (the
anchors' copy-pasted env blocks did). Precision lives in the recipe; this table only translates it for the SDK.
Sources: AWS Neuron docs and the public NxD / neuronx-nemo-megatron scripts; see FACTS.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from trnrecipes.cluster import SUPPORTED_SDK, sdk_version
from trnrecipes.families import FAMILIES
from trnrecipes.recipe import Recipe


@dataclass(frozen=True)
class EnvRule:
    name: str
    value: Callable[[Recipe], str | None]  # None: not set for this recipe
    why: str
    since: tuple[int, int] = SUPPORTED_SDK[0]  # first SDK that reads it
    until: tuple[int, int] = SUPPORTED_SDK[1]  # last SDK that reads it


def neuron_cc_flags(r: Recipe) -> str:
    flags = [
        "--model-type",
        "transformer",
        "--distribution-strategy",
        "llm-training",
        f"--optlevel={r.compile.optlevel}",
    ]
    if r.compile.mixed_precision_accumulation:
        flags.append("--enable-mixed-precision-accumulation")
    flags += FAMILIES[r.model.family].compiler_flags(r.cluster.instance)  # e.g. neox on trn1
    return " ".join(flags + r.compile.extra_flags)


def _const(value: str) -> Callable[[Recipe], str]:
    return lambda _r: value


# No XLA_USE_BF16 / XLA_DOWNCAST_BF16 (AWS's samples for SDK <= 2.24 set them): the trainer casts the model to bf16
# (precision.dtype bf16) or autocasts (bf16-mixed) itself on every supported SDK, and those variables would also put
# its fp32 state in bf16: AdamW moments, bf16-mixed master weights, and constants (beta2 0.999 rounds to 1.0).
RULES: tuple[EnvRule, ...] = (
    EnvRule("NEURON_CC_FLAGS", neuron_cc_flags, "neuronx-cc flags for transformer training"),
    EnvRule(
        "NEURON_COMPILE_CACHE_URL",
        lambda r: r.compile.cache_dir,
        "node-local compile cache: many writers on a shared FS corrupt and slow it",
    ),
    EnvRule(
        "NEURON_LOGICAL_NC_CONFIG",
        lambda r: "2" if r.cluster.instance.startswith("trn2") else None,
        "trn2: two physical NeuronCores per logical one, the SDK's default, said aloud so the runtime, the compiler"
        " and NxD's TP groups (trnrecipes/neuron_parallel.py reads it) agree with the catalog's 64 workers per node",
    ),
    EnvRule("NEURON_FUSE_SOFTMAX", _const("1"), "fused softmax kernel"),
    EnvRule(
        "NEURON_RT_STOCHASTIC_ROUNDING_EN",
        lambda r: "1" if r.precision.stochastic_rounding else "0",
        "bf16 stochastic rounding in the runtime (precision.stochastic_rounding)",
    ),
    EnvRule(
        "NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS",
        _const("3"),
        "overlap host and device execution (the runtime drops it in SDK 2.31)",
    ),
    EnvRule("MALLOC_ARENA_MAX", _const("64"), "bounds glibc arenas: host memory of 32+ workers per node"),
    EnvRule("FI_PROVIDER", _const("efa"), "libfabric over EFA between nodes"),
    EnvRule("FI_EFA_USE_DEVICE_RDMA", _const("1"), "EFA RDMA straight to device memory"),
    EnvRule("FI_EFA_FORK_SAFE", _const("1"), "the data loader forks; EFA must survive it"),
)


def backend_env(r: Recipe) -> list[tuple[str, str, str]]:
    """(name, value, why) exported by both sbatch scripts, in table order. Empty off Neuron."""
    if r.cluster.backend != "neuron":
        return []
    version = sdk_version(r.cluster.neuron_sdk)
    rows = []
    for rule in RULES:
        if rule.since <= version <= rule.until:
            value = rule.value(r)
            if value is not None:
                rows.append((rule.name, value, rule.why))
    return rows
