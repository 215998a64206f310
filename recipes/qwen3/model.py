"""Qwen3 in plain single-device PyTorch, numerically equal to Hugging Face's Qwen3ForCausalLM and Qwen3MoeForCausalLM.

Llama 2's block (recipes/llama2/model.py: the fused qkv grouped per KV group, the interleaved gate_up, RMSNorm, RoPE)
with Qwen3's changes: an RMSNorm over head_dim on every query and key head before RoPE (q_norm, k_norm: one weight
shared by the heads, so a tensor-parallel rank holding some heads normalises them alone), head_dim its own field,
and, where the config ties them, the head reading the embedding's weight. The MLP is chosen per block
(`mlp_for_layer`): Qwen3-MoE's sparse blocks (recipes/qwen3/moe.py) sit beside dense ones; in training the
load-balancing loss over all of them, times router_aux_loss_coef, is added to the returned loss.
"""

from __future__ import annotations

import torch
from torch import nn

from recipes.common.attention import CoreAttention
from recipes.common.init import Init, init_full, standard_init_rules
from recipes.common.loss import fused_head_loss
from recipes.llama2.model import MLP, RMSNorm, rope_tables, rotate_half
from recipes.qwen3.moe import Routing, SparseMLP, busiest_expert_load, load_balancing_loss
from recipes.qwen3.spec import Qwen3Config


class Attention(nn.Module):
    def __init__(self, args: Qwen3Config):
        super().__init__()
        self.head_dim = args.head_dim
        self.q_per_kv = args.num_heads // args.num_kv_heads  # the same on every TP rank
        self.rotary_base = args.rotary_base
        # Rows grouped per KV group g: [q heads of g | k head g | v head g], so row shards keep whole groups.
        self.qkv = nn.Linear(args.hidden_size, (args.num_heads + 2 * args.num_kv_heads) * args.head_dim, bias=False)
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps)
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps)
        self.out = nn.Linear(args.num_heads * args.head_dim, args.hidden_size, bias=False)
        self.core = CoreAttention()  # no parameters: a handle for selective activation checkpointing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        hd, qpk = self.head_dim, self.q_per_kv
        qkv = self.qkv(x).view(b, s, -1, (qpk + 2) * hd)  # local KV groups from the weight's shape (TP shards)
        groups = qkv.shape[2]
        q, k, v = qkv.split([qpk * hd, hd, hd], dim=-1)
        # [b, s, heads, hd]: the norms see one head per row, as HF's (which norms before transposing)
        q = self.q_norm(q.reshape(b, s, groups * qpk, hd)).transpose(1, 2)
        k = self.k_norm(k).transpose(1, 2)  # [b, groups, s, hd]
        v = v.transpose(1, 2)

        cos, sin = self.rope(s, x.device, x.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin

        o = self.core(q, k, v)
        return self.out(o.transpose(1, 2).reshape(b, s, -1))

    def rope(self, seq_len: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's (cos, sin) for positions 0..seq_len-1. The parallelize step may shadow it on an instance, as it swaps
        core.kernel: context parallelism gives each rank its tokens' true positions (trnrecipes/parallel/context.py)."""
        return rope_tables(seq_len, self.head_dim, self.rotary_base, device, dtype)


def mlp_for_layer(args: Qwen3Config, layer: int) -> nn.Module:
    """The MLP of block `layer`: the mixture of experts where the config makes the block sparse, else Qwen3's dense
    SwiGLU (Llama's, rows of gate_up interleaved)."""
    return SparseMLP(args) if args.is_sparse(layer) else MLP(args)


class Block(nn.Module):
    def __init__(self, args: Qwen3Config, layer: int):
        super().__init__()
        self.attn_norm = RMSNorm(args.hidden_size, args.norm_eps)
        self.attn = Attention(args)
        self.mlp_norm = RMSNorm(args.hidden_size, args.norm_eps)
        self.mlp = mlp_for_layer(args, layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Qwen3(nn.Module):
    def __init__(self, args: Qwen3Config):
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Block(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.norm_eps)
        # Tied: no head module at all, so the state dict, the optimizer and checkpoints hold the one tensor once
        # (embed.weight; `convert to-hf` writes no lm_head, as transformers' save_pretrained does for a tied model).
        if not args.tie_embeddings:
            self.head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.head_loss = fused_head_loss  # a plain function; the parallelize step swaps in a vocab-parallel loss

    def output_head(self) -> nn.Module:
        """What turns hidden states into logits: the head, or the embedding whose [vocab, hidden] weight it is."""
        return self.embed if self.args.tie_embeddings else self.head

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [b, s] -> logits [b, s, vocab]; or, given labels [b, s] (already shifted; -100 = ignore), the mean
        loss over the labelled positions (self.head_loss: the fused chunked head + cross-entropy by default)."""
        x = self.embed(tokens)
        a = self.args  # the blocks' RoPE tables, made here, outside their compiled graphs (recipes/common/rope.py)
        rope_tables(tokens.shape[1], a.head_dim, a.rotary_base, x.device, x.dtype)
        for layer in self.layers:
            x = layer(x)
        x = self.norm(x)
        if labels is None:  # the head module itself where there is one: a tensor-parallel head gathers its logits
            return nn.functional.linear(x, self.embed.weight) if self.args.tie_embeddings else self.head(x)
        loss = self.head_loss(self.output_head(), x, labels)
        if self.training and self.args.router_aux_loss_coef > 0:  # validation's loss stays the cross-entropy
            loss = loss + self.args.router_aux_loss_coef * load_balancing_loss(self.routings())
        for layer in self.layers:  # kept for router_health only: no graph held until the next forward
            if isinstance(layer.mlp, SparseMLP):
                layer.mlp.routing = Routing(*(t.detach() if torch.is_tensor(t) else t for t in layer.mlp.routing))
        return loss

    def routings(self) -> list:
        """Each sparse block's routing in the last forward (recipes/qwen3/moe.py); empty for a dense model."""
        return [layer.mlp.routing for layer in self.layers if isinstance(layer.mlp, SparseMLP)]

    def router_health(self) -> dict[str, float]:
        """The last forward's load-balancing loss and busiest expert's load over the mean; {} for a dense model."""
        routings = self.routings()
        if not routings:
            return {}
        aux = float(load_balancing_loss(routings).detach())
        return {"router_aux_loss": aux, "expert_load_max": busiest_expert_load(routings)}

    def init_rules(self) -> dict[str, Init]:
        """As Llama 2's (recipes/common/init.py): normal(init_std), output projections (the experts' too) scaled by
        1/sqrt(2L), norms (the q and k norms too) one; the router normal(init_std)."""
        outputs = ("attn.out.weight", "mlp.down.weight", "mlp.experts.down")
        return standard_init_rules(self, self.args.init_std, outputs, self.args.num_layers)

    def init_weights(self, seed: int = 0) -> None:
        """Initialise the whole (unsharded) model: bitwise what every sharded layout builds for the same seed."""
        init_full(self, self.init_rules(), seed)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
