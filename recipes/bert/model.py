"""BERT encoder + head in plain single-device PyTorch, numerically equal to Hugging Face's BertModel /
BertForSequenceClassification (fp32, eval mode; dropout as theirs in training).

Post-LayerNorm blocks: x = norm(x + attn(x)), then x = norm(x + mlp(x)). A [batch, seq] padding mask (1 = token,
0 = padding, HF's `attention_mask`) keeps padding out of every query's keys; padded positions still get hidden
states, which the heads never read (the [CLS] token, or a mean over unmasked tokens).

The qkv projection is fused with rows grouped per head ([q, k, v] of head 0, then head 1, ...) so a contiguous row
shard holds whole heads (recipes/bert/parallelize.py); the forward counts heads from the weight's shape.

The attention core is EncoderCoreAttention, a subclass of recipes/common/attention.CoreAttention: the common one is
causal and takes no mask, and changing it would touch every decoder. Subclassing keeps selective activation
checkpointing (which looks for CoreAttention instances) working here unchanged.

No parallelism, activation checkpointing or compilation here (see recipes/llama2/model.py). Unlike the decoders'
blocks, a block takes the padding mask as a second argument, and the head reads the mask too.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from recipes.bert.spec import BertConfig
from recipes.common.attention import CoreAttention
from recipes.common.init import Init, init_full, standard_init_rules

BertArgs = BertConfig  # the recipe's model section is the model's arguments: one definition of the fields


class EncoderCoreAttention(CoreAttention):
    """Bidirectional softmax(q k^T / sqrt(d) + bias) v with dropout on the probabilities while training. `keep`
    [b, 1, 1, s] (True = a real key) becomes HF's additive bias, 0 or the dtype's most negative value, built in q's
    dtype here so that it stays finite under autocast (fp32's minimum would round to -inf in bf16 or fp16, and a
    query whose keys are all padding would then get NaN instead of HF's uniform weights)."""

    def __init__(self, dropout: float):
        super().__init__()
        self.dropout = dropout

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None = None
    ) -> torch.Tensor:
        bias = None
        if keep is not None:
            bias = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill(~keep, torch.finfo(q.dtype).min)
        p = self.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=p)


