"""Qwen3 as a family (dense Qwen3-0.6B to 32B, and Qwen3-MoE): its model section, sizes and TP rule.

Llama's block with an RMSNorm on each query and key head before RoPE, a head_dim of its own (not hidden / heads),
and a head tied to the embedding in the small sizes; with num_experts > 0, some blocks' MLP is a top-k mixture of
experts. Torch-free (see recipes/common/spec.py); recipes/qwen3/model.py builds its model from Qwen3Config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from recipes.common.spec import DECODER_BOUNDS, DecoderConfig, FamilySpec, divides
from trnrecipes.schema import NON_NEGATIVE, POSITIVE


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
    # Qwen3-MoE (transformers' Qwen3MoeConfig names). num_experts 0: dense, the other fields unset. Block i is sparse
    # iff num_experts > 0, i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0; the others keep the
    # dense MLP of ffn_hidden_size.
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k experts per token
    moe_intermediate_size: int = 0  # each expert's SwiGLU width
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to one
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.0  # weight of the load-balancing loss added to training's loss (Switch)

    def __post_init__(self) -> None:
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)  # frozen: set once, here
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        super().__post_init__()

    def is_sparse(self, layer: int) -> bool:
        """Whether block `layer` has the mixture of experts (transformers' Qwen3MoeDecoderLayer's rule)."""
        return (
            self.num_experts > 0 and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0
        )

    def layer_params(self) -> int:
        """One dense block of recipes/qwen3/model.py: 2 RMSNorms, fused qkv (GQA) and output without bias, the q and
        k norms (head_dim each), fused gate_up + down without bias."""
        h, f, heads, kv, hd = self.hidden_size, self.ffn_hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
        return 2 * h + h * (heads + 2 * kv) * hd + heads * hd * h + 2 * hd + 3 * h * f

    def layer_params_at(self, layer: int) -> int:
        """Block `layer`: a sparse one holds the router and every expert's SwiGLU in place of the dense MLP."""
        if not self.is_sparse(layer):
            return self.layer_params()
        h, e = self.hidden_size, self.num_experts
        return self.layer_params() - 3 * h * self.ffn_hidden_size + e * h + e * 3 * h * self.moe_intermediate_size

    def active_params(self) -> int:
        """Parameters one token's forward reads: a sparse block's router and its top-k experts, not all experts."""
        idle = (self.num_experts - self.num_experts_per_tok) * 3 * self.hidden_size * self.moe_intermediate_size
        return self.param_count() - idle * sum(map(self.is_sparse, range(self.num_layers)))

    def norm_head_params(self) -> int:
        """Final RMSNorm, and the head unless it is the embedding's weight."""
        return self.hidden_size + (0 if self.tie_embeddings else self.vocab_size * self.hidden_size)

    def flops_per_token(self, seq_len: int) -> int:
        """PaLM appendix B (6N + 12 L H Q T) with Qwen3's own head_dim; a tied head's matmul counted once, by N; N
        the active parameters (top-k experts of each sparse block)."""
        return 6 * self.active_params() + 12 * self.num_layers * self.num_heads * self.head_dim * seq_len

    def problems(self) -> list[str]:
        problems = []
        if self.num_heads % self.num_kv_heads:
            problems.append(f"model.num_kv_heads {self.num_kv_heads} must divide num_heads {self.num_heads}")
        if self.head_dim % 2:
            problems.append(f"model.head_dim {self.head_dim} must be even for rotary embeddings")
        return problems + self.moe_problems()

    def moe_problems(self) -> list[str]:
        if self.num_experts == 0:
            unset = {"num_experts_per_tok": 0, "moe_intermediate_size": 0, "norm_topk_prob": False,
                     "decoder_sparse_step": 1, "mlp_only_layers": (), "router_aux_loss_coef": 0.0}  # fmt: skip
            return [
                f"model.{name} {_yaml(getattr(self, name))} is set with model.num_experts 0 (a dense model); set"
                f" model.num_experts > 0 or leave model.{name} at {_yaml(default)}"
                for name, default in unset.items()
                if getattr(self, name) != default
            ]
        problems = []
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            problems.append(
                f"model.num_experts_per_tok {self.num_experts_per_tok} must be 1 to model.num_experts"
                f" {self.num_experts}"
            )
        if self.moe_intermediate_size < 1:
            problems.append(f"model.moe_intermediate_size {self.moe_intermediate_size} must be > 0 with experts")
        outside = [i for i in self.mlp_only_layers if i >= self.num_layers]
        if outside:
            problems.append(
                f"model.mlp_only_layers {list(self.mlp_only_layers)} names layer(s) {outside}; valid: 0 to"
                f" {self.num_layers - 1} (model.num_layers {self.num_layers})"
            )
        elif self.decoder_sparse_step > 0 and not any(map(self.is_sparse, range(self.num_layers))):
            problems.append(
                f"model.num_experts {self.num_experts} but no block is sparse (model.decoder_sparse_step"
                f" {self.decoder_sparse_step}, mlp_only_layers {list(self.mlp_only_layers)}, {self.num_layers}"
                " layers); set model.num_experts 0 for a dense model"
            )
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
        if self.num_experts and layout.pp > 1:
            problems.append(
                f"layout.pp {layout.pp} with model.num_experts {self.num_experts}: the load-balancing loss is not"
                " summed over pipeline stages yet; use layout.pp 1 (tensor, expert and data parallel, ZeRO-1 or FSDP)"
            )
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


def _yaml(value: Any) -> str:
    """A field's value as a recipe writes it: true / false, [0, 1]."""
    return str(value).lower() if isinstance(value, bool) else str(list(value) if isinstance(value, tuple) else value)


SPEC = FamilySpec(
    name="qwen3",
    config=Qwen3Config,
    bounds={
        **DECODER_BOUNDS,
        "num_kv_heads": POSITIVE,
        "head_dim": POSITIVE,
        "num_experts": NON_NEGATIVE,
        "num_experts_per_tok": NON_NEGATIVE,
        "moe_intermediate_size": NON_NEGATIVE,
        "decoder_sparse_step": POSITIVE,
        "mlp_only_layers": NON_NEGATIVE,
        "router_aux_loss_coef": NON_NEGATIVE,
    },
    model_class="Qwen3",
    hf_architectures=("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
    hf_model_type="qwen3",
)
