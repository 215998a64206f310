"""Llama 2 as a family (7B, 70B), and Llama 3.1 in it (GQA, RoPE theta 500,000 with Llama 3's frequency scaling,
a 128,256-token vocabulary): its model section, sizes and TP rule.

Torch-free (see recipes/common/spec.py); recipes/llama2/model.py builds its model from Llama2Config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from recipes.common.spec import DECODER_BOUNDS, DecoderConfig, FamilySpec, divides, training_flops_per_token
from trnrecipes.schema import POSITIVE


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3's RoPE frequency scaling (transformers' rope_type "llama3"; Meta's Llama 3.1 config.json: factor 8,
    low_freq_factor 1, high_freq_factor 4, original_max_position_embeddings 8192): wavelengths longer than
    original_max_seq_len / low_freq_factor are stretched by `factor`, shorter than original_max_seq_len /
    high_freq_factor kept, and those between interpolated smoothly."""

    type: Literal["llama3"] = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192

    def problems(self) -> list[str]:
        problems = [
            f"model.rope_scaling.{name} must be > 0, got {getattr(self, name)}"
            for name in ("factor", "low_freq_factor", "high_freq_factor", "original_max_seq_len")
            if not getattr(self, name) > 0
        ]
        if not problems and self.high_freq_factor <= self.low_freq_factor:
            problems.append(
                f"model.rope_scaling.high_freq_factor {self.high_freq_factor} must be above low_freq_factor"
                f" {self.low_freq_factor}"
            )
        return problems


@dataclass(frozen=True)
class Llama2Config(DecoderConfig):
    family: Literal["llama2"] = field(default="llama2", kw_only=True)
    num_kv_heads: int | None = None  # grouped-query attention (70B: 8); None = num_heads (plain multi-head)
    rotary_base: float = 10000.0
    rope_scaling: RopeScaling | None = None  # Llama 3.1: rope_type "llama3"; None: plain RoPE (Llama 2)
    norm_eps: float = 1e-5
    init_std: float = 0.02
    activation_checkpointing: Literal["none", "selective", "elementwise", "full"] = "none"  # recipes/common/spec.py
    # The first N blocks (of each pipeline stage) checkpointed whole, the others per activation_checkpointing: memory
    # for recompute, a block at a time (Megatron-LM's --recompute-method block --recompute-num-layers N)
    activation_checkpointing_full_layers: int = 0
    # What computes core attention: PyTorch's SDPA everywhere, or on torch-xla + NxD (trn1) NxD's NKI flash
    # attention kernel (trnrecipes/parallel/nki_attention.py; where it may run: trnrecipes/config/recipe.py)
    attention: Literal["sdpa", "nki_flash"] = "sdpa"

    def __post_init__(self) -> None:
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)  # frozen: set once, here
        super().__post_init__()

    def layer_params(self) -> int:
        """One block of recipes/llama2/model.py: 2 RMSNorms (weight), fused qkv (GQA) and output without bias,
        fused gate_up + down without bias."""
        h, f, heads, kv = self.hidden_size, self.ffn_hidden_size, self.num_heads, self.num_kv_heads
        return 2 * h + h * (heads + 2 * kv) * self.head_dim + heads * self.head_dim * h + 3 * h * f

    def norm_head_params(self) -> int:
        """Final RMSNorm (weight) and the untied head (no bias)."""
        return self.hidden_size + self.vocab_size * self.hidden_size

    def flops_per_token(self, seq_len: int) -> int:
        return training_flops_per_token(self, seq_len)

    def problems(self) -> list[str]:
        if self.hidden_size % self.num_heads:
            return [f"model.hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}"]
        problems = []
        if self.num_heads % self.num_kv_heads:
            problems.append(f"model.num_kv_heads {self.num_kv_heads} must divide num_heads {self.num_heads}")
        if self.head_dim % 2:
            problems.append(f"model.hidden_size / num_heads = {self.head_dim} must be even for rotary embeddings")
        if self.rope_scaling is not None:
            problems += self.rope_scaling.problems()
        return problems

    def tp_problems(self, tp: int) -> list[str]:
        """Each rank holds whole query heads, whole SwiGLU units and a slice of the vocab, and whole KV groups
        where TP divides the KV heads; a TP that is a multiple of them replicates each KV head over tp / kv ranks
        (trnrecipes/parallel/kv_replication.py)."""
        problems = divides(tp, self, "num_heads", "ffn_hidden_size", "vocab_size")
        kv = self.num_kv_heads
        if kv % tp and tp % kv:
            problems.append(
                f"layout.tp {tp} must divide model.num_kv_heads {kv} (each rank holds whole KV groups) or be a"
                f" multiple of it (each KV head replicated over tp / {kv} ranks)"
            )
        return problems


SPEC = FamilySpec(
    name="llama2",
    config=Llama2Config,
    bounds={
        **DECODER_BOUNDS,
        "num_kv_heads": POSITIVE,
        **{f"rope_scaling.{k}": POSITIVE for k in ("factor", "low_freq_factor", "high_freq_factor")},
        "rope_scaling.original_max_seq_len": POSITIVE,
    },
    model_class="Llama2",
    hf_architectures=("LlamaForCausalLM",),
    hf_model_type="llama",
)
