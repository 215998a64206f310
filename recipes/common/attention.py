"""Core attention as its own parameter-free module: causal softmax(q k^T / sqrt(d)) v and nothing else.

A module, not a function, so that code outside the model can find it and change how it runs without touching the
model: selective activation checkpointing (trnrecipes/parallel/activation_checkpointing.py) recomputes exactly this, the
O(s^2) part of attention, in backward. It holds no parameter or buffer, so it adds nothing to the state dict and
parameter names stay as they were.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class CoreAttention(nn.Module):
    """q [b, heads, s, d], k and v [b, kv_heads, s, d] -> [b, heads, s, d], causal. kv_heads may divide heads
    (grouped-query attention: query head i reads kv head i // (heads / kv_heads)); with kv_heads == heads this is
    the plain multi-head call, bit for bit."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
