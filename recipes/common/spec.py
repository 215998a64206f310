"""What a model family is to the rest of the project: one FamilySpec per recipes/<family>/spec.py (torchtitan's
ModelSpec is the model). Torch-free: rendering (`trnrecipes plan`, `sbatch`) reads specs and must not load torch.

A family's config dataclass is both the recipe's `model:` section and its model.py's constructor argument. Its
first field is `family: Literal["<name>"]` (the schema picks the class by it), and it provides:
    layer_params() -> int                  exact parameters of one of model.layers
    layer_params_at(i) -> int              those of block i, where blocks differ (default: layer_params())
    norm_head_params() -> int              exact parameters of the final norm and the head
    flops_per_token(seq_len) -> int        training FLOPs per token
    problems() -> list[str]                relations between its fields, once every bound in `bounds` holds
    tp_problems(tp) -> list[str]           the tensor parallel rule: what `tp` must divide
DecoderConfig adds embedding_params() (the token embedding) and param_count() = embedding + each layer's +
norm and head, the one parameter count (tests/test_families.py checks each part against model.py's modules;
`plan` sums the parts each pipeline stage holds).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Literal

from trnrecipes.schema import NON_NEGATIVE, POSITIVE, Bound

# activation checkpointing (trnrecipes/parallel/activation_checkpointing.py): nothing; core attention; the elementwise
# ops of each layer (norms, RoPE, SwiGLU, residuals: matmul and attention outputs kept); each layer whole
CHECKPOINTING = ("none", "selective", "elementwise", "full")
# Ranges of the fields every decoder family has; a family adds its own (a field without a bound fails a test).
DECODER_BOUNDS: dict[str, Bound] = {
    "vocab_size": POSITIVE, "hidden_size": POSITIVE, "num_layers": POSITIVE, "num_heads": POSITIVE,
    "ffn_hidden_size": POSITIVE, "max_seq_len": POSITIVE, "rotary_base": POSITIVE, "norm_eps": POSITIVE,
    "init_std": POSITIVE, "activation_checkpointing_full_layers": NON_NEGATIVE,
}  # fmt: skip


@dataclass(frozen=True)
class DecoderConfig:
    """The fields every decoder family has, in recipe order. A family's config subclasses it, redefines `family` as
    its Literal (a redefined field keeps its place: first) and adds its own fields, each with a default."""

    family: str = field(default="", kw_only=True)
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    ffn_hidden_size: int
    max_seq_len: int

    def __post_init__(self) -> None:
        checkpointing = getattr(self, "activation_checkpointing", "none")
        if checkpointing not in CHECKPOINTING:  # recipes: the schema's Literal says it first
            raise ValueError(f"activation_checkpointing must be one of {CHECKPOINTING}, not {checkpointing!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def embedding_params(self) -> int:
        """The token embedding (model.embed; untied from the head in every family here)."""
        return self.vocab_size * self.hidden_size

    def layer_params(self) -> int:
        """One of model.layers; the family defines it."""
        raise NotImplementedError(f"{type(self).__name__} must define layer_params()")

    def layer_params_at(self, layer: int) -> int:
        """Block `layer` of model.layers: layer_params() unless the family's blocks differ (Qwen3-MoE's sparse ones)."""
        return self.layer_params()

    def norm_head_params(self) -> int:
        """The final norm and the head (model.norm, model.head); the family defines it."""
        raise NotImplementedError(f"{type(self).__name__} must define norm_head_params()")

    def param_count(self) -> int:
        """Exact parameters of model.py's model: the parts a pipeline stage may hold, summed (one definition)."""
        layers = sum(self.layer_params_at(i) for i in range(self.num_layers))
        return self.embedding_params() + layers + self.norm_head_params()


@dataclass(frozen=True)
class ModelParts:
    """A family's top-level structure, by attribute name: what pipeline parallelism cuts the model along
    (trnrecipes/parallel/pipeline.py). The forward must be embedding -> each layer in order -> norm -> head (+ loss)."""

    embedding: str = "embed"
    layers: str = "layers"  # an nn.ModuleList of blocks, each taking and returning the hidden states
    norm: str = "norm"
    head: str = "head"


def no_compiler_flags(instance: str) -> tuple[str, ...]:
    return ()


@dataclass(frozen=True)
class FamilySpec:
    name: str  # model.family in a recipe
    config: type  # the model section's dataclass (see the module docstring)
    bounds: Mapping[str, Bound]  # every numeric field of `config` -> its valid range
    model_class: str  # the nn.Module in recipes/<name>/model.py, built from a `config`
    hf_architectures: tuple[str, ...]  # config.json "architectures" that recipes/<name>/hf.py converts
    hf_model_type: str  # config.json "model_type"
    # Extra neuronx-cc flags this family needs on an instance type (trnrecipes.jobs.neuron_env adds them).
    compiler_flags: Callable[[str], tuple[str, ...]] = no_compiler_flags
    parts: ModelParts = ModelParts()  # the top-level structure pipeline stages are cut along
    # What the trainer feeds the model and scores: next-token prediction over packed text, or one class per
    # sequence (trnrecipes/data/classify.py: padded samples, labels, accuracy).
    objective: Literal["causal_lm", "classification"] = "causal_lm"

    @property
    def package(self) -> str:
        return f"recipes.{self.name}"

    # The torch side, imported only when used: model.py, parallelize.py (the TP plan: COLUMN_PARALLEL,
    # ROW_PARALLEL, NORMS, BRANCHES, check_tensor_parallel) and hf.py (the HF adapter).
    @property
    def model_module(self) -> ModuleType:
        return importlib.import_module(f"{self.package}.model")

    @property
    def parallel_plan(self) -> ModuleType:
        return importlib.import_module(f"{self.package}.parallelize")

    @property
    def hf(self) -> ModuleType:
        return importlib.import_module(f"{self.package}.hf")


def training_flops_per_token(config: Any, seq_len: int) -> int:
    """PaLM appendix B: 6N + 12 L H Q T (N all parameters, attention scores included)."""
    head_dim = config.hidden_size // config.num_heads
    return 6 * config.param_count() + 12 * config.num_layers * config.num_heads * head_dim * seq_len


def check_tensor_parallel(config: Any, tp: int) -> None:
    """The family's TP rule, raised: training's last check before sharding (recipes are checked at render time)."""
    problems = config.tp_problems(tp)
    if problems:
        raise ValueError("; ".join(problems))


_WHY = {"vocab_size": " (vocab-parallel embedding and head)", "num_kv_heads": " (each rank holds whole KV groups)"}


def divides(tp: int, config: Any, *fields: str) -> list[str]:
    """The TP rule's messages: `tp` must divide each named field of `config`."""
    return [
        f"layout.tp {tp} must divide model.{name} {getattr(config, name)}{_WHY.get(name, '')}"
        for name in fields
        if getattr(config, name) % tp
    ]
