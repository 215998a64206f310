"""Recipes: the typed schema, loading by name or path, `key=value` overrides and validation.

A recipe is data (recipes/<family>/<name>.yaml). This module never imports torch: it is on the rendering path.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from trnrecipes import REPO_ROOT
from trnrecipes.cluster import INSTANCES, get_instance
from trnrecipes.schema import SchemaError, from_dict, to_dict

RECIPES_DIR = REPO_ROOT / "recipes"


class RecipeError(ValueError):
    """A recipe, an override or a node count that cannot make a valid job; the message says what would."""


@dataclass(frozen=True)
class ModelConfig:
    family: Literal["neox", "llama2"]
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    ffn_hidden_size: int
    max_seq_len: int
    num_kv_heads: int | None = None  # grouped-query attention (llama2-70b); None = num_heads
    rotary_pct: float = 1.0  # NeoX/Pythia rotate the first 25% of each head
    rotary_base: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    parallel_residual: bool = True  # neox only: x + attn(ln1(x)) + mlp(ln2(x)), as every Pythia and NeoX-20B


@dataclass(frozen=True)
class LayoutConfig:
    tp: int = 1  # tensor parallel degree (inside a node)
    pp: int = 1  # pipeline parallel degree
    sequence_parallel: bool = False  # shard norms/dropout activations along the sequence over the TP group


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
    decay_norms_and_biases: bool = True  # seed 002 decays every parameter, norms included
    clip_grad_norm: float = 1.0


@dataclass(frozen=True)
class TrainConfig:
    max_steps: int
    seed: int = 1234
    log_every: int = 1
    val_every: int = 1000
    val_batches: int = 8
    init_from: str | None = None  # a trnrecipes checkpoint to fine-tune from (HF models: `convert from-hf` first)


@dataclass(frozen=True)
class PrecisionConfig:
    dtype: Literal["fp32", "bf16-mixed", "bf16"] = "fp32"  # bf16-mixed keeps fp32 master weights
    stochastic_rounding: bool = False  # bf16 only: on Neuron the runtime flag, elsewhere done in software


@dataclass(frozen=True)
class DataConfig:
    format: Literal["arrow", "megatron"]
    path: str  # Arrow file, or Megatron .bin/.idx prefix; relative to the repository root
    tokenizer: str  # tokenizer directory; relative to the repository root
    text_field: str = "text"
    val_fraction: float = 0.01


@dataclass(frozen=True)
class CheckpointConfig:
    every_steps: int = 1000
    every_minutes: float | None = None  # also save when this much wall time passed since the last save
    keep_last: int = 3
    async_save: bool = True
    resume: bool = True  # start from the newest complete checkpoint in the run dir if there is one
    # resume false on a run dir with checkpoints is refused; force_fresh moves them (and the metrics) to
    # RUN_DIR/archived/<time>/ first. Each requeue of such a job starts over again: it is for one-off runs.
    force_fresh: bool = False
    # Recipe keys (or sections) that may differ from the checkpoint's on resume, e.g. [optim.lr]; the model's shape
    # never may (trnrecipes.train.resume_compat lists what is free to change and what needs naming here).
    allow_changes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class CompileConfig:
    steps: int = 4  # steps compile.sbatch traces (with one validation and one checkpoint pass)
    optlevel: Literal[1, 2, 3] = 1
    mixed_precision_accumulation: bool = True
    cache_dir: str = "/var/tmp/neuron-compile-cache"  # node-local; never the shared file system
    extra_flags: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ClusterConfig:
    instance: str
    backend: Literal["neuron", "xla", "cuda", "cpu"]
    nodes: int = 1
    neuron_sdk: str = "2.26"  # keys the Neuron env/flag table (trnrecipes.neuron_env)
    workers_per_node: int | None = None  # None = the instance's (32 NeuronCores on trn1.32xlarge)
    price_per_hour: float | None = None  # None = the catalog's on-demand price
    python: str | None = None  # interpreter on the nodes; None = <repo>/.venv/bin/python


@dataclass(frozen=True)
class SlurmConfig:
    job_name: str | None = None  # None = <recipe>-<nodes>n
    partition: str | None = None
    account: str | None = None
    time_limit: str | None = None  # [D-]HH:MM:SS
    signal_seconds: int = 300  # the pre-timeout signal comes this long before the limit (Slurm: up to 60 s early)
    max_restarts: int = 3  # requeues after a pre-timeout save


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    model: ModelConfig
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
    run_dir: str | None = None  # None = runs/<job name>; relative to the repository root

    @property
    def job_name(self) -> str:
        return self.slurm.job_name or f"{self.name}-{self.cluster.nodes}n"

    @property
    def workers_per_node(self) -> int:
        return self.cluster.workers_per_node or get_instance(self.cluster.instance).workers_per_node

    @property
    def price_per_hour(self) -> float:
        if self.cluster.price_per_hour is not None:
            return self.cluster.price_per_hour
        return get_instance(self.cluster.instance).price_per_hour

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)


def known_recipes() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for path in sorted(RECIPES_DIR.glob("*/*.yaml")):
        found.setdefault(path.stem, path)
    return found


def find_recipe(name_or_path: str) -> Path:
    known = known_recipes()
    if name_or_path in known:
        return known[name_or_path]
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path
    raise RecipeError(f"unknown recipe {name_or_path!r}; known recipes: {', '.join(known)} (or a path to a .yaml file)")


def parse_nodes(text: str | int) -> int:
    value = str(text).strip()
    if not re.fullmatch(r"[0-9]+", value) or int(value) < 1:
        raise RecipeError(f"nodes must be a positive whole number, got {str(text)!r}")
    return int(value)


def parse_overrides(items: list[str] | str | None) -> list[tuple[str, Any]]:
    """`optim.lr=1e-4 slurm.partition=train` -> [(dotted key, YAML-typed value)]. A string is split like a shell."""
    if items is None:
        return []
    if isinstance(items, str):
        items = shlex.split(items)
    parsed = []
    for item in items:
        key, sep, raw = item.partition("=")
        if any(ord(c) < 32 for c in item):
            raise RecipeError(f"override {item!r} contains a control character (newline, tab, ...)")
        if not sep or not re.fullmatch(r"[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)*", key):
            raise RecipeError(f"override {item!r} is not of the form section.key=value (e.g. optim.lr=1e-4)")
        parsed.append((key, _typed_value(key, raw)))
    return parsed


def _typed_value(key: str, raw: str) -> Any:
    """Text for string fields, verbatim (`cluster.neuron_sdk=2.20` must not become the number 2.2); YAML elsewhere,
    so `optim.betas=[0.9,0.95]` is a list and `layout.sequence_parallel=false` a bool."""
    tp: Any = Recipe
    for part in key.split("."):
        hints = typing.get_type_hints(tp) if dataclasses.is_dataclass(tp) else {}
        if part not in hints:
            tp = None
            break
        tp = hints[part]
    optional = typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp)
    if optional and raw in ("null", "~"):
        return None  # `slurm.partition=null` clears it
    if tp is str or (typing.get_origin(tp) in (typing.Union, types.UnionType) and str in typing.get_args(tp)):
        return raw
    try:
        return yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError:
        return raw  # not YAML: keep the text; the schema says whether text is valid there


def _apply_override(data: dict[str, Any], key: str, value: Any) -> None:
    node = data
    *parents, leaf = key.split(".")
    for i, part in enumerate(parents):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise RecipeError(f"override {key}: {'.'.join(parents[: i + 1])} is not a section")
        node = child
    node[leaf] = value


def load_recipe(name_or_path: str, nodes: int | str | None = None, overrides: list[str] | str | None = None) -> Recipe:
    path = find_recipe(name_or_path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise RecipeError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: expected a mapping at the top level")
    for key, value in parse_overrides(overrides):
        _apply_override(data, key, value)
    if nodes is not None:
        _apply_override(data, "cluster.nodes", parse_nodes(nodes))
    return recipe_from_dict(data, path.name)


def recipe_from_dict(data: dict[str, Any], source: str) -> Recipe:
    """Typed and checked; `source` names the origin in error messages."""
    try:
        recipe = from_dict(Recipe, data)
    except SchemaError as err:
        raise RecipeError(f"recipe {source}:\n  " + "\n  ".join(err.problems)) from None
    problems = check_recipe(recipe)
    if problems:
        raise RecipeError(f"recipe {source}:\n  " + "\n  ".join(problems))
    return recipe


# Values that land in #SBATCH lines, which sbatch parses itself: no shell quoting can protect them, so they must
# be plain words.
_SLURM_WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_SLURM_TIME = re.compile(r"([0-9]+-)?[0-9]{1,2}:[0-9]{2}:[0-9]{2}")
_SDK_VERSION = re.compile(r"2\.[0-9]{1,2}")


def check_recipe(r: Recipe) -> list[str]:
    """Semantic checks the types cannot express. Layout divisibility needs the node count: trnrecipes.layout."""
    from trnrecipes.neuron_env import SUPPORTED_SDK, sdk_version

    problems: list[str] = []

    def need(ok: bool, message: str) -> None:
        if not ok:
            problems.append(message)

    m, b, o = r.model, r.batch, r.optim
    positive = {
        "model.vocab_size": m.vocab_size, "model.hidden_size": m.hidden_size, "model.num_layers": m.num_layers,
        "model.num_heads": m.num_heads, "model.ffn_hidden_size": m.ffn_hidden_size,
        "model.max_seq_len": m.max_seq_len, "layout.tp": r.layout.tp, "layout.pp": r.layout.pp,
        "batch.global_batch": b.global_batch, "batch.micro_batch": b.micro_batch, "batch.seq_len": b.seq_len,
        "train.max_steps": r.train.max_steps, "train.log_every": r.train.log_every,
        "checkpoint.every_steps": r.checkpoint.every_steps, "checkpoint.keep_last": r.checkpoint.keep_last,
        "compile.steps": r.compile.steps, "cluster.nodes": r.cluster.nodes,
    }  # fmt: skip
    for key, value in positive.items():
        need(value > 0, f"{key}: must be > 0, got {value}")
    if problems:
        return problems
    need(
        m.hidden_size % m.num_heads == 0,
        f"model.hidden_size {m.hidden_size} is not divisible by num_heads {m.num_heads}",
    )
    kv = m.num_kv_heads if m.num_kv_heads is not None else m.num_heads
    if kv <= 0:
        return [*problems, f"model.num_kv_heads: must be > 0, got {kv}"]
    need(m.num_heads % kv == 0, f"model.num_kv_heads {kv} must divide num_heads {m.num_heads}")
    need(0.0 < m.rotary_pct <= 1.0, f"model.rotary_pct must be in (0, 1], got {m.rotary_pct}")
    need(b.seq_len <= m.max_seq_len, f"batch.seq_len {b.seq_len} exceeds model.max_seq_len {m.max_seq_len}")
    tp = r.layout.tp
    need(m.num_heads % tp == 0, f"layout.tp {tp} must divide model.num_heads {m.num_heads}")
    if m.family == "llama2":  # each rank holds whole KV groups (recipes/llama2/parallelize.py)
        need(kv % tp == 0, f"layout.tp {tp} must divide model.num_kv_heads {kv}")
    need(m.ffn_hidden_size % tp == 0, f"layout.tp {tp} must divide model.ffn_hidden_size {m.ffn_hidden_size}")
    need(m.vocab_size % tp == 0, f"layout.tp {tp} must divide model.vocab_size {m.vocab_size} (vocab-parallel)")
    need(
        not r.layout.sequence_parallel or b.seq_len % tp == 0,
        f"batch.seq_len {b.seq_len} must be divisible by layout.tp {tp} with sequence parallelism",
    )
    need(m.num_layers % r.layout.pp == 0, f"layout.pp {r.layout.pp} must divide model.num_layers {m.num_layers}")
    need(not r.layout.sequence_parallel or r.layout.tp > 1, "layout.sequence_parallel needs layout.tp > 1")
    need(0.0 <= o.min_lr <= o.lr, f"optim.min_lr {o.min_lr} must be between 0 and optim.lr {o.lr}")
    need(o.warmup_steps >= 0 and o.decay_steps >= 0, "optim.warmup_steps and optim.decay_steps must be >= 0")
    need(all(0.0 <= beta < 1.0 for beta in o.betas), f"optim.betas must be in [0, 1), got {list(o.betas)}")
    need(0.0 <= r.data.val_fraction < 1.0, f"data.val_fraction must be in [0, 1), got {r.data.val_fraction}")
    need(
        not r.precision.stochastic_rounding or r.precision.dtype == "bf16",
        f"precision.stochastic_rounding needs precision.dtype 'bf16', got {r.precision.dtype!r}",
    )
    need(r.cluster.instance in INSTANCES, f"cluster.instance {r.cluster.instance!r}: known: {', '.join(INSTANCES)}")
    if r.cluster.instance in INSTANCES:
        allowed = INSTANCES[r.cluster.instance].backends
        need(
            r.cluster.backend in allowed,
            f"cluster.backend {r.cluster.backend!r} does not run on {r.cluster.instance}; valid: {', '.join(allowed)}",
        )
    if r.cluster.backend == "neuron":
        lo, hi = SUPPORTED_SDK
        ok = bool(_SDK_VERSION.fullmatch(r.cluster.neuron_sdk)) and lo <= sdk_version(r.cluster.neuron_sdk) <= hi
        need(ok, f"cluster.neuron_sdk {r.cluster.neuron_sdk!r}: supported 2.{lo[1]} to 2.{hi[1]}")
    need(r.cluster.workers_per_node is None or r.cluster.workers_per_node > 0, "cluster.workers_per_node must be > 0")
    need(r.cluster.price_per_hour is None or r.cluster.price_per_hour >= 0, "cluster.price_per_hour must be >= 0")
    need(
        Path(r.compile.cache_dir).is_absolute() and is_plain_path(r.compile.cache_dir),
        f"compile.cache_dir {r.compile.cache_dir!r} must be an absolute node-local path (e.g. /var/tmp/...):"
        " a relative one would land on the shared file system the job is submitted from",
    )
    for flag in r.compile.extra_flags:
        need(re.fullmatch(r"-[-A-Za-z0-9_=.,:/+]+", flag) is not None, f"compile.extra_flags: bad flag {flag!r}")
    for key in ("job_name", "partition", "account"):
        value = getattr(r.slurm, key)
        need(
            value is None or bool(_SLURM_WORD.fullmatch(value)),
            f"slurm.{key} {value!r}: use letters, digits, '.', '_' and '-' only (it goes into an #SBATCH line)",
        )
    need(
        _SLURM_WORD.fullmatch(r.name) is not None,
        f"name {r.name!r}: use letters, digits, '.', '_' and '-' only (it names the job and its directories)",
    )
    t = r.slurm.time_limit
    need(t is None or bool(_SLURM_TIME.fullmatch(t)), f"slurm.time_limit {t!r}: expected [D-]HH:MM:SS")
    need(r.slurm.signal_seconds >= 60, f"slurm.signal_seconds must be >= 60, got {r.slurm.signal_seconds}")
    if t is not None and _SLURM_TIME.fullmatch(t):
        need(
            _seconds(t) > r.slurm.signal_seconds + 300,
            f"slurm.time_limit {t} leaves no time to train before the pre-timeout signal"
            f" ({r.slurm.signal_seconds} s before the end); use more than {r.slurm.signal_seconds + 300} s",
        )
    need(r.slurm.max_restarts >= 0, f"slurm.max_restarts must be >= 0, got {r.slurm.max_restarts}")
    from trnrecipes.train.resume_compat import check_allow_changes  # torch-free; it imports this module

    problems += check_allow_changes(r.checkpoint.allow_changes)
    return problems


def _seconds(time_limit: str) -> int:
    days, _, clock = time_limit.rpartition("-")
    h, m, s = (int(x) for x in clock.split(":"))
    return (int(days) if days else 0) * 86400 + h * 3600 + m * 60 + s


def is_plain_path(text: str) -> bool:
    """Letters, digits and . _ / + - only: safe where no shell quoting applies (#SBATCH lines, NEURON flags)."""
    return re.fullmatch(r"[A-Za-z0-9._/+-]+", text) is not None
