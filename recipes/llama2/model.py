"""Llama 2 (and Llama 3.1: rope_scaling) in plain single-device PyTorch, numerically equal to Hugging Face's
LlamaForCausalLM.

The projections are fused (qkv, gate_up) with row layouts chosen so that a contiguous row shard of size
out/tp holds whole KV groups / whole FFN units for any tp that divides num_kv_heads / ffn_hidden_size. The
forward pass reads the local number of heads and FFN units from the weight shapes, never from the config, so
the same code runs unchanged on a tensor-parallel (column-sharded) weight.

No parallelism, activation checkpointing or compilation here: the parallelize step applies them from outside
(activation checkpointing: trnrecipes/parallel/activation_checkpointing.py, on `layers` or on each attention's `core`),
and sets `head_loss` for a tensor-parallel head. `args.activation_checkpointing` is recipe data for that step.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from recipes.common.attention import CoreAttention
from recipes.common.init import Init, init_full, standard_init_rules
from recipes.common.loss import fused_head_loss
from recipes.common.rope import cached_tables
from recipes.llama2.spec import Llama2Config, RopeScaling

Llama2Args = Llama2Config  # the recipe's model section is the model's arguments: one definition of the fields


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # As HF's LlamaRMSNorm: normalise in float32 (bf16 squares lose too much), cast back, *then* scale.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama 3's frequency scaling of RoPE's inverse frequencies, op for op as transformers' llama3 rope init
    (modeling_rope_utils._compute_llama3_parameters), so the cos/sin tables are bitwise HF's."""
    old_context = scaling.original_max_seq_len
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def rotary_cos_sin(
    seq_len: int,
    head_dim: int,
    base: float,
    device: torch.device,
    dtype: torch.dtype,
    scaling: RopeScaling | None = None,
):
    """cos/sin [seq, head_dim] for positions 0..seq-1, computed in float32 exactly as HF does (with Llama 3's
    frequency scaling where the model has it).

    Not a buffer: one made at construction would be garbage after meta-device init + to_empty() unless every caller
    remembered to refill it. The model takes it through rope_tables, which makes it once per shape.
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    if scaling is not None:
        inv_freq = llama3_inv_freq(inv_freq, scaling)
    freqs = torch.arange(seq_len, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rope_tables(
    seq_len: int,
    head_dim: int,
    base: float,
    device: torch.device,
    dtype: torch.dtype,
    scaling: RopeScaling | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """rotary_cos_sin, made once per argument set (recipes/common/rope.py)."""
    scaled = None
    if scaling is not None:
        scaled = (scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor, scaling.original_max_seq_len)
    key = ("llama2", seq_len, head_dim, float(base), device.type, device.index, dtype, scaled)
    return cached_tables(key, lambda: rotary_cos_sin(seq_len, head_dim, base, device, dtype, scaling))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    # HF's (non-interleaved) rotary convention: pairs are (i, i + head_dim/2), not (2i, 2i+1).
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, args: Llama2Args):
        super().__init__()
        self.head_dim = args.head_dim
        self.q_per_kv = args.num_heads // args.num_kv_heads  # the same on every TP rank
        self.rotary_base, self.rope_scaling = args.rotary_base, args.rope_scaling
        # Rows grouped per KV group g: [q heads of group g | k head g | v head g], so row shards keep whole groups.
        self.qkv = nn.Linear(args.hidden_size, (args.num_heads + 2 * args.num_kv_heads) * args.head_dim, bias=False)
        self.out = nn.Linear(args.num_heads * args.head_dim, args.hidden_size, bias=False)
        self.core = CoreAttention()  # no parameters: a handle for selective activation checkpointing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        hd, qpk = self.head_dim, self.q_per_kv
        # The number of (local) KV groups comes from the weight's shape, so a column shard just works.
        qkv = self.qkv(x).view(b, s, -1, (qpk + 2) * hd)
        groups = qkv.shape[2]
        q, k, v = qkv.split([qpk * hd, hd, hd], dim=-1)
        q = q.reshape(b, s, groups * qpk, hd).transpose(1, 2)  # query head g*qpk + j uses kv head g, as in HF
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [b, groups, s, hd]

        cos, sin = self.rope(s, x.device, x.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin

        o = self.core(q, k, v)
        return self.out(o.transpose(1, 2).reshape(b, s, -1))

    def rope(self, seq_len: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's (cos, sin) for positions 0..seq_len-1. The parallelize step may shadow it on an instance, as it swaps
        core.kernel: context parallelism gives each rank its tokens' true positions (trnrecipes/parallel/context.py)."""
        return rope_tables(seq_len, self.head_dim, self.rotary_base, device, dtype, self.rope_scaling)


class MLP(nn.Module):
    def __init__(self, args: Llama2Args):
        super().__init__()
        # Rows interleave [gate_0, up_0, gate_1, up_1, ...] so a row shard holds whole SwiGLU units.
        self.gate_up = nn.Linear(args.hidden_size, 2 * args.ffn_hidden_size, bias=False)
        self.down = nn.Linear(args.ffn_hidden_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # FFN width (local under TP) from the shape. unbind, not y[..., 0] / y[..., 1]: its backward is one stack,
        # where each index's backward would zero-fill a full-size gradient and copy into it.
        gate, up = self.gate_up(x).unflatten(-1, (-1, 2)).unbind(-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, args: Llama2Args):
        super().__init__()
        self.attn_norm = RMSNorm(args.hidden_size, args.norm_eps)
        self.attn = Attention(args)
        self.mlp_norm = RMSNorm(args.hidden_size, args.norm_eps)
        self.mlp = MLP(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Llama2(nn.Module):
    def __init__(self, args: Llama2Args):
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.norm_eps)
        self.head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)  # untied from embed, as in Llama 2 and 3.1
        # No init here: construction on the meta device stays free. Callers run init_weights() (or load weights).
        # How forward turns the final hidden states into the loss: a plain function, not a module (no parameters,
        # no state dict entry). The parallelize step swaps in a vocab-parallel loss for a tensor-parallel head.
        self.head_loss = fused_head_loss

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [b, s] -> logits [b, s, vocab] in the model's dtype; or, given labels [b, s] (the target of
        position s, already shifted; -100 = ignore), the mean loss over the labelled positions, computed by
        self.head_loss: by default the fused chunked head + cross-entropy, so the [b, s, vocab] logits are never
        materialized."""
        x = self.embed(tokens)
        a = self.args  # the blocks' RoPE tables, made here, outside their compiled graphs (recipes/common/rope.py)
        rope_tables(tokens.shape[1], a.head_dim, a.rotary_base, x.device, x.dtype, a.rope_scaling)
        for layer in self.layers:
            x = layer(x)
        x = self.norm(x)
        if labels is None:
            return self.head(x)
        return self.head_loss(self.head, x, labels)

    def init_rules(self) -> dict[str, Init]:
        """What each parameter starts as (recipes/common/init.py draws it, whole or one shard at a time).
        Output projections write into the residual stream 2 * num_layers times; scaling their std by 1/sqrt(2L)
        keeps the residual's variance from growing with depth (GPT-2 / Megatron scaled init). Norms one."""
        outputs = ("attn.out.weight", "mlp.down.weight")
        return standard_init_rules(self, self.args.init_std, outputs, self.args.num_layers)

    def init_weights(self, seed: int = 0) -> None:
        """Initialise the whole (unsharded) model: bitwise what every sharded layout builds for the same seed."""
        init_full(self, self.init_rules(), seed)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
