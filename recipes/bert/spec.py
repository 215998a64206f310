"""BERT as a family: a post-LayerNorm encoder with learned absolute positions and token types, and a head on one
pooled vector per sequence. Two heads: "classification" (BERT's pooler, tanh(dense(h[CLS])), then dropout and a
linear classifier: HF's BertForSequenceClassification) and "mlp" (the Amazon Search M5 shape: the [CLS] or the
mask-weighted mean hidden state, then an MLP with ReLU between its layers).

Torch-free (see recipes/common/spec.py); recipes/bert/model.py builds its model from BertConfig.

BertConfig subclasses DecoderConfig although this is an encoder: the class is the contract's shape (the six shared
fields, head_dim, param_count() = embedding + num_layers x layer + norm and head) and nothing in it is causal.
The parts map onto it as follows:
    embedding_params()  model.embed: word, position and token-type tables and the embedding LayerNorm. Unlike a
                        decoder's, it grows with max_seq_len (the position table has max_seq_len rows).
    layer_params()      one of model.layers (post-LN block: its two LayerNorms are inside the block).
    norm_head_params()  model.norm, an Identity (a post-LN encoder has no final norm: 0 parameters), and model.head
                        (pooler + classifier, or the MLP).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Literal

from recipes.common.spec import DECODER_BOUNDS, DecoderConfig, FamilySpec, divides
from trnrecipes.schema import FRACTION, NON_NEGATIVE, POSITIVE, Bound

HEADS = ("classification", "mlp")
POOLINGS = ("cls", "mean")


@dataclass(frozen=True)
class BertConfig(DecoderConfig):
    family: Literal["bert"] = field(default="bert", kw_only=True)
    # max_seq_len (shared field) is HF's max_position_embeddings: the rows of the position table.
    type_vocab_size: int = 2  # segment (sentence A / B) embeddings
    pad_token_id: int | None = 0  # its word embedding row gets no gradient (HF's padding_idx); None: none does
    norm_eps: float = 1e-12
    init_std: float = 0.02  # every weight normal(0, init_std), as HF's BERT init (no depth-scaled projections)
    dropout: float = 0.1  # HF hidden_dropout_prob: embeddings, after each branch's output projection
    attention_dropout: float = 0.1  # HF attention_probs_dropout_prob: on the attention probabilities
    classifier_dropout: float | None = None  # before the classifier / MLP head; None: `dropout` (as HF)
    head: Literal["classification", "mlp"] = "classification"
    num_labels: int = 2  # classes; the loss is cross-entropy over them
    pooling: Literal["cls", "mean"] = "cls"  # what the "mlp" head reads: h[CLS] or the mean over unmasked tokens
    mlp_hidden_sizes: tuple[int, ...] = ()  # "mlp" head: widths of its hidden layers, input side first
    activation_checkpointing: Literal["none", "selective", "elementwise", "full"] = "none"  # recipes/common/spec.py
    # The first N blocks (of each pipeline stage) checkpointed whole, the others per activation_checkpointing: memory
    # for recompute, a block at a time (Megatron-LM's --recompute-method block --recompute-num-layers N)
    activation_checkpointing_full_layers: int = 0

    def head_widths(self) -> list[int]:
        """The "mlp" head's layer widths, input to output: hidden_size, each hidden width, num_labels."""
        return [self.hidden_size, *self.mlp_hidden_sizes, self.num_labels]

    def embedding_params(self) -> int:
        """Word, position and token-type tables and the embedding LayerNorm (weight + bias)."""
        tables = self.vocab_size + self.max_seq_len + self.type_vocab_size
        return tables * self.hidden_size + 2 * self.hidden_size

    def layer_params(self) -> int:
        """One block: fused qkv and output projection with biases, 2-layer GELU MLP with biases, 2 LayerNorms."""
        h, f = self.hidden_size, self.ffn_hidden_size
        return (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h) + 2 * 2 * h

    def norm_head_params(self) -> int:
        """No final norm; the head: pooler (h x h + h) and classifier, or the MLP's linears (weights + biases)."""
        if self.head == "classification":
            h = self.hidden_size
            return (h * h + h) + (h * self.num_labels + self.num_labels)
        widths = self.head_widths()
        return sum(a * b + b for a, b in itertools.pairwise(widths))

    def flops_per_token(self, seq_len: int) -> int:
        """PaLM's 6N + 12 L H Q T over the encoder blocks only. The decoders count their embedding as a matmul,
        which their tied-size head nearly is; here the tables are lookups with no head of vocabulary size (for a
        small BERT the word table is most of N: 1.95M of bert-tiny's 2.07M), and the head runs once per sequence."""
        n = self.num_layers * self.layer_params()
        return 6 * n + 12 * self.num_layers * self.num_heads * self.head_dim * seq_len

    def problems(self) -> list[str]:
        if self.hidden_size % self.num_heads:
            return [f"model.hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}"]
        problems = []
        if self.pad_token_id is not None and self.pad_token_id >= self.vocab_size:
            problems.append(f"model.pad_token_id {self.pad_token_id} must be below vocab_size {self.vocab_size}")
        if self.num_labels < 2:
            problems.append(
                f"model.num_labels {self.num_labels}: the loss is cross-entropy over classes, so at least 2"
                " (regression is not supported)"
            )
        if self.head == "classification" and self.pooling != "cls":
            problems.append(
                f"model.pooling {self.pooling!r} needs model.head 'mlp': the classification head is BERT's pooler,"
                " which reads the first ([CLS]) token"
            )
        if self.head == "classification" and self.mlp_hidden_sizes:
            problems.append(
                f"model.mlp_hidden_sizes {list(self.mlp_hidden_sizes)} needs model.head 'mlp' (head is"
                " 'classification')"
            )
        return problems

    def tp_problems(self, tp: int) -> list[str]:
        """Each rank holds whole heads (qkv rows are grouped per head) and whole MLP units. The embedding and the
        head are small and not split, so the vocabulary need not divide."""
        return divides(tp, self, "num_heads", "ffn_hidden_size")


# The decoders' ranges but rotary_base (no rotary embeddings here), and this family's own.
BERT_BOUNDS: dict[str, Bound] = {name: bound for name, bound in DECODER_BOUNDS.items() if name != "rotary_base"} | {
    "type_vocab_size": POSITIVE, "pad_token_id": NON_NEGATIVE, "dropout": FRACTION, "attention_dropout": FRACTION,
    "classifier_dropout": FRACTION, "num_labels": POSITIVE, "mlp_hidden_sizes": POSITIVE,
}  # fmt: skip

SPEC = FamilySpec(
    name="bert",
    config=BertConfig,
    bounds=BERT_BOUNDS,
    model_class="Bert",
    # Export writes BertForSequenceClassification (the classification head) or BertModel (the "mlp" head, whose
    # MLP transformers has no class for); import reads those and BERT's pre-training checkpoints.
    hf_architectures=("BertForSequenceClassification", "BertModel", "BertForMaskedLM", "BertForPreTraining"),
    hf_model_type="bert",
    objective="classification",
)
