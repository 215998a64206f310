"""A recipe's sections as typed, frozen dataclasses (the schema a recipe file is read into) and RecipeError.

Imports only the schema toolkit, the instance catalog, the stacks and the family registry (all in config/); loading
and validation are recipe.py's, which imports this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from trnrecipes.config.cluster import get_instance
from trnrecipes.config.families import ModelSection, model_config
from trnrecipes.config.stacks import STACKS, neuron_stack
from trnrecipes.schema import to_dict


class RecipeError(ValueError):
    """A recipe, an override or a node count that cannot make a valid job; the message says what would.
    run.sbatch never requeues a job that stops on one (the same input fails the same way), except where
    `may_pass` says a requeue may pass it (a node's fault, a flaky read)."""

    may_pass = False


class NodeError(RecipeError):
    """This node cannot run the job (no device where the recipe needs one): a requeue on other nodes may pass."""

    may_pass = True


# The model section is its family's own config dataclass (recipes/<family>/spec.py), picked by model.family.
# ModelConfig(family=..., **fields) builds one: the name the single merged class had (bench/ still calls it).
ModelConfig = model_config


@dataclass(frozen=True)
class LayoutConfig:
    tp: int = 1  # tensor parallel degree (inside a node)
    pp: int = 1  # pipeline parallel degree (trnrecipes/config/stages.py: how the layers are split)
    pp_schedule: Literal["1f1b", "gpipe", "interleaved_1f1b"] = "1f1b"  # micro-batches = grad-accum steps
    pp_virtual_stages: int = 1  # stages per pipeline rank (> 1: interleaved_1f1b)
    pp_stage_layers: tuple[int, ...] | None = None  # layers of each stage, in order; default: an even split
    sequence_parallel: bool = False  # shard norms/dropout activations along the sequence over the TP group
    zero1: bool = False  # ZeRO-1: optimizer states sharded over the data-parallel group (AWS's zero1 / USE_ZERO_1)
    # FSDP2 (torch's fully_shard): parameters, gradients and optimizer states sharded over the data-parallel group;
    # cpu and cuda. Checkpoints are the same files as without it.
    fsdp: bool = False
    # Expert parallelism: a mixture of experts' experts shared out over groups of ep consecutive data-parallel ranks
    # (trnrecipes/parallel/expert.py); ep divides the data-parallel degree and the number of experts.
    ep: int = 1
    # Context parallelism: each sequence split over cp ranks, every one holding 2 of its 2 x cp chunks (the front and
    # the back: causal load balancing) and attending over the whole sequence (trnrecipes/parallel/context.py).
    # world = pp x dp x cp x tp; cpu, cuda and TorchNeuron.
    cp: int = 1


@dataclass(frozen=True)
class BatchConfig:
    global_batch: int  # sequences per optimizer step, over all data-parallel ranks
    micro_batch: int  # sequences per forward/backward on one worker
    seq_len: int


@dataclass(frozen=True)
class OptimConfig:
    lr: float
    min_lr: float
    warmup_steps: int
    decay_steps: int
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    decay_norms_and_biases: bool = True  # the 128-node Llama 2 post decays every parameter, norms included
    clip_grad_norm: float = 1.0
    # AdamW's two moments: fp32 (8 bytes a parameter) or bf16 (4: torch's own choice for bf16 parameters), updated in
    # fp32 and rounded back (stochastically where precision.stochastic_rounding rounds the weights in software). bf16
    # moments lose small updates of the second moment when beta2 is close to 1 (0.999: 0.1% a step, under bf16's
    # 0.4% resolution); with betas[1] 0.95 (the recipes here) each step moves it 5%.
    state_dtype: Literal["fp32", "bf16"] = "fp32"


@dataclass(frozen=True)
class TrainConfig:
    max_steps: int
    seed: int = 1234
    log_every: int = 1
    val_every: int = 1000
    val_batches: int = 8
    init_from: str | None = None  # a trnrecipes checkpoint to fine-tune from (HF models: `convert from-hf` first)
    # With init_from: "reset" starts fresh Adam moments (the default: fine-tuning or continuing on new data, whose
    # gradients the old moments do not describe, and the LR schedule restarts with them); "keep" carries the
    # checkpoint's moments and step count over (incremental training on more of the same data, M5-style).
    init_optimizer: Literal["reset", "keep"] = "reset"
    # torch.compile each transformer block (trnrecipes/parallel/compile.py). None: on for cuda without PP; off for cpu,
    # where compiling outlasts a short run, and for TorchNeuron (eager with Adaptive Eager Execution; true compiles
    # with backend "neuron"); xla and XLA/NxD compile their graphs anyway and refuse true.
    # Not the Neuron ahead-of-time `compile` section below, which is the compile job.
    compile: bool | None = None


# monitor.trackers -> (the module it imports, the package that brings it): MLflow's local store needs SQLAlchemy and
# alembic. The tracking extra installs them; train/trackers.py and `doctor` check them.
TRACKER_PACKAGES = {
    "mlflow": (("mlflow", "mlflow-skinny"), ("sqlalchemy", "SQLAlchemy"), ("alembic", "alembic")),
    "wandb": (("wandb", "wandb"),),
}


@dataclass(frozen=True)
class MonitorConfig:
    # Where each step's metrics go besides metrics.jsonl and the console (global rank 0 only): tensorboard writes
    # RUN_DIR/tensorboard/; mlflow to MLFLOW_TRACKING_URI, else sqlite:///RUN_DIR/mlflow.db; wandb in WANDB_MODE's
    # mode (offline where unset: RUN_DIR/wandb/). mlflow and wandb need the tracking extra (train/trackers.py).
    trackers: tuple[Literal["tensorboard", "mlflow", "wandb"], ...] = ("tensorboard",)
    mlflow_experiment: str | None = None  # the MLflow experiment the run goes in (null: the recipe's name)
    wandb_project: str | None = None  # the W&B project (null: the recipe's name); WANDB_ENTITY picks the entity
    # The steps profiled, [first, last] (1-based, inclusive; null: none). cpu, cuda and TorchNeuron: torch.profiler's
    # Chrome trace per profiled rank in RUN_DIR/profile/. torch-xla + NxD: the Neuron runtime's own capture
    # (NEURON_RT_INSPECT_*, set by run.sbatch) of the graphs' executions from step `first`
    # (trnrecipes/train/profile.py). A few steps after the first: the first steps build and compile graphs.
    profile_steps: tuple[int, int] | None = None
    # Which ranks profile: the first of each node (global rank 0 among them), or every rank (large traces).
    profile_ranks: Literal["per-node", "all"] = "per-node"


@dataclass(frozen=True)
class PrecisionConfig:
    dtype: Literal["fp32", "bf16-mixed", "bf16"] = "fp32"  # bf16-mixed keeps fp32 master weights
    stochastic_rounding: bool = False  # bf16 only: on Neuron the runtime flag, elsewhere done in software


@dataclass(frozen=True)
class DataSource:
    """One corpus of a blend (data.sources): its share of the training samples is weight / sum of weights."""

    path: str
    weight: float
    format: Literal["arrow", "megatron"] | None = None  # None: data.format
    text_field: str | None = None  # None: data.text_field


@dataclass(frozen=True)
class DataConfig:
    format: Literal["arrow", "megatron"]
    tokenizer: str  # tokenizer directory; relative to the repository root
    path: str | None = None  # Arrow file, or Megatron .bin/.idx prefix; relative to the repository root
    # Several corpora blended by weight (trnrecipes/data/blend.py), instead of data.path; each has its own split
    # (data.val_fraction) and its own epochs, and validation draws from each by the same weights.
    sources: list[DataSource] = field(default_factory=list)
    text_field: str = "text"
    label_field: str = "label"  # classification families (model.family bert): the integer class-id column
    eval_path: str | None = None  # classification: a labelled holdout file eval.sbatch scores (`trnrecipes predict`)
    val_fraction: float = 0.01

    def corpora(self) -> list[DataSource]:
        """Every corpus the run reads, data.path being one source of weight 1, with format and text_field filled."""
        listed = self.sources or ([DataSource(self.path, 1.0)] if self.path is not None else [])
        return [
            DataSource(
                s.path,
                s.weight,
                self.format if s.format is None else s.format,
                self.text_field if s.text_field is None else s.text_field,
            )
            for s in listed
        ]


@dataclass(frozen=True)
class CheckpointConfig:
    every_steps: int = 1000
    every_minutes: float | None = None  # also save when this much wall time passed since the last save
    keep_last: int = 3
    async_save: bool = True
    resume: bool = True  # start from the newest complete checkpoint in the run dir if there is one
    # resume false on a run dir with checkpoints is refused; force_fresh moves them (and the metrics) to
    # RUN_DIR/archived/<time>/ first. A requeue or auto-resume of the job that did so resumes (train/run_dir.py).
    force_fresh: bool = False
    # Recipe keys (or sections) that may differ from the checkpoint's on resume, e.g. [optim.lr]; the model's shape
    # never may (trnrecipes.train.resume_compat lists what is free to change and what needs naming here).
    allow_changes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class CompileConfig:
    steps: int = 4  # steps compile.sbatch traces (with one validation and one checkpoint pass)
    optlevel: Literal[1, 2, 3] = 1
    mixed_precision_accumulation: bool = True
    # Node-local; never the shared file system. None: /var/tmp/neuron-compile-cache-<user>/<job name>, so users and
    # jobs never share a cache dir (the SDK's default, /var/tmp/neuron-compile-cache, is one per node for everyone).
    cache_dir: str | None = None
    # TorchNeuron only: the NEFF cache the compile job fills and every node of the run reads (shared FS; TorchNeuron
    # writes its entries atomically). None: <job dir>/neff-cache. cache_dir is then its node-local lock directory.
    shared_cache_dir: str | None = None
    extra_flags: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class PublishedConfig:
    """How the run behind a quoted throughput (cluster.throughput_source) was configured, as its source states it:
    each field its value there, "not published" where the source omits it, None where not recorded. `plan` names
    every field where the recipe trains otherwise (trnrecipes.plan.published)."""

    sdk: str | None = None
    precision: str | None = None  # bf16 | bf16-mixed | fp32
    stochastic_rounding: str | None = None  # true | false
    attention: str | None = None  # sdpa | nki_flash
    optlevel: str | None = None
    mixed_precision_accumulation: str | None = None  # true | false
    tp: str | None = None
    pp: str | None = None
    zero1: str | None = None
    sequence_parallel: str | None = None
    activation_checkpointing: str | None = None
    seq_len: str | None = None
    global_batch: str | None = None


@dataclass(frozen=True)
class ClusterConfig:
    instance: str
    backend: Literal["neuron", "xla", "cuda", "cpu"]
    nodes: int = 1
    # Selects the Neuron stack (trnrecipes.config.stacks: 2.21-2.28 torch-xla + NxD, 2.33 TorchNeuron) and keys its
    # env/flag table (trnrecipes.jobs.neuron_env).
    neuron_sdk: str = "2.26"
    workers_per_node: int | None = None  # None = the instance's (32 NeuronCores on trn1.32xlarge)
    price_per_hour: float | None = None  # None = the catalog's on-demand price
    python: str | None = None  # interpreter on the nodes; None = the TorchNeuron DLAMI's venv there, else <repo>/.venv
    # A measured or published throughput for this recipe and instance: `plan` gives the run's time and cost from it
    # when no --seq-per-s is given, and shows throughput_source beside it (where the number comes from).
    tokens_per_s_per_node: float | None = None
    throughput_source: str | None = None
    throughput_config: PublishedConfig | None = None  # the quoted run's configuration (every quoted number has one)
    throughput_differs: list[str] = field(default_factory=list)  # its fields this recipe knowingly trains otherwise
    # Where nothing is published for this instance (trn2/trn3): the recipe with a published throughput (on trn1) of
    # the closest model, whose MFU `plan` applies to this instance's peak for a labelled estimate.
    estimate_from: str | None = None
    # Mean time between failures of one node: ~270 days from "The Llama 3 Herd of Models", section 3.3.4 (419
    # unexpected interruptions in 54 days on 2,048 nodes). `plan`'s failure model (trnrecipes.plan.run_model).
    node_mtbf_hours: float = 6480.0


@dataclass(frozen=True)
class SlurmConfig:
    job_name: str | None = None  # None = <recipe>-<nodes>n
    partition: str | None = None
    account: str | None = None
    time_limit: str | None = None  # [D-]HH:MM:SS; unset: the partition's limit, and no pre-timeout save if none
    # The pre-timeout signal comes this long before the limit (Slurm: up to 60 s early). None: long enough to write
    # the checkpoint at checkpoint_write_gbps (trnrecipes.config.preemption).
    signal_seconds: int | None = None
    checkpoint_write_gbps: float = 1.0  # GB/s the whole job writes a checkpoint at (the shared file system's rate)
    # Requeues after a failure (a crash, a failed health check; deterministic failures such as bad input are never
    # requeued). Requeues after a pre-timeout save are progress and not counted.
    max_restarts: int = 3
    # What one automatic recovery costs before training goes on (requeue, allocation, start-up, loading the checkpoint,
    # cached compile): `plan`'s failure model. Lost steps since the last save come on top.
    restart_minutes: float = 10.0
    log_all_ranks: bool = False  # every worker's output in the job log; default: each node's local rank 0 only
    # SageMaker HyperPod: its `srun --auto-resume=1` replaces a failed node and restarts the training step itself, and
    # run.sbatch then requeues nothing after a failure (one restart mechanism). null (auto): when
    # /opt/sagemaker_cluster exists on the node running the script, as AWS's HyperPod examples decide; true, false.
    hyperpod: bool | None = None


@dataclass(frozen=True)
class EvalJobConfig:
    """eval.sbatch's (and infer.sbatch's) own Slurm settings: scoring runs as one process on one node, on its GPU when
    it has one, else on its host CPUs (lm-eval has no Neuron backend), so it need not hold a training node."""

    partition: str | None = None  # None: slurm.partition; a CPU or GPU partition keeps trn1 nodes for training
    account: str | None = None  # None: slurm.account
    time_limit: str | None = None  # [D-]HH:MM:SS; None: the partition's
    cpus: int | None = None  # --cpus-per-task; None: Slurm's default
    mem_gb: int | None = None  # --mem; None: the model in fp32 (4 B a parameter) + 8 GB for lm-eval; 0: no --mem
    gpus: int = 0  # --gpus-per-node; 0: none requested
    exclusive: bool = False  # the whole node (as training is); off by default: the job shares it


@dataclass(frozen=True)
class K8sConfig:
    """`trnrecipes k8s`'s settings: the Kubeflow PyTorchJob it writes (trnrecipes/jobs/k8s.py). Slurm ignores them."""

    image: str | None = None  # None: AWS's Neuron training container for cluster.neuron_sdk, where one is published
    pvc: str | None = None  # the PersistentVolumeClaim (FSx for Lustre) holding the checkout, job and run dirs
    # Where the pods mount the claim's root: where the same file system is mounted here, so the checkout, the job dir
    # and the run dir have the same paths in the pods (all three must be under it).
    mount: str = "/fsx"
    namespace: str = "default"
    service_account: str | None = None  # None: the namespace's default service account


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    model: ModelSection
    batch: BatchConfig
    optim: OptimConfig
    train: TrainConfig
    data: DataConfig
    cluster: ClusterConfig
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    eval: EvalJobConfig = field(default_factory=EvalJobConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    k8s: K8sConfig = field(default_factory=K8sConfig)
    run_dir: str | None = None  # None = runs/<job name>; relative to the repository root

    @property
    def job_name(self) -> str:
        return self.slurm.job_name or f"{self.name}-{self.cluster.nodes}n"

    @property
    def workers_per_node(self) -> int:
        return self.cluster.workers_per_node or get_instance(self.cluster.instance).workers_per_node

    @property
    def price_per_hour(self) -> float | None:
        """Per node; None where the catalog has no price and the recipe sets none."""
        if self.cluster.price_per_hour is not None:
            return self.cluster.price_per_hour
        return get_instance(self.cluster.instance).price_per_hour

    @property
    def stack(self) -> str:
        """The software stack that trains it: xla-nxd or torchneuron on backend neuron (trnrecipes.config.stacks), else
        the backend's name. Only for a recipe that passed check_recipe."""
        c = self.cluster
        return neuron_stack(c.instance, c.neuron_sdk).name if c.backend == "neuron" else c.backend

    @property
    def runtime_backend(self) -> str:
        """The trnrecipes.backends name that trains it: cluster.backend, or its Neuron stack's (neuron-native on
        TorchNeuron)."""
        stack = STACKS.get(self.stack)
        return stack.runtime_backend if stack else self.cluster.backend

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)
