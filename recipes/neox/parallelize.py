"""How GPT-NeoX shards under tensor parallelism (Megatron style), as data.

trnrecipes.parallel.tensor applies it with DTensor off Neuron; the Neuron adapter maps the same names onto
neuronx-distributed's ColumnParallelLinear / RowParallelLinear / ParallelEmbedding.
"""

from recipes.common.spec import check_tensor_parallel  # the TP rule: recipes/neox/spec.py

# Output features split across ranks: qkv rows are grouped per head ([q, k, v] blocks), so each rank gets whole heads.
COLUMN_PARALLEL = ("attn.qkv", "mlp.fc_in")
# Input features split; each rank's partial sums are reduced (or reduce-scattered along the sequence under SP).
ROW_PARALLEL = ("attn.out", "mlp.fc_out")
# Norms computed on sequence shards under sequence parallelism; attn and mlp gather their input first.
NORMS = ("attn_norm", "mlp_norm")
BRANCHES = ("attn", "mlp")

__all__ = ["BRANCHES", "COLUMN_PARALLEL", "NORMS", "ROW_PARALLEL", "check_tensor_parallel"]
