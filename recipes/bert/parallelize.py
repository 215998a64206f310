"""How the BERT encoder shards under tensor parallelism (Megatron style), as data: the same split as GPT-NeoX's.

Only the blocks are in the plan. The embedding (three tables and a LayerNorm) and the head (pooler + classifier or
MLP) are not a vocab-sized Embedding and Linear, which trnrecipes/parallel.py shards at the top level for decoders;
for this family they stay replicated, which that module does not do yet (nor hand the padding mask to a branch
whose input it re-lays out): training this family at layout.tp > 1 needs that first.
"""

from recipes.common.spec import check_tensor_parallel  # the TP rule: recipes/bert/spec.py

# Output features split: qkv rows are grouped per head ([q, k, v] blocks), so each rank gets whole heads.
COLUMN_PARALLEL = ("attn.qkv", "mlp.fc_in")
# Input features split; each rank's partial sums are reduced (or reduce-scattered along the sequence under SP).
ROW_PARALLEL = ("attn.out", "mlp.fc_out")
# Post-LN: each norm reads the residual sum after its branch; under sequence parallelism both sit on sequence shards.
NORMS = ("attn_norm", "mlp_norm")
BRANCHES = ("attn", "mlp")

__all__ = ["BRANCHES", "COLUMN_PARALLEL", "NORMS", "ROW_PARALLEL", "check_tensor_parallel"]
