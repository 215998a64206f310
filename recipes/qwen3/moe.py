"""Qwen3-MoE's sparse MLP (a top-k router over SwiGLU experts, dropless) and its load-balancing loss, numerically as
transformers' Qwen3MoeSparseMoeBlock and load_balancing_loss_func (Switch Transformer, equations 4-6).

The experts are stacked tensors [E, ...] (transformers 5's layout, torchtitan's GroupedExperts'): expert parallelism
(trnrecipes/parallel/expert.py) shards dim 0, and each expert's gate_up rows interleave gate and up as the dense
MLP's, so a TP split of dim 1 keeps whole SwiGLU units.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from recipes.common.eager import eager_under_compile
from recipes.qwen3.spec import Qwen3Config


class Routing(NamedTuple):
    """One sparse block's routing in its last forward: top-k picks per expert (no gradient), the router's
    probabilities summed over tokens per expert (the loss's gradient reaches the router through these), tokens."""

    picks: torch.Tensor  # [E] fp32
    prob_sum: torch.Tensor  # [E] fp32
    tokens: int


class Experts(nn.Module):
    def __init__(self, args: Qwen3Config):
        super().__init__()
        e, h, i = args.num_experts, args.hidden_size, args.moe_intermediate_size
        self.gate_up = nn.Parameter(torch.empty(e, 2 * i, h))  # rows gate_0, up_0, gate_1, ... per expert
        self.down = nn.Parameter(torch.empty(e, h, i))

    # Not compiled: the split sizes are data (a compiled block would recompile on each new set until torch's limit,
    # then run eager); the rest of the block compiles around it, as under expert parallelism.
    @eager_under_compile
    def forward(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H]; chosen, weights [T, k]: each token through its k experts, weighted, summed. The T * k picks are
        sorted by expert so each expert runs once on its rows; no capacity, no dropped token."""
        top_k = chosen.shape[1]
        order = chosen.reshape(-1).argsort(stable=True)
        token = order // top_k
        # The split sizes are read on the host: one sync per sparse block (torch._grouped_mm would avoid it on GPUs).
        counts = torch.bincount(chosen.reshape(-1), minlength=self.gate_up.shape[0]).tolist()
        y = self.grouped(x.index_select(0, token), counts) * weights.reshape(-1, 1)[order]
        return torch.zeros_like(x).index_add_(0, token, y.to(x.dtype))

    def grouped(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """rows [sum(counts), H] sorted by expert, counts[e] of them for this module's expert e: each through its
        expert's SwiGLU. Expert parallelism (trnrecipes/parallel/expert.py) calls it with the rows of its experts."""
        outs = []
        for expert, r in enumerate(rows.split(counts)):  # a loop over experts, not tokens
            gate, up = F.linear(r, self.gate_up[expert]).unflatten(-1, (-1, 2)).unbind(-1)
            outs.append(F.linear(F.silu(gate) * up, self.down[expert]))
        return torch.cat(outs)


class SparseMLP(nn.Module):
    def __init__(self, args: Qwen3Config):
        super().__init__()
        self.top_k, self.norm_topk_prob = args.num_experts_per_tok, args.norm_topk_prob
        self.router = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.experts = Experts(args)
        # Set by each forward (an activation checkpoint's recompute sets the same values again); read by the model.
        self.routing: Routing | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        logits = self.router(flat)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if torch._C._current_graph_task_id() == -1:
            # Not during backward: activation checkpointing's recompute would store a routing whose graph (the
            # block's recomputed activations) stays alive until the next forward; its values are the forward's.
            picks = torch.bincount(chosen.reshape(-1), minlength=probs.shape[1]).float()
            self.routing = Routing(picks, probs.sum(dim=0), flat.shape[0])
        # In the residual's dtype, as transformers' (fp32 under bf16-mixed, not the autocast router's bf16)
        return self.experts(flat, chosen, weights.to(flat.dtype)).view_as(x)


def load_balancing_loss(routings: list[Routing]) -> torch.Tensor:
    """E * sum_e f_e * P_e over all sparse blocks together: f_e the share of top-k picks that went to expert e and P_e
    its mean router probability, each pooled over blocks and tokens before the product (as transformers 5's
    load_balancing_loss_func without an attention mask; the trainer's packed sequences have no padding)."""
    rows = sum(r.tokens for r in routings)
    picks = torch.stack([r.picks for r in routings]).sum(0) / rows
    probs = torch.stack([r.prob_sum for r in routings]).sum(0) / rows
    return picks.numel() * torch.sum(picks * probs)


def busiest_expert_load(routings: list[Routing]) -> float:
    """The most-picked expert's picks over the mean per expert, the busiest block's: 1 is perfectly balanced."""
    return max(float(r.picks.max() / r.picks.mean()) for r in routings)
