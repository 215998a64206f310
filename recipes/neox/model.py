"""GPT-NeoX as Pythia and NeoX-20B use it, single-device and plain PyTorch (no device or parallel logic here).

Parallelism, activation checkpointing and compilation are applied from outside by the parallelize step (activation
checkpointing: trnrecipes/parallel/activation_checkpointing.py, on `layers` or on each attention's `core`), which also
sets `head_loss` for a tensor-parallel head; `args.activation_checkpointing` is recipe data for that step.

Parallel residual, LayerNorm, fused QKV, GELU MLP, untied embedding and head, partial rotary embeddings.

Partial rotary with the zero-frequency trick: instead of rotating only the first r = rotary_pct * head_dim dims
(a data-dependent slice, awkward for the Neuron compiler), every dim of the head goes through rotate_half with a
frequency table that is zero on the dims that must not rotate (cos = 1, sin = 0 there). rotate_half pairs dim i
with i + head_dim/2, while HF pairs i with i + r/2 inside the first r dims; so the table is laid out as
[inv(r/2), 0, inv(r/2), 0] (each half: r/2 frequencies, then head_dim/2 - r/2 zeros) and the q/k rows of each
head are permuted once, when weights come in from or go out to HF (recipes/neox/hf.py: rotary_permutation).
q.k is unchanged by a permutation applied to both, so attention scores equal HF's exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from recipes.common.attention import CoreAttention
from recipes.common.init import Init, init_full, standard_init_rules
from recipes.common.loss import fused_head_loss
from recipes.common.rope import cached_tables
from recipes.neox.spec import NeoXConfig

NeoXArgs = NeoXConfig  # the recipe's model section is the model's arguments: one definition of the fields


def rotary_frequencies(args: NeoXArgs) -> torch.Tensor:
    """Per-dim frequencies over the whole head: [inv(r/2), 0 ... , inv(r/2), 0 ...] (see the module docstring)."""
    half, rot_half = args.head_dim // 2, args.rotary_dim // 2
    inv = 1.0 / (args.rotary_base ** (torch.arange(0, args.rotary_dim, 2, dtype=torch.float32) / args.rotary_dim))
    freqs = torch.zeros(half, dtype=torch.float32)
    freqs[:rot_half] = inv
    return torch.cat([freqs, freqs])


def rope_tables(args: NeoXArgs, seq_len: int, device: torch.device, dtype: torch.dtype):
    """(cos, sin) [seq, head_dim], angles in float32 as HF computes them, made once per argument set
    (recipes/common/rope.py); from the input's own length, so a block needs no other input."""

    def make():
        freqs = rotary_frequencies(args).to(device)
        angles = torch.arange(seq_len, dtype=torch.float32, device=device)[:, None] * freqs
        return angles.cos().to(dtype), angles.sin().to(dtype)

    key = ("neox", seq_len, args.head_dim, args.rotary_dim, float(args.rotary_base), device.type, device.index, dtype)
    return cached_tables(key, make)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class Attention(nn.Module):
    def __init__(self, args: NeoXArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.args = args  # rotary tables from rope_tables (not a buffer: garbage after meta-device init)
        # Rows per head: [q, k, v] blocks of head_dim, as HF and Megatron lay them out: a contiguous row shard
        # holds whole heads, so tensor parallelism slices this weight without reordering.
        self.qkv = nn.Linear(args.hidden_size, 3 * args.hidden_size)
        self.out = nn.Linear(args.hidden_size, args.hidden_size)
        self.core = CoreAttention()  # no parameters: a handle for selective activation checkpointing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        cos, sin = self.rope(s, x.device, x.dtype)
        # Heads are counted from the weight actually present (all of them, or this rank's shard).
        qkv = self.qkv(x).view(b, s, -1, 3 * self.head_dim).transpose(1, 2)
        q, k, v = qkv.chunk(3, dim=-1)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        y = self.core(q, k, v)
        return self.out(y.transpose(1, 2).reshape(b, s, -1))

    def rope(self, seq_len: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's (cos, sin) for positions 0..seq_len-1. The parallelize step may shadow it on an instance, as it swaps
        core.kernel: context parallelism gives each rank its tokens' true positions (trnrecipes/parallel/context.py)."""
        return rope_tables(self.args, seq_len, device, dtype)


class MLP(nn.Module):
    def __init__(self, args: NeoXArgs):
        super().__init__()
        self.fc_in = nn.Linear(args.hidden_size, args.ffn_hidden_size)
        self.fc_out = nn.Linear(args.ffn_hidden_size, args.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x)))  # exact (erf) GELU, as HF's "gelu"


class Layer(nn.Module):
    def __init__(self, args: NeoXArgs):
        super().__init__()
        self.parallel_residual = args.parallel_residual
        self.attn_norm = nn.LayerNorm(args.hidden_size, eps=args.norm_eps)
        self.attn = Attention(args)
        self.mlp_norm = nn.LayerNorm(args.hidden_size, eps=args.norm_eps)
        self.mlp = MLP(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel_residual:  # x + attn(ln1(x)) + mlp(ln2(x)): both branches read the same input
            return x + self.attn(self.attn_norm(x)) + self.mlp(self.mlp_norm(x))
        h = x + self.attn(self.attn_norm(x))
        return h + self.mlp(self.mlp_norm(h))


class NeoX(nn.Module):
    def __init__(self, args: NeoXArgs):
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Layer(args) for _ in range(args.num_layers))
        self.norm = nn.LayerNorm(args.hidden_size, eps=args.norm_eps)
        self.head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        # How forward turns the final hidden states into the loss: a plain function, not a module (no parameters,
        # no state dict entry). The parallelize step swaps in a vocab-parallel loss for a tensor-parallel head.
        self.head_loss = fused_head_loss

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [b, s] -> logits [b, s, vocab] in the model's dtype; or, given labels [b, s] (the target of
        position s, already shifted; -100 = ignore), the mean loss over the labelled positions, computed by
        self.head_loss: by default the fused chunked head + cross-entropy, so the [b, s, vocab] logits are never
        materialized."""
        x = self.embed(tokens)
        rope_tables(self.args, tokens.shape[1], x.device, x.dtype)  # before the (compiled) blocks: rope.py
        for layer in self.layers:
            x = layer(x)
        x = self.norm(x)
        if labels is None:
            return self.head(x)
        return self.head_loss(self.head, x, labels)

    def init_rules(self) -> dict[str, Init]:
        """Normal(0, init_std); the output projections of attention and MLP get init_std / sqrt(2 * num_layers) so
        the residual stream's variance does not grow with depth (the 128-node Llama 2 post). Biases zero, norms one.
        Drawn by recipes/common/init.py, whole or one shard at a time."""
        outputs = ("attn.out.weight", "mlp.fc_out.weight")
        return standard_init_rules(self, self.args.init_std, outputs, self.args.num_layers)

    def init_weights(self, seed: int = 0) -> None:
        """Initialise the whole (unsharded) model: bitwise what every sharded layout builds for the same seed."""
        init_full(self, self.init_rules(), seed)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
