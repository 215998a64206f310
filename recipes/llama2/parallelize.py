"""How Llama 2 shards under tensor parallelism (Megatron style), as data.

trnrecipes.parallel.tensor applies it with DTensor off Neuron; the Neuron adapter maps the same names onto
neuronx-distributed's layers: a plain ColumnParallelLinear for qkv, since its rows are grouped per KV group and TP
must divide num_kv_heads (NxD's GQAQKVColumnParallelLinear, which replicates KV heads for larger TP, is not used).
"""

from recipes.common.spec import check_tensor_parallel  # the TP rule: recipes/llama2/spec.py

# Output features split: qkv rows are grouped per KV group and gate_up rows interleave gate/up, so each rank gets
# whole KV groups and whole SwiGLU units.
COLUMN_PARALLEL = ("attn.qkv", "mlp.gate_up")
# Input features split; partial sums reduced (or reduce-scattered along the sequence under SP).
ROW_PARALLEL = ("attn.out", "mlp.down")
# Norms computed on sequence shards under sequence parallelism; attn and mlp gather their input first.
NORMS = ("attn_norm", "mlp_norm")
BRANCHES = ("attn", "mlp")

__all__ = ["BRANCHES", "COLUMN_PARALLEL", "NORMS", "ROW_PARALLEL", "check_tensor_parallel"]
