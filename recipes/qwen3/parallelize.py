"""How Qwen3 shards under tensor parallelism (Megatron style), as data: Llama 2's plan (recipes/llama2/parallelize.py)
and the per-head q and k norms.

trnrecipes.parallel.tensor applies it with DTensor (cpu, cuda, TorchNeuron); torch-xla + NxD is refused for this
family (recipes/qwen3/spec.py).
"""

from recipes.common.spec import check_tensor_parallel  # the TP rule: recipes/qwen3/spec.py

# qkv rows are grouped per KV group and gate_up rows interleave gate/up: each rank gets whole groups and units.
COLUMN_PARALLEL = ("attn.qkv", "mlp.gate_up")
ROW_PARALLEL = ("attn.out", "mlp.down")
NORMS = ("attn_norm", "mlp_norm")  # on sequence shards under sequence parallelism
BRANCHES = ("attn", "mlp")
# Norms over head_dim whose input [b, s, heads, head_dim] is split by heads (dim 2) on every TP rank: one weight
# shared by the heads, replicated, its gradient summed over the ranks (torchtitan's Qwen3 plan does the same).
HEAD_NORMS = ("attn.q_norm", "attn.k_norm")
# Stacked experts [E, ...] (recipes/qwen3/moe.py) that expert parallelism (layout.ep) shards along dim 0. Under TP the
# sparse MLP holding them is not split: each TP rank routes its share of the tokens (trnrecipes/parallel/tensor.py).
EXPERTS = "mlp.experts"

__all__ = ["BRANCHES", "COLUMN_PARALLEL", "EXPERTS", "HEAD_NORMS", "NORMS", "ROW_PARALLEL", "check_tensor_parallel"]
