"""Fused, chunked LM head + cross-entropy: mean loss of softmax(hidden @ weight.T) without the full logits.

For a causal LM the head + loss is where the memory goes: N tokens x V vocab fp32 logits (2048 x 50304 = 400 MB),
then as many again for their log-softmax and their gradient. Here the tokens are walked in chunks; each chunk's
logits live only long enough to give its loss and, right away, its gradient (softmax - one-hot, already divided by
the number of valid labels), which is folded into d(hidden) and d(weight) before the next chunk reuses the buffer.
Backward then only scales those stored gradients by the incoming grad. Same math as F.linear + F.cross_entropy
(mean over labels != ignore_index), fp32 accumulation whatever the parameter dtype. The idea is Liger-Kernel's
fused linear cross entropy.

Lives in recipes/ (plain PyTorch, no trnrecipes import) so the model code can use it. The models take their loss
from a `head_loss` attribute, fused_head_loss by default; the parallelize step switches a model whose head is tensor
parallel to logits_loss (full logits gathered by the head, then plain cross-entropy). Which one applies is decided
there, where the head's layout is known, not by inspecting the head here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_size, ignore_index, need_hidden_grad, need_weight_grad):
        n = hidden.shape[0]
        # Upcast once (a no-op for fp32): bf16 logits and softmax would lose the loss's precision.
        w = weight.float()
        valid = labels != ignore_index
        # A tensor, not .item(): no host sync on lazy/XLA devices. No valid label: loss 0 and zero grads, no 0/0.
        scale = 1.0 / valid.sum().clamp_min(1).float()
        safe_labels = labels.masked_fill(~valid, 0)  # any in-range index; ignored rows are zeroed below
        fp32 = dict(dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty(n, hidden.shape[1], **fp32) if need_hidden_grad else None
        # The first chunk writes grad_weight, the others add to it (zeros only if there is no chunk at all).
        grad_weight = (torch.empty_like(w) if n else torch.zeros_like(w)) if need_weight_grad else None
        loss = torch.zeros((), **fp32)
        # One logits buffer for all chunks: a fresh chunk-sized allocation per chunk costs page faults on CPU.
        buf = torch.empty(min(chunk_size, n), w.shape[0], **fp32)
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            h = hidden[start:end].float()
            target, keep = safe_labels[start:end, None], valid[start:end]
            logits = torch.mm(h, w.t(), out=buf[: end - start])
            target_logit = logits.gather(1, target).squeeze(1)
            # softmax in place (max-shifted for stability): logits -> exp(logits - max), then normalised below.
            row_max = logits.amax(1, keepdim=True)
            logits.sub_(row_max).exp_()
            sum_exp = logits.sum(1, keepdim=True)
            lse = (row_max + sum_exp.log()).squeeze(1)
            loss += ((lse - target_logit) * keep).sum()
            if grad_hidden is None and grad_weight is None:
                continue
            # d(mean loss)/d(logits) = (softmax - onehot) * scale on valid rows, 0 on ignored ones; the division
            # by sum_exp and the scale share one pass over the chunk.
            row_scale = keep.float().unsqueeze(1) * scale
            grad_logits = logits.mul_(row_scale / sum_exp)
            grad_logits.scatter_add_(1, target, -row_scale)
            if grad_hidden is not None:
                torch.mm(grad_logits, w, out=grad_hidden[start:end])
            if grad_weight is not None and start == 0:
                torch.mm(grad_logits.t(), h, out=grad_weight)
            elif grad_weight is not None:
                grad_weight.addmm_(grad_logits.t(), h)
        ctx.save_for_backward(
            grad_hidden.to(hidden.dtype) if grad_hidden is not None else None,
            grad_weight.to(weight.dtype) if grad_weight is not None else None,
        )
        return loss * scale

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight = ctx.saved_tensors
        # The loss is a scalar, so the chain rule is a scale, by exactly 1.0 after a plain loss.backward(). Skipping
        # that [V, H] multiply is only worth a look on CPU, where reading the scalar costs no device sync.
        if grad_output.device.type != "cpu" or grad_output.item() != 1.0:
            grad_hidden = grad_hidden * grad_output if grad_hidden is not None else None
            grad_weight = grad_weight * grad_output if grad_weight is not None else None
        return grad_hidden, grad_weight, None, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int = 1024,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Mean over labels != ignore_index of cross_entropy(hidden @ weight.T, labels), computed in fp32.

    hidden [N, H], weight [V, H], labels [N] -> scalar fp32 loss. Gradients (computed during this call, so only
    [N, H] + [V, H] of them are kept instead of [N, V] logits) come back in the inputs' dtypes. At most chunk_size x V
    fp32 logits exist at a time (1024 x 50304: 206 MB; 1024 was the fastest on CPU, 512 within noise). Because the
    gradients are made in forward, evaluate under torch.no_grad(), which skips them.
    """
    if hidden.dim() != 2 or labels.shape != hidden.shape[:1]:
        raise ValueError(f"hidden must be [N, H] and labels [N], got {tuple(hidden.shape)} and {tuple(labels.shape)}")
    grad = torch.is_grad_enabled()  # forward runs with grad off, so decide here whether to make gradients at all
    return _LinearCrossEntropy.apply(
        hidden,
        weight,
        labels,
        chunk_size,
        ignore_index,
        grad and hidden.requires_grad,
        grad and weight.requires_grad,
    )


def fused_head_loss(head: nn.Module, x: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX):
    """Mean next-token loss of `head` on the final hidden states x [b, s, h]; labels [b, s] already shifted.

    The fused chunked path (linear_cross_entropy): the [b, s, vocab] logits never exist. It reads head.weight as
    the whole vocabulary, so it needs a bias-free nn.Linear holding a plain (not DTensor) weight. A head split over
    tensor-parallel ranks takes logits_loss instead: the parallelize step sets model.head_loss to it.
    """
    weight = getattr(head, "weight", None)
    if type(head) is not nn.Linear or head.bias is not None:
        raise TypeError(
            f"fused_head_loss needs a bias-free nn.Linear head, got {type(head).__name__}"
            f"{' with a bias' if type(head) is nn.Linear else ''}; use logits_loss for this head"
        )
    if type(weight) not in (torch.Tensor, nn.Parameter):  # e.g. a DTensor: one vocabulary shard per TP rank
        raise TypeError(
            f"fused_head_loss needs the head's whole weight as a plain tensor, got {type(weight).__name__}"
            " (a tensor-parallel head?); use logits_loss for this head"
        )
    return linear_cross_entropy(x.flatten(0, 1), weight, labels.flatten(), ignore_index=ignore_index)


def logits_loss(head: nn.Module, x: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX):
    """The same loss through head(x): full [b, s, vocab] logits, then cross-entropy in fp32.

    For any head, in particular a tensor-parallel one (a DTensor-sharded nn.Linear, a Neuron ColumnParallelLinear)
    whose own forward gathers the full logits from the vocabulary shards.
    """
    logits = head(x)
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=ignore_index)
