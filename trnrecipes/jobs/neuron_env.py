"""The one table of Neuron environment variables and compiler flags, per Neuron stack and SDK version.

compile.sbatch and run.sbatch both export exactly `backend_env(recipe)`, so the two can never drift apart (the
anchors' copy-pasted env blocks did). Precision lives in the recipe; this table only translates it for the stack.
Sources: AWS Neuron docs, the public NxD / neuronx-nemo-megatron scripts and, for TorchNeuron (Neuron 2.33), its
docs (awsdocs-neuron torch/index, torch/guides/torch-distributed, torch/reference/env-vars) and torch-neuronx's source
(where the docs were not readable here: marked); see FACTS.md.

What TorchNeuron does itself, so the table leaves it out there: it sets NEURON_RT_VISIBLE_CORES (to LOCAL_RANK: one
core per process, which it asserts) and NEURON_RT_ROOT_COMM_ID (from MASTER_ADDR, through the rendezvous store)
when unset, so exporting either would break it; it reads neither NEURON_COMPILE_CACHE_URL nor NEURON_FUSE_SOFTMAX
(torch-xla's); it passes neuronx-cc `--model-type transformer --auto-cast=none -O1` itself and appends
NEURON_CC_FLAGS. It has no documented stochastic-rounding switch: the trainer's AdamW rounds in software there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from trnrecipes import REPO_ROOT
from trnrecipes.config.families import FAMILIES
from trnrecipes.config.sections import Recipe
from trnrecipes.config.stacks import TORCHNEURON, XLA_NXD, sdk_version

BOTH = (XLA_NXD, TORCHNEURON)


# AWS's scripts and docs the rows follow (aws-neuron/* on GitHub; the SDK docs at awsdocs-neuron.readthedocs-hosted.com)
NNM = "neuronx-nemo-megatron nemo/examples/nlp/language_modeling/train_setup.sh"
NXDT = "neuronx-distributed-training examples/training_orchestrator.py"
RUNTIME_DOCS = "Neuron runtime configuration guide (neuron-runtime/guides/configuration-guide)"
NXD_70B = "neuronx-distributed examples/training/llama/tp_pp_llama_hf_pretrain/run_llama2_70B_tp_pp.sh"
NXD_7B = "neuronx-distributed examples/training/llama/tp_zero1_llama_hf_pretrain/tp_zero1_llama2_7B_hf_pretrain.sh"
NXDT_SETUP = "neuronx-distributed-training examples/train_setup.sh"
NXD_TRAINER = "neuronx-distributed trainer/trainer.py"
JOB_USER = "${JOB_USER}"  # expanded by the scripts to the submitting user (trnrecipes.jobs.render quotes around it)


@dataclass(frozen=True)
class EnvRule:
    name: str
    value: Callable[[Recipe, Path], str | None]  # (recipe, job dir) -> value; None: not set for this recipe
    why: str
    stacks: tuple[str, ...] = (XLA_NXD,)  # the Neuron stacks that read it
    since: tuple[int, int] = (2, 0)  # first SDK that reads it
    until: tuple[int, int] = (2, 99)  # last SDK that reads it
    source: str = ""  # the AWS script or doc that sets it so: printed beside it in the scripts


def local_cache_dir(r: Recipe) -> str:
    """compile.cache_dir, else one node-local dir per user and job: the SDK's default (/var/tmp/neuron-compile-cache)
    is one dir per node for every user, where one user's files block another's and stale graphs pile up."""
    return r.compile.cache_dir or f"/var/tmp/neuron-compile-cache-{JOB_USER}/{r.job_name}"


def auto_cast_none(r: Recipe) -> bool:
    """neuronx-cc casts fp32 matmuls to bf16 unless told `--auto-cast none` (its default until SDK 2.26; `none` from
    2.27: compiler release notes, Neuron 2.27.0). Every precision but pure bf16 relies on fp32 matmuls somewhere
    (fp32 weights, bf16-mixed's fp32 master path and loss), so those say it on every SDK, as NxDT does for fp32 and
    autocast precision and neuronx-nemo-megatron for fp32."""
    return r.precision.dtype != "bf16"


def distribution_strategy(r: Recipe) -> bool:
    """`--distribution-strategy llm-training` tells the compiler the optimizer states are sharded over data parallel
    (neuronx-cc reference). AWS's scripts set it on every run up to SDK 2.21 (neuronx-nemo-megatron) and
    neuronx-distributed dropped it from every Llama script, ZeRO-1 ones included, in 2.22 (NxDT 1.2.0 release notes:
    slower with PyTorch 2.5, incompatible with NKI kernels). NxDT's megatron_llama_7B_config.yaml still passes it;
    the NxD scripts are what this trainer follows. So: before 2.22 only."""
    return sdk_version(r.cluster.neuron_sdk) < (2, 22)


ACCUMULATION_DEFAULT_ON = (2, 27)  # neuronx-cc 2.22 (SDK 2.27): mixed-precision accumulation is on by default


def mixed_precision_accumulation_flags(r: Recipe) -> list[str]:
    """compile.mixed_precision_accumulation as neuronx-cc takes it: before SDK 2.27 off unless
    --enable-mixed-precision-accumulation, from 2.27 (neuronx-cc 2.22) on unless --disable-mixed-precision-accumulation
    (compiler release notes, Neuron 2.27.0)."""
    on = r.compile.mixed_precision_accumulation
    if sdk_version(r.cluster.neuron_sdk) < ACCUMULATION_DEFAULT_ON:
        return ["--enable-mixed-precision-accumulation"] if on else []
    return [] if on else ["--disable-mixed-precision-accumulation"]


def neuron_cc_flags(r: Recipe) -> str:
    """NEURON_CC_FLAGS for the recipe's stack. TorchNeuron passes `--model-type transformer --auto-cast=none -O1`
    itself and appends these (torch-neuronx csrc/core/KernelExecution.cpp): there only what it does not set, and no
    --distribution-strategy, which tells torch-xla's graphs how the optimizer is sharded. compile.optlevel other
    than 1 is refused there by the recipe check (TorchNeuron documents no way to change its -O1)."""
    extras = list(FAMILIES[r.model.family].compiler_flags(r.cluster.instance))  # e.g. neox on trn1
    accumulate = mixed_precision_accumulation_flags(r)
    if r.stack == TORCHNEURON:
        return " ".join(accumulate + extras + r.compile.extra_flags)
    flags = ["--model-type", "transformer"]
    flags += ["--distribution-strategy", "llm-training"] if distribution_strategy(r) else []
    flags += [f"--optlevel={r.compile.optlevel}"]
    flags += ["--auto-cast", "none"] if auto_cast_none(r) else []
    return " ".join(flags + accumulate + extras + r.compile.extra_flags)


def bucket_cap_mb(r: Recipe) -> str | None:
    """NxD's trainer (trainer/trainer.py, 0.12 on): 65 MB where master weights are fp32 and XLA_DOWNCAST_BF16 is
    '0' (autocast: this trainer's bf16-mixed), else 130 MB; 0.10/0.11 always 130. Only with ZeRO-1, whose buckets
    it sizes."""
    if not r.layout.zero1:
        return None
    mixed = r.precision.dtype == "bf16-mixed" and sdk_version(r.cluster.neuron_sdk) >= (2, 23)
    return "65" if mixed else "130"


def _const(value: str) -> Callable[[Recipe, Path], str]:
    return lambda _r, _job_dir: value


def _of_recipe(value: Callable[[Recipe], str | None]) -> Callable[[Recipe, Path], str | None]:
    return lambda r, _job_dir: value(r)


# AWS's value for torch-xla's thread pool at 32 workers per node; the default suits one process per host.
_xla_pool_size = _of_recipe(lambda r: "4" if r.workers_per_node >= 32 else None)

# No XLA_USE_BF16 / XLA_DOWNCAST_BF16 (AWS's samples for SDK <= 2.24 set them): the trainer casts the model to bf16
# (precision.dtype bf16) or autocasts (bf16-mixed) itself on every supported SDK, and those variables would also put
# its fp32 state in bf16: AdamW moments, bf16-mixed master weights, and constants (beta2 0.999 rounds to 1.0).
RULES: tuple[EnvRule, ...] = (
    EnvRule(
        "NEURON_CC_FLAGS",
        _of_recipe(neuron_cc_flags),
        "neuronx-cc flags for transformer training; compile.optlevel (AWS's Llama scripts keep the compiler's"
        " default -O2, which the Llama recipes follow; -O1 compiles faster)",
        source=f"{NNM} (--auto-cast none for fp32); {NXDT} (--auto-cast none for fp32 and autocast); neuronx-cc"
        " reference; compiler release notes, Neuron 2.27.0 (--auto-cast default none)",
    ),
    EnvRule(
        "NEURON_CC_FLAGS",
        _of_recipe(lambda r: neuron_cc_flags(r) or None),
        "neuronx-cc flags TorchNeuron appends to its own --model-type transformer --auto-cast=none -O1",
        (TORCHNEURON,),
    ),
    EnvRule(
        "NEURON_COMPILE_CACHE_URL",
        _of_recipe(local_cache_dir),
        "node-local compile cache, per user and job: many writers on a shared FS corrupt and slow it",
    ),
    # Names and defaults (/tmp/neff_cache, /tmp/local_cache) from torch-neuronx's source (PersistentCacheBackend.cpp,
    # CompilationCache.cpp): confirm them in the 2.33 env-var reference (torch/reference/env-vars) on a Trainium host.
    EnvRule(
        "TORCH_NEURONX_NEFF_CACHE_DIR",
        lambda r, job_dir: r.compile.shared_cache_dir or str(job_dir / "neff-cache"),
        "TorchNeuron's compiled graphs on the shared FS (written atomically): compile.sbatch fills it, all nodes read",
        (TORCHNEURON,),
    ),
    EnvRule(
        "TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR",
        _of_recipe(local_cache_dir),
        "TorchNeuron's node-local cache and lock files",
        (TORCHNEURON,),
    ),
    EnvRule(
        "NEURON_LOGICAL_NC_CONFIG",
        _of_recipe(lambda r: "2" if r.cluster.instance.startswith("trn2") else None),
        "trn2: two physical NeuronCores per logical one, the SDK's default, said aloud so the runtime, the compiler"
        " and NxD's TP groups (trnrecipes/parallel/nxd.py reads it) agree with the catalog's 64 workers per node",
    ),
    EnvRule(
        "NEURON_LOGICAL_NC_CONFIG",
        _of_recipe(lambda r: "2" if r.cluster.instance.startswith(("trn2", "trn3")) else None),
        "two physical NeuronCores per logical one, the default on trn2/trn3, said aloud so the runtime and the"
        " compiler agree with the 64 workers per node torchrun starts",
        (TORCHNEURON,),
    ),
    EnvRule("NEURON_FUSE_SOFTMAX", _const("1"), "fused softmax kernel"),
    EnvRule(
        "NEURON_RT_STOCHASTIC_ROUNDING_EN",
        _of_recipe(lambda r: "1" if r.precision.stochastic_rounding else "0"),
        "bf16 stochastic rounding in the runtime (precision.stochastic_rounding)",
    ),
    EnvRule(
        "NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS",
        _of_recipe(lambda r: "7" if r.layout.pp > 1 else "3"),
        "executions the runtime queues ahead of the host (the runtime drops it in SDK 2.31): 7 with pipeline stages,"
        " whose many small graphs per step need a deeper queue (NxD's 70B TP+PP script); 3 otherwise (neuronx-nemo-"
        "megatron's value; NeMo/NxDT use 5)",
        until=(2, 30),
        source=f"{NXD_70B} (7); {NNM} (3); {NXDT_SETUP} (5)",
    ),
    EnvRule(
        "XLA_DISABLE_FUNCTIONALIZATION",
        _of_recipe(lambda r: "0" if r.layout.zero1 else None),
        "keep torch-xla's functionalization with ZeRO-1 (torch-xla's default, said aloud: NxD's 70B script sets 0"
        " with ZeRO-1, 'needed to close 3% convergence gap')",
        source=f"{NXD_70B}; {NXDT_SETUP}",
    ),
    EnvRule(
        "ALL_GATHER_REDUCE_SCATTER_BUCKET_CAP_MB",
        _of_recipe(bucket_cap_mb),
        "ZeRO-1's reduce-scatter / all-gather bucket size, NxD's trainer's rule: 65 MB with fp32 master weights under"
        " bf16 autocast (bf16-mixed) from NxD 0.12 (SDK 2.23), else 130 MB; trnrecipes/parallel/nxd.py reads it",
        source=NXD_TRAINER,
    ),
    EnvRule(
        "NEURON_RT_EXEC_TIMEOUT",
        _const("100"),
        "seconds a device execution may take before the runtime fails it: a hung collective (a dead peer, an EFA"
        " fault) ends the run in under 2 minutes, for a requeue, instead of the runtime's default 600 s on trn1",
        BOTH,
        source=f"{NNM}; NxDT conf neuron_rt_exec_timeout: 100; {RUNTIME_DOCS}",
    ),
    EnvRule(
        "MALLOC_ARENA_MAX",
        _const("64"),
        "bounds glibc's malloc arenas, host memory of 32+ workers per node: 64, as NxD's Llama2-7B script (NeMo, NxDT"
        " and NxD's 70B script use 128): fewer arenas, less host memory held per worker",
        BOTH,
        source=f"{NXD_7B} (64); {NNM} and {NXDT_SETUP} (128)",
    ),
    # torch-xla's thread pools are sized for one process per host; 32 workers per node each with the default pools
    # oversubscribe the host's cores.
    EnvRule(
        "XLA_THREAD_POOL_SIZE",
        _xla_pool_size,
        "torch-xla's compute thread pool per worker, for 32+ workers per node",
        source=f"{NNM} (PROCESSES_PER_NODE=32)",
    ),
    # TorchNeuron's multi-node examples export the same three (torch-neuronx examples/multi_node_tests).
    EnvRule("FI_PROVIDER", _const("efa"), "libfabric over EFA between nodes", BOTH),
    EnvRule("FI_EFA_USE_DEVICE_RDMA", _const("1"), "EFA RDMA straight to device memory", BOTH),
    EnvRule("FI_EFA_FORK_SAFE", _const("1"), "the data loader forks; EFA must survive it", BOTH),
)


def backend_env(r: Recipe, job_dir: Path | None = None) -> list[tuple[str, str, str]]:
    """(name, value, why) exported by both sbatch scripts of the job dir (default: jobs/<job name>), in table order;
    `why` ends with the AWS source where the row has one. Empty off Neuron."""
    if r.cluster.backend != "neuron":
        return []
    stack = r.stack
    version = sdk_version(r.cluster.neuron_sdk)
    job_dir = job_dir or REPO_ROOT / "jobs" / r.job_name
    rows = []
    for rule in RULES:
        if stack in rule.stacks and rule.since <= version <= rule.until:
            value = rule.value(r, job_dir)
            if value is not None:
                rows.append((rule.name, value, rule.why + (f" (AWS: {rule.source})" if rule.source else "")))
    return rows