class Embeddings(nn.Module):
    def __init__(self, args: BertArgs):
        super().__init__()
        self.word = nn.Embedding(args.vocab_size, args.hidden_size, padding_idx=args.pad_token_id)
        self.position = nn.Embedding(args.max_seq_len, args.hidden_size)
        self.token_type = nn.Embedding(args.type_vocab_size, args.hidden_size)
        self.norm = nn.LayerNorm(args.hidden_size, eps=args.norm_eps)
        self.dropout = nn.Dropout(args.dropout)

    def forward(self, tokens: torch.Tensor, token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        if token_type_ids is None:  # one segment: type 0 everywhere, as HF
            token_type_ids = torch.zeros_like(tokens)
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        # HF's order of the sums (word + type, then + position): fp32 results equal theirs bit for bit.
        x = self.word(tokens) + self.token_type(token_type_ids) + self.position(positions)
        return self.dropout(self.norm(x))


class Attention(nn.Module):
    def __init__(self, args: BertArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.qkv = nn.Linear(args.hidden_size, 3 * args.hidden_size)  # rows per head: [q, k, v] (see the docstring)
        self.out = nn.Linear(args.hidden_size, args.hidden_size)
        self.core = EncoderCoreAttention(args.attention_dropout)  # no parameters: a handle for checkpointing
        self.dropout = nn.Dropout(args.dropout)

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, -1, 3 * self.head_dim).transpose(1, 2).chunk(3, dim=-1)
        y = self.core(q, k, v, keep)
        return self.dropout(self.out(y.transpose(1, 2).reshape(b, s, -1)))


class MLP(nn.Module):
    def __init__(self, args: BertArgs):
        super().__init__()
        self.fc_in = nn.Linear(args.hidden_size, args.ffn_hidden_size)
        self.fc_out = nn.Linear(args.ffn_hidden_size, args.hidden_size)
        self.dropout = nn.Dropout(args.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc_out(F.gelu(self.fc_in(x))))  # exact (erf) GELU, as HF's "gelu"


class Layer(nn.Module):
    def __init__(self, args: BertArgs):
        super().__init__()
        self.attn = Attention(args)
        self.attn_norm = nn.LayerNorm(args.hidden_size, eps=args.norm_eps)
        self.mlp = MLP(args)
        self.mlp_norm = nn.LayerNorm(args.hidden_size, eps=args.norm_eps)

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        x = self.attn_norm(x + self.attn(x, keep))  # post-LN: the norm follows the residual sum
        return self.mlp_norm(x + self.mlp(x))


def mean_pool(x: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """[b, s, h] -> [b, h]: the mean over unmasked tokens, as sentence-transformers pools all-MiniLM-L6-v2 (its
    1e-9 floor on the count included)."""
    if attention_mask is None:
        return x.mean(dim=1)
    m = attention_mask.to(x.dtype).unsqueeze(-1)
    return (x * m).sum(dim=1) / m.sum(dim=1).clamp(min=1e-9)


def _classifier_dropout(args: BertArgs) -> float:
    return args.dropout if args.classifier_dropout is None else args.classifier_dropout


class ClassificationHead(nn.Module):
    """BertForSequenceClassification's: tanh(pooler(h[CLS])), dropout, classifier."""

    def __init__(self, args: BertArgs):
        super().__init__()
        self.pooler = nn.Linear(args.hidden_size, args.hidden_size)
        self.dropout = nn.Dropout(_classifier_dropout(args))
        self.classifier = nn.Linear(args.hidden_size, args.num_labels)

    def pool(self, x: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        return torch.tanh(self.pooler(x[:, 0]))  # HF's pooler_output

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.classifier(self.dropout(self.pool(x, attention_mask)))


class MLPHead(nn.Module):
    """The M5 shape: the [CLS] or mean hidden state, dropout, then linears with ReLU between them."""

    def __init__(self, args: BertArgs):
        super().__init__()
        self.pooling = args.pooling
        self.dropout = nn.Dropout(_classifier_dropout(args))
        widths = args.head_widths()
        self.linears = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(widths))

    def pool(self, x: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        return x[:, 0] if self.pooling == "cls" else mean_pool(x, attention_mask)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        y = self.dropout(self.pool(x, attention_mask))
        for i, linear in enumerate(self.linears):
            y = linear(y) if i == 0 else linear(F.relu(y))
        return y


class Bert(nn.Module):
    def __init__(self, args: BertArgs):
        super().__init__()
        self.args = args
        self.embed = Embeddings(args)
        self.layers = nn.ModuleList(Layer(args) for _ in range(args.num_layers))
        self.norm = nn.Identity()  # post-LN: no final norm; kept so the parts read embed -> layers -> norm -> head
        self.head = ClassificationHead(args) if args.head == "classification" else MLPHead(args)
        # No init here: construction on the meta device stays free. Callers run init_weights() (or load weights).

    def _check(self, tokens: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
        if tokens.shape[1] > self.args.max_seq_len:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds model.max_seq_len {self.args.max_seq_len}")
        if attention_mask is not None and attention_mask.shape != tokens.shape:
            raise ValueError(
                f"attention_mask must have the tokens' shape {tuple(tokens.shape)}, got {tuple(attention_mask.shape)}"
            )

    def hidden_states(
        self,
        tokens: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens [b, s] -> the last layer's hidden states [b, s, hidden] (HF's last_hidden_state)."""
        self._check(tokens, attention_mask)
        keep = None if attention_mask is None else attention_mask.bool()[:, None, None, :]
        x = self.embed(tokens, token_type_ids)
        for layer in self.layers:
            x = layer(x, keep)
        return self.norm(x)

    def encode(
        self,
        tokens: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The pooled embedding [b, hidden] the head reads: the pooler output (classification head; HF's
        pooler_output) or the [CLS] / mean hidden state ("mlp" head). Not normalised."""
        x = self.hidden_states(tokens, attention_mask, token_type_ids)
        return self.head.pool(x, attention_mask)

    def forward(
        self,
        tokens: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens [b, s] -> logits [b, num_labels]; or, given labels [b] (class ids; -100 = ignore), the mean
        cross-entropy over the labelled sequences, computed in fp32."""
        logits = self.head(self.hidden_states(tokens, attention_mask, token_type_ids), attention_mask)
        if labels is None:
            return logits
        if labels.shape != logits.shape[:1]:
            raise ValueError(
                f"labels must be one class id per sequence, shape {tuple(logits.shape[:1])}; got {tuple(labels.shape)}"
            )
        return F.cross_entropy(logits.float(), labels)

    def init_rules(self) -> dict[str, Init]:
        """HF's BERT init: every weight (embedding tables included) normal(0, init_std), biases zero, norms one.
        The padding row of the word table is drawn like the others: it gets no gradient and is masked out."""
        return standard_init_rules(self, self.args.init_std)

    def init_weights(self, seed: int = 0) -> None:
        """Initialise the whole (unsharded) model: bitwise what every sharded layout builds for the same seed."""
        init_full(self, self.init_rules(), seed)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
