"""Instance catalog: what one node of each target offers. Prices are on-demand US East, per instance-hour.

Sources: AWS instance pages and the Neuron architecture docs (awsdocs-neuron.readthedocs-hosted.com, about-neuron/
arch/neuron-hardware: trainium, trainium2, trainium3, neuron-core-v3/v4, trn2-arch, trn3-arch); A100 312, H100 SXM
989 dense BF16 TFLOPS. A recipe may override the price (reserved/SageMaker rates) and the worker count (a different
logical-core layout). Which Neuron software stack trains on which instance: trnrecipes.config.stacks.

Peak for MFU on trn2/trn3 is the tensor engines' dense BF16 rate per logical NeuronCore (LNC=2: two physical
cores), as TorchTitan Neuron counts it: 2 cores x 128 x 128 MACs x 2 FLOPs x 2.4 GHz = 157 TFLOPS (its
get_peak_flops patch, "Trainium2 LNC2"); the NeuronCore-v3 and -v4 pages give 79 per physical core, the same
within 1%. AWS's headline 667 (trn2) / 671 (trn3) per chip of 8 cores is 6% higher; MFU against it would read 6%
lower than TorchTitan Neuron's for the same run.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Instance:
    name: str
    accelerator: str  # what one worker process drives
    workers_per_node: int  # one training process per NeuronCore / GPU / CPU worker
    peak_bf16_tflops: float  # dense, whole instance
    hbm_gib: float  # accelerator memory, whole instance
    network_gbps: int  # inter-node fabric
    price_per_hour: float | None  # USD, on-demand; None: not published when this catalog was written
    backends: tuple[str, ...]  # training backends that run on it


INSTANCES: dict[str, Instance] = {
    i.name: i
    for i in (
        # 16 Trainium chips x 2 NeuronCore-v2; one worker per core.
        Instance("trn1.32xlarge", "NeuronCore-v2", 32, 16 * 190.0, 512, 800, 21.50, ("neuron",)),
        Instance("trn1n.32xlarge", "NeuronCore-v2", 32, 16 * 190.0, 512, 1600, 24.78, ("neuron",)),
        # 16 Trainium2 chips x 8 NeuronCore-v3, grouped in pairs by the default logical core config (LNC=2): 64
        # workers of 24 GiB each. Peak: 64 logical cores x 157 (see above; AWS's headline: 16 x 667 = 10,672).
        Instance("trn2.48xlarge", "NeuronCore-v3 (LNC=2)", 64, 64 * 157.0, 16 * 96, 3200, 44.70, ("neuron",)),
        # A Trn3 Gen1 UltraServer's server: 16 Trainium3 chips x 8 NeuronCore-v4 (LNC=2 by default: 64 workers),
        # 144 GiB per chip, 12,800 Gbps EFA per 4-server UltraServer (3,200 per server). The chip figures are AWS's
        # (trainium3, trn3-arch pages); UNVERIFIED: the instance name (AWS documents UltraServers, not instance
        # sizes; "trn3.48xlarge" is the name the Neuron driver reports) and the price (none published: set
        # cluster.price_per_hour). Peak as trn2's: 2 x 79 TFLOPS per logical core (AWS's headline 16 x 671).
        Instance("trn3.48xlarge", "NeuronCore-v4 (LNC=2)", 64, 64 * 158.0, 16 * 144, 3200, None, ("neuron",)),
        Instance("p4d.24xlarge", "A100-40GB", 8, 8 * 312.0, 8 * 40, 400, 32.77, ("cuda", "xla")),
        Instance("p5.48xlarge", "H100-80GB", 8, 8 * 989.0, 8 * 80, 3200, 55.04, ("cuda", "xla")),
        # A laptop or CI box: two CPU worker processes, price zero. Peak: fp32, since CPUs without AVX512-BF16 run
        # bf16 matmuls far slower than fp32: 2 cores x 2 FMA units x 8 lanes x 2 FLOPs x ~3 GHz = 0.19 TFLOP/s
        # (torch reaches 0.17 on a 2048^3 fp32 matmul on the CI machines).
        Instance("local-cpu", "CPU", 2, 0.19, 0, 0, 0.0, ("cpu", "xla")),
    )
}


# Where a job runs on this machine (a laptop, CI, a loopback Slurm): a run dir in the checkout is the right default,
# and what a cluster job is warned about (shared storage, the partition's time limit) does not apply.
LOCAL_INSTANCES = ("local-cpu",)


def get_instance(name: str) -> Instance:
    try:
        return INSTANCES[name]
    except KeyError:
        raise ValueError(f"unknown instance {name!r}; known instances: {', '.join(INSTANCES)}") from None
