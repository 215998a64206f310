"""How the BERT encoder shards under tensor parallelism (Megatron style), as data: the same split as GPT-NeoX's.

Only the blocks are in the plan. The embedding (three tables and a LayerNorm) and the head (pooler + classifier or
MLP) are not a vocab-sized Embedding and Linear, which trnrecipes/parallel/tensor.py shards at the top level for
decoders: TOP_LEVEL is empty, so they stay replicated (each TP rank computes the same embedding and head). The padding
mask reaches the core attention unchanged: each rank's heads read the whole mask. Sequence parallelism is refused
(trnrecipes/config/recipe.py): its re-layout of a branch's input would not carry the mask.
"""

from recipes.common.spec import check_tensor_parallel  # the TP rule: recipes/bert/spec.py

# Output features split: qkv rows are grouped per head ([q, k, v] blocks), so each rank gets whole heads.
COLUMN_PARALLEL = ("attn.qkv", "mlp.fc_in")
# Input features split; each rank's partial sums are reduced (or reduce-scattered along the sequence under SP).
ROW_PARALLEL = ("attn.out", "mlp.fc_out")
# Post-LN: each norm reads the residual sum after its branch; under sequence parallelism both sit on sequence shards.
NORMS = ("attn_norm", "mlp_norm")
BRANCHES = ("attn", "mlp")
TOP_LEVEL: tuple[str, ...] = ()  # embed and head replicated (see above)

__all__ = ["BRANCHES", "COLUMN_PARALLEL", "NORMS", "ROW_PARALLEL", "TOP_LEVEL", "check_tensor_parallel"]
