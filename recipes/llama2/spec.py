"""Llama 2 as a family (7B, 70B): its model section, sizes and TP rule.

Torch-free (see recipes/common/spec.py); recipes/llama2/model.py builds its model from Llama2Config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from recipes.common.spec import DECODER_BOUNDS, DecoderConfig, FamilySpec, divides, training_flops_per_token
from trnrecipes.schema import POSITIVE


@dataclass(frozen=True)
class Llama2Config(DecoderConfig):
    family: Literal["llama2"] = field(default="llama2", kw_only=True)
    num_kv_heads: int | None = None  # grouped-query attention (70B: 8); None = num_heads (plain multi-head)
    rotary_base: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    activation_checkpointing: Literal["none", "selective", "full"] = "none"  # selective: core attention only

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
        return problems

    def tp_problems(self, tp: int) -> list[str]:
        """Each rank holds whole KV groups (qkv rows are grouped per KV group, NxD's GQAQKVColumnParallelLinear
        is not used), whole SwiGLU units and a slice of the vocab."""
        return divides(tp, self, "num_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size")


SPEC = FamilySpec(
    name="llama2",
    config=Llama2Config,
    bounds={**DECODER_BOUNDS, "num_kv_heads": POSITIVE},
    model_class="Llama2",
    hf_architectures=("LlamaForCausalLM",),
    hf_model_type="llama",
)
