"""GPT-NeoX as a family (NeoX-20B and every Pythia size): its model section, sizes, TP rule and compiler flags.

Torch-free (see recipes/common/spec.py); recipes/neox/model.py builds its model from NeoXConfig.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from recipes.common.spec import DECODER_BOUNDS, DecoderConfig, FamilySpec, divides, training_flops_per_token
from trnrecipes.schema import Bound


@dataclass(frozen=True)
class NeoXConfig(DecoderConfig):
    family: Literal["neox"] = field(default="neox", kw_only=True)
    rotary_pct: float = 1.0  # NeoX and Pythia set 0.25 (every shipped recipe does); 1.0 as recipes always defaulted
    rotary_base: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    activation_checkpointing: Literal["none", "selective", "elementwise", "full"] = "none"  # recipes/common/spec.py
    # The first N blocks (of each pipeline stage) checkpointed whole, the others per activation_checkpointing: memory
    # for recompute, a block at a time (Megatron-LM's --recompute-method block --recompute-num-layers N)
    activation_checkpointing_full_layers: int = 0
    parallel_residual: bool = True  # x + attn(ln1(x)) + mlp(ln2(x)), as every Pythia and NeoX-20B

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rotary_pct)

    def layer_params(self) -> int:
        """One layer of recipes/neox/model.py: 2 LayerNorms (weight + bias), fused QKV with bias, output dense
        with bias, 2-layer GELU MLP with biases."""
        h, f = self.hidden_size, self.ffn_hidden_size
        return 2 * 2 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h)

    def norm_head_params(self) -> int:
        """Final LayerNorm (weight + bias) and the untied head (no bias)."""
        return 2 * self.hidden_size + self.vocab_size * self.hidden_size

    def flops_per_token(self, seq_len: int) -> int:
        return training_flops_per_token(self, seq_len)

    def problems(self) -> list[str]:
        if self.hidden_size % self.num_heads:
            return [f"model.hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}"]
        if self.rotary_dim % 2:  # rotate_half pairs dims: a rotary slice needs whole pairs
            return [
                f"model.rotary_pct {self.rotary_pct} rotates {self.rotary_dim} of the {self.head_dim} dims of a"
                " head; that must be an even number"
            ]
        return []

    def tp_problems(self, tp: int) -> list[str]:
        """Each rank holds whole heads (qkv rows are grouped per head), whole MLP units and a slice of the vocab."""
        return divides(tp, self, "num_heads", "ffn_hidden_size", "vocab_size")


def compiler_flags(instance: str) -> tuple[str, ...]:
    # AWS's GPT-NeoX trn1 scripts (neuronx-distributed examples/training/tp_dp_gpt_neox_hf_pretrain) set it: it
    # keeps matmul transposes the compiler adds from turning infinities into NaN; needed on trn1 only.
    return ("--enable-saturate-infinity",) if instance.startswith("trn1") else ()


SPEC = FamilySpec(
    name="neox",
    config=NeoXConfig,
    bounds={**DECODER_BOUNDS, "rotary_pct": Bound(0, 1, low_open=True)},
    model_class="NeoX",
    hf_architectures=("GPTNeoXForCausalLM",),
    hf_model_type="gpt_neox",
    compiler_flags=compiler_flags,
)
