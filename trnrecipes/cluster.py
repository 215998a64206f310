"""Instance catalog: what one node of each target offers. Prices are on-demand US East, per instance-hour.

Sources: AWS instance pages and FACTS.md (trn1 190 BF16 TFLOPS per chip, trn2 667; A100 312, H100 SXM 989 dense).
A recipe may override the price (reserved/SageMaker rates) and the worker count (a different logical-core layout).
"""

from __future__ import annotations

from dataclasses import dataclass

# Oldest and newest Neuron SDK the env/flag table (trnrecipes.neuron_env) describes. From 2.21 on the SDK ships
# PyTorch 2.5: torch_xla.device() (torch-xla 2.3+) and torch_xla.sync() (2.4+), which the backend uses, exist;
# 2.18-2.20 ship torch-xla 2.1 without them. 2.28 is the last release with NxD Core training APIs and PyTorch/XLA
# training ("Announcing end of support for NxDT and NxD Core Training APIs starting with Neuron SDK release 2.29",
# AWS, February 2026).
SUPPORTED_SDK: tuple[tuple[int, int], tuple[int, int]] = ((2, 21), (2, 28))


def sdk_version(text: str) -> tuple[int, int]:
    """'2.26' -> (2, 26)."""
    major, minor = text.split(".")
    return int(major), int(minor)


@dataclass(frozen=True)
class Instance:
    name: str
    accelerator: str  # what one worker process drives
    workers_per_node: int  # one training process per NeuronCore / GPU / CPU worker
    peak_bf16_tflops: float  # dense, whole instance
    hbm_gib: float  # accelerator memory, whole instance
    network_gbps: int  # inter-node fabric
    price_per_hour: float  # USD, on-demand
    backends: tuple[str, ...]  # training backends that run on it


INSTANCES: dict[str, Instance] = {
    i.name: i
    for i in (
        # 16 Trainium chips x 2 NeuronCore-v2; one worker per core.
        Instance("trn1.32xlarge", "NeuronCore-v2", 32, 16 * 190.0, 512, 800, 21.50, ("neuron",)),
        Instance("trn1n.32xlarge", "NeuronCore-v2", 32, 16 * 190.0, 512, 1600, 24.78, ("neuron",)),
        # 16 Trainium2 chips x 8 NeuronCore-v3, grouped in pairs by the default logical core config (LNC=2).
        Instance("trn2.48xlarge", "NeuronCore-v3 (LNC=2)", 64, 16 * 667.0, 16 * 96, 3200, 44.70, ("neuron",)),
        Instance("p4d.24xlarge", "A100-40GB", 8, 8 * 312.0, 8 * 40, 400, 32.77, ("cuda", "xla")),
        Instance("p5.48xlarge", "H100-80GB", 8, 8 * 989.0, 8 * 80, 3200, 55.04, ("cuda", "xla")),
        # A laptop or CI box: two CPU worker processes, price zero. Peak: fp32, since CPUs without AVX512-BF16 run
        # bf16 matmuls far slower than fp32: 2 cores x 2 FMA units x 8 lanes x 2 FLOPs x ~3 GHz = 0.19 TFLOP/s
        # (torch reaches 0.17 on a 2048^3 fp32 matmul on the CI machines).
        Instance("local-cpu", "CPU", 2, 0.19, 0, 0, 0.0, ("cpu", "xla")),
    )
}


def get_instance(name: str) -> Instance:
    try:
        return INSTANCES[name]
    except KeyError:
        raise ValueError(f"unknown instance {name!r}; known instances: {', '.join(INSTANCES)}") from None
