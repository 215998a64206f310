"""Core attention as its own parameter-free module: causal softmax(q k^T / sqrt(d)) v and nothing else.

A module, not a function, so that code outside the model can find it and change how it runs without touching the
model: selective activation checkpointing (trnrecipes/parallel/activation_checkpointing.py) recomputes exactly this, the
O(s^2) part of attention, in backward, and a backend may swap the function that computes it (`kernel`: Neuron's NKI
flash attention, trnrecipes/parallel/nki_attention.py). It holds no parameter or buffer, so it adds nothing to the
state dict and parameter names stay as they were.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """PyTorch's scaled-dot-product attention, causal, scale 1/sqrt(head_dim), k/v heads shared by groups of q's."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


class CoreAttention(nn.Module):
    """q [b, heads, s, d], k and v [b, kv_heads, s, d] -> [b, heads, s, d], causal. kv_heads may divide heads
    (grouped-query attention: query head i reads kv head i // (heads / kv_heads)); with kv_heads == heads this is
    the plain multi-head call, bit for bit."""

    def __init__(self):
        super().__init__()
        # What computes it: a plain function of (q, k, v) with the contract above, not a module (no state dict
        # entry), so the parallelize step can swap in another kernel, as it swaps the model's head_loss.
        self.kernel = causal_attention

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.kernel(q, k, v)
