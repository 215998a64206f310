"""Qwen3 dense as a family (Qwen3-0.6B to 32B): its model section, sizes and TP rule.

Llama's block with an RMSNorm on each query and key head before RoPE, a head_dim of its own (not hidden / heads),
and a head tied to the embedding in the small sizes. Torch-free (see recipes/common/spec.py); recipes/qwen3/model.py
builds its model from Qwen3Config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from recipes.common.spec import DECODER_BOUNDS, DecoderConfig, FamilySpec, divides
from trnrecipes.schema import POSITIVE


@dataclass(frozen=True)
class Qwen3Config(DecoderConfig):
    family: Literal["qwen3"] = field(default="qwen3", kw_only=True)
    num_kv_heads: int | None = None  # grouped-query attention (Qwen3-8B: 8); None = num_heads
    head_dim: int | None = None  # per-head width (Qwen3: 128 at every size); None = hidden_size / num_heads
    rotary_base: float = 1000000.0  # Qwen3's rope_theta
    norm_eps: float = 1e-6
    init_std: float = 0.02
    # The head shares the embedding's weight (Qwen3-0.6B, 1.7B, 4B); the model then has no `head` module
    tie_embeddings: bool = False
    activation_checkpointing: Literal["none", "selective", "elementwise", "full"] = "none"  # recipes/common/spec.py
    # The first N blocks (of each pipeline stage) checkpointed whole, the others per activation_checkpointing
    activation_checkpointing_full_layers: int = 0

    def __post_init__(self) -> None:
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)  # frozen: set once, here
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        super().__post_init__()

    def layer_params(self) -> int:
        """One block of recipes/qwen3/model.py: 2 RMSNorms, fused qkv (GQA) and output without bias, the q and k
        norms (head_dim each), fused gate_up + down without bias."""
        h, f, heads, kv, hd = self.hidden_size, self.ffn_hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
        return 2 * h + h * (heads + 2 * kv) * hd + heads * hd * h + 2 * hd + 3 * h * f

    def norm_head_params(self) -> int:
        """Final RMSNorm, and the head unless it is the embedding's weight."""
        return self.hidden_size + (0 if self.tie_embeddings else self.vocab_size * self.hidden_size)

    def flops_per_token(self, seq_len: int) -> int:
        """PaLM appendix B (6N + 12 L H Q T) with Qwen3's own head_dim; a tied head's matmul counted once, by N."""
        return 6 * self.param_count() + 12 * self.num_layers * self.num_heads * self.head_dim * seq_len

    def problems(self) -> list[str]:
        problems = []
        if self.num_heads % self.num_kv_heads:
            problems.append(f"model.num_kv_heads {self.num_kv_heads} must divide num_heads {self.num_heads}")
        if self.head_dim % 2:
            problems.append(f"model.head_dim {self.head_dim} must be even for rotary embeddings")
        return problems

    def tp_problems(self, tp: int) -> list[str]:
        """Each rank holds whole query heads, whole KV groups, whole SwiGLU units and a slice of the vocabulary."""
        problems = divides(tp, self, "num_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size")
        if tp > 1 and self.tie_embeddings:
            problems.append(
                f"layout.tp {tp} with model.tie_embeddings true: the tied head is not split over tensor-parallel"
                " ranks yet; use layout.tp 1 or model.tie_embeddings false"
            )
        return problems

    def layout_problems(self, layout: Any, nxd: bool) -> list[str]:
        """What this family does not run with yet (layout: the recipe's layout section; nxd: torch-xla + NxD)."""
        problems = []
        if nxd:
            problems.append(
                "model.family qwen3 runs on TorchNeuron (trn2/trn3, cluster.neuron_sdk 2.33, as AWS's TorchTitan"
                " Qwen3 tutorial), cpu and cuda, not on torch-xla + NxD"
            )
        if self.tie_embeddings and layout.pp > 1:
            problems.append(
                f"layout.pp {layout.pp} with model.tie_embeddings true: the tied head needs the embedding on the last"
                " stage; use layout.pp 1 or model.tie_embeddings false"
            )
        if self.tie_embeddings and layout.fsdp:
            problems.append(
                "layout.fsdp true with model.tie_embeddings true: not built yet; use layout.zero1 or"
                " model.tie_embeddings false"
            )
        return problems


SPEC = FamilySpec(
    name="qwen3",
    config=Qwen3Config,
    bounds={**DECODER_BOUNDS, "num_kv_heads": POSITIVE, "head_dim": POSITIVE},
    model_class="Qwen3",
    hf_architectures=("Qwen3ForCausalLM",),
    hf_model_type="qwen3",
)
