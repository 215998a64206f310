"""The one table of Neuron environment variables and compiler flags, keyed by Neuron SDK version.

compile.sbatch and run.sbatch both export exactly `backend_env(recipe)`, so the two can never drift apart (the
anchors' copy-pasted env blocks did). Precision lives in the recipe; this table only translates it for the SDK.
Sources: AWS Neuron docs and the public NxD / neuronx-nemo-megatron scripts; see FACTS.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from trnrecipes.recipe import Recipe

# Oldest and newest SDK this table describes. XLA-based training (torch-neuronx + NxD) ends support in 2.32.
SUPPORTED_SDK: tuple[tuple[int, int], tuple[int, int]] = ((2, 18), (2, 32))


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
    return " ".join(flags + r.compile.extra_flags)


def _const(value: str) -> Callable[[Recipe], str]:
    return lambda _r: value


RULES: tuple[EnvRule, ...] = (
    EnvRule("NEURON_CC_FLAGS", neuron_cc_flags, "neuronx-cc flags for transformer training"),
    EnvRule(
        "NEURON_COMPILE_CACHE_URL",
        lambda r: r.compile.cache_dir,
        "node-local compile cache: many writers on a shared FS corrupt and slow it",
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
        "overlap host and device execution; removed in SDK 2.31",
        until=(2, 30),
    ),
    EnvRule(
        "XLA_USE_BF16",
        lambda r: "1" if r.precision.dtype == "bf16" else None,
        "precision.dtype bf16: every fp32 tensor in bf16 (SDK <= 2.24; later SDKs cast the model instead)",
        until=(2, 24),
    ),
    EnvRule(
        "XLA_DOWNCAST_BF16",
        lambda r: "1" if r.precision.dtype == "bf16-mixed" else None,
        "precision.dtype bf16-mixed: fp32 math downcast to bf16 (SDK <= 2.24; later SDKs cast the model instead)",
        until=(2, 24),
    ),
    EnvRule("MALLOC_ARENA_MAX", _const("64"), "bounds glibc arenas: host memory of 32+ workers per node"),
    EnvRule("FI_PROVIDER", _const("efa"), "libfabric over EFA between nodes"),
    EnvRule("FI_EFA_USE_DEVICE_RDMA", _const("1"), "EFA RDMA straight to device memory"),
    EnvRule("FI_EFA_FORK_SAFE", _const("1"), "the data loader forks; EFA must survive it"),
)


def sdk_version(text: str) -> tuple[int, int]:
    major, minor = text.split(".")
    return int(major), int(minor)


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


def casts_model_in_python(r: Recipe) -> bool:
    """Whether training must cast the model to bf16 itself (the SDK no longer honours XLA_USE/DOWNCAST_BF16)."""
    if r.precision.dtype == "fp32":
        return False
    return r.cluster.backend != "neuron" or sdk_version(r.cluster.neuron_sdk) > (2, 24)
