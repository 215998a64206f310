"""Fused, chunked LM head + cross-entropy: mean loss of softmax(hidden @ weight.T) without the full logits.

For a causal LM the head + loss is where the memory goes: N tokens x V vocab fp32 logits (2048 x 50304 = 400 MB),
then as many again for their log-softmax and their gradient. Here the tokens are walked in chunks; each chunk's
logits live only long enough to give its loss and, right away, its gradient (softmax - one-hot, already divided by
the number of valid labels), which is folded into d(hidden) and d(weight) before the next chunk reuses the buffer.
Backward then only scales those stored gradients by the incoming grad. Same math as F.linear + F.cross_entropy
(mean over labels != ignore_index). The idea is Liger-Kernel's fused linear cross entropy.

Precision. The softmax / log-sum-exp, the loss sum, the gradient of the logits and the accumulation of d(weight)
over chunks are fp32 always. The three head GEMMs (logits, d(hidden), d(weight)) run in `gemm_dtype`:
- fp32 when the weight is fp32 (any device) and on CPU whatever the weight dtype: the weight and each hidden chunk
  are upcast. CPU bf16 GEMMs without AMX are slower than fp32 ones, and CPU fp32 results stay bitwise what they were.
- the weight's bf16 / fp16 on an accelerator (cuda, xla, neuron, ...): upcasting there ran the GEMMs on fp32 units
  (on an H100 with bf16 weights they were 52% of GPU time and halved throughput). The GEMMs take bf16/fp16 inputs,
  sum their products in fp32 and, where the device has the kernel, write fp32 outputs (torch.mm / torch.addmm with
  out_dtype=torch.float32: cuBLAS only, see _fp32_out_support); elsewhere the output is rounded to the GEMM dtype
  and cast up, as transformers' logits.float() does. The fp32 gradient of the logits is cast to the GEMM dtype for
  the two backward GEMMs, before its 1 / n_valid scale (applied to their fp32 outputs: fp16's range would flush
  the scaled values to zero).
The loss then matches the fp32 reference on the upcast bf16 tensors to fp32 rounding when the logits come out in
fp32, to bf16 rounding of the logits otherwise; the gradients to bf16 rounding of the gradient of the logits.

Tensor parallel heads (each rank holds V / tp rows of the weight): the same loop on each rank's rows
(vocab_parallel_cross_entropy, Megatron's vocab-parallel cross-entropy, chunked): each chunk's row max, its sum of
exps and the target's logit are all-reduced over the TP group, so a rank holds [chunk, V / tp] fp32 logits at a time
and no rank ever holds the whole vocabulary's (Llama 3.1, 8192 tokens: 4.2 GB of fp32 logits gathered otherwise).

Lives in recipes/ (plain PyTorch and torch.distributed, no trnrecipes import) so the model code can use it. The
models take their loss from a `head_loss` attribute, fused_head_loss by default; the parallelize step switches a
model whose head is tensor parallel to a vocab-parallel one (DTensor: trnrecipes/parallel/tensor.py; NxD's own:
trnrecipes/parallel/nxd.py). Which one applies is decided there, where the head's layout is known, not by
inspecting the head here. logits_loss (full logits, then plain cross-entropy) takes any head.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100

LOW_PRECISION_DTYPES = (torch.bfloat16, torch.float16)

# Rows of logits per chunk. The chunk's fp32 logits take chunk x V x 4 bytes and, on the low-precision path, its
# gradient cast to the GEMM dtype another chunk x V x 2 bytes. cpu: 1024 x 50304 = 206 MB, the fastest there (512
# within noise). cuda: 4096 rows keep every GEMM large (M = 4096 for the logits, K = 4096 for d(weight), so the
# [V, H] fp32 accumulator's read + write costs little next to its GEMM) for 4096 x 50304 x 4 = 824 MB of fp32
# logits + 412 MB of bf16 gradient (32000 vocab: 524 + 262 MB; 8192 rows would double both). Chosen by that
# arithmetic, not yet timed against 8192 on a GPU. Other devices (xla, neuron, ...) keep 1024: nothing measured
# there says otherwise.
CHUNK_SIZES = {"cpu": 1024, "cuda": 4096}
DEFAULT_CHUNK_SIZE = 1024


def default_chunk_size(device_type: str) -> int:
    """Rows per chunk when linear_cross_entropy is given none: CHUNK_SIZES[device_type], else 1024."""
    return CHUNK_SIZES.get(device_type, DEFAULT_CHUNK_SIZE)


def _gemm_dtype(weight_dtype: torch.dtype, device_type: str) -> torch.dtype:
    """The automatic GEMM dtype: the weight's bf16 / fp16 on an accelerator, fp32 otherwise (fp32 weights, CPU)."""
    if device_type != "cpu" and weight_dtype in LOW_PRECISION_DTYPES:
        return weight_dtype
    return torch.float32


# (device type, GEMM dtype) -> (mm, addmm) take out_dtype=torch.float32. The out_dtype overloads of mm / bmm /
# addmm / baddbmm (cuBLAS, pytorch PR 150812, 2025) are documented in torch 2.13 as "Supported only on CUDA and for
# torch.float32 given torch.float16/torch.bfloat16 input dtypes": its CPU build registers no CPU kernel for
# aten::mm.dtype / addmm.dtype (NotImplementedError), only Meta and autograd; their kernels are in cuda/Blas.cpp
# (bmm.dtype's native_functions.yaml entry dispatches to CUDA alone), so XLA / Neuron have none either. The first
# CUDA version of addmm.dtype also rejects an fp32 `self` ("self and mat2 must have the same dtype"), a later one
# takes it ("self dtype must match either out_dtype or mat1 dtype"), which lets d(weight) accumulate in place.
# Probed once rather than read off a version. Only cuda (and meta, whose shape functions accept both: tracing,
# tests) is probed: on a lazy device a probe might record a graph instead of failing.
_FP32_OUT_SUPPORT: dict[tuple[str, torch.dtype], tuple[bool, bool]] = {}
_PROBED_DEVICE_TYPES = ("cuda", "meta")


def _fp32_out_support(device: torch.device, dtype: torch.dtype) -> tuple[bool, bool]:
    key = (device.type, dtype)
    if key not in _FP32_OUT_SUPPORT:
        probed = device.type in _PROBED_DEVICE_TYPES
        _FP32_OUT_SUPPORT[key] = _probe_fp32_out(device, dtype) if probed else (False, False)
    return _FP32_OUT_SUPPORT[key]


def _probe_fp32_out(device: torch.device, dtype: torch.dtype) -> tuple[bool, bool]:
    a = torch.zeros(1, 1, dtype=dtype, device=device)
    acc = torch.zeros(1, 1, dtype=torch.float32, device=device)
    try:
        torch.mm(a, a, out_dtype=torch.float32, out=acc)
    except (RuntimeError, TypeError):  # NotImplementedError is a RuntimeError; TypeError: a torch without out_dtype
        return False, False
    try:
        torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
    except (RuntimeError, TypeError):
        return True, False
    return True, True


def _mm_fp32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, accumulate: bool, support: tuple[bool, bool]):
    """out = a @ b, or out += a @ b when accumulate: a, b in a low-precision dtype, out fp32."""
    mm_ok, addmm_ok = support
    if accumulate and addmm_ok:
        torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
    elif mm_ok and not accumulate:
        torch.mm(a, b, out_dtype=torch.float32, out=out)
    elif mm_ok:  # no in-place fp32 accumulation: an fp32 product, then an add (one more pass over out)
        out.add_(torch.mm(a, b, out_dtype=torch.float32))
    else:
        # No fp32-output GEMM here (CPU, XLA, Neuron, ...): the product is rounded to the inputs' dtype (its sums
        # are still fp32 inside the GEMM), then cast up, as transformers' logits.float().
        product = torch.mm(a, b)
        out.add_(product) if accumulate else out.copy_(product)


class VocabShard(NamedTuple):
    """Where a rank's head rows sit in the vocabulary: rows vocab_start.. of the whole weight, the others on the
    other ranks of `group`."""

    group: dist.ProcessGroup | None
    vocab_start: int


def _one_hot_rows(values: torch.Tensor, in_shard: torch.Tensor | None, start: int, end: int) -> torch.Tensor:
    """The one-hot's value per row [c, 1]: on a vocabulary shard only where the row's label is one of its entries."""
    return values if in_shard is None else values * in_shard[start:end, None]


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, hidden, weight, labels, chunk_size, ignore_index, gemm_dtype, need_hidden_grad, need_weight_grad, shard
    ):
        n = hidden.shape[0]
        low = gemm_dtype != torch.float32
        # fp32 GEMMs: upcast once (a no-op for fp32). Low precision: the weight as it is (a no-op in the automatic
        # case); the fp32 outputs (or the cast up) keep the logits and the softmax in fp32 either way.
        w = weight.to(gemm_dtype) if low else weight.float()
        support = _fp32_out_support(hidden.device, gemm_dtype) if low else (False, False)
        valid = labels != ignore_index
        # A tensor, not .item(): no host sync on lazy/XLA devices. No valid label: loss 0 and zero grads, no 0/0.
        scale = 1.0 / valid.sum().clamp_min(1).float()
        safe_labels = labels.masked_fill(~valid, 0)  # any in-range index; ignored rows are zeroed below
        in_shard = None  # a vocabulary shard: which labels fall in it, as row offsets into this rank's weight rows
        if shard is not None:
            local_labels = safe_labels - shard.vocab_start
            in_shard = valid & (local_labels >= 0) & (local_labels < w.shape[0])
            safe_labels = local_labels.masked_fill(~in_shard, 0)
        fp32 = dict(dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty(n, hidden.shape[1], **fp32) if need_hidden_grad else None
        # The first chunk writes grad_weight, the others add to it (zeros only if there is no chunk at all).
        grad_weight = (
            (torch.empty_like(w, dtype=torch.float32) if n else torch.zeros_like(w, dtype=torch.float32))
            if need_weight_grad
            else None
        )
        loss = torch.zeros((), **fp32)
        # One logits buffer for all chunks: a fresh chunk-sized allocation per chunk costs page faults on CPU.
        buf = torch.empty(min(chunk_size, n), w.shape[0], **fp32)
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            target, keep = safe_labels[start:end, None], valid[start:end]
            if low:
                h = hidden[start:end].to(gemm_dtype)
                logits = buf[: end - start]
                _mm_fp32(h, w.t(), logits, False, support)
            else:
                h = hidden[start:end].float()
                logits = torch.mm(h, w.t(), out=buf[: end - start])
            target_logit = logits.gather(1, target).squeeze(1)
            # softmax in place (max-shifted for stability): logits -> exp(logits - max), then normalised below.
            row_max = logits.amax(1, keepdim=True)
            if shard is not None:  # the max over the whole vocabulary: every rank shifts by the same value
                dist.all_reduce(row_max, dist.ReduceOp.MAX, group=shard.group)
            logits.sub_(row_max).exp_()
            sum_exp = logits.sum(1, keepdim=True)
            if shard is not None:
                # The sum of exps over the whole vocabulary and the target's logit (from the rank that holds it, 0
                # elsewhere) in one all-reduce.
                target_logit = target_logit * in_shard[start:end]
                both = torch.cat([sum_exp, target_logit[:, None]], 1)
                dist.all_reduce(both, group=shard.group)
                sum_exp, target_logit = both[:, :1], both[:, 1]
            lse = (row_max + sum_exp.log()).squeeze(1)
            loss += ((lse - target_logit) * keep).sum()
            if grad_hidden is None and grad_weight is None:
                continue
            if low:
                # d(loss sum)/d(logits) = softmax - onehot on valid rows, 0 on ignored ones, in fp32, then cast for
                # the GEMMs. The 1 / n_valid scale waits for their fp32 outputs: (softmax - onehot) / n_valid would
                # flush to zero in fp16 (5-bit exponent) once n_valid is in the thousands.
                row_keep = keep.float().unsqueeze(1)
                grad_logits = logits.mul_(row_keep / sum_exp)
                grad_logits.scatter_add_(1, target, -_one_hot_rows(row_keep, in_shard, start, end))
                grad_logits = grad_logits.to(gemm_dtype)
                if grad_hidden is not None:
                    _mm_fp32(grad_logits, w, grad_hidden[start:end], False, support)
                if grad_weight is not None:
                    _mm_fp32(grad_logits.t(), h, grad_weight, start > 0, support)
                continue
            # d(mean loss)/d(logits) = (softmax - onehot) * scale on valid rows, 0 on ignored ones; the division
            # by sum_exp and the scale share one pass over the chunk.
            row_scale = keep.float().unsqueeze(1) * scale
            grad_logits = logits.mul_(row_scale / sum_exp)
            grad_logits.scatter_add_(1, target, -_one_hot_rows(row_scale, in_shard, start, end))
            if grad_hidden is not None:
                torch.mm(grad_logits, w, out=grad_hidden[start:end])
            if grad_weight is not None and start == 0:
                torch.mm(grad_logits.t(), h, out=grad_weight)
            elif grad_weight is not None:
                grad_weight.addmm_(grad_logits.t(), h)
        if low:
            grad_hidden = grad_hidden.mul_(scale) if grad_hidden is not None else None
            grad_weight = grad_weight.mul_(scale) if grad_weight is not None else None
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
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int | None = None,
    ignore_index: int = IGNORE_INDEX,
    *,
    gemm_dtype: torch.dtype | None = None,
    shard: VocabShard | None = None,
) -> torch.Tensor:
    """Mean over labels != ignore_index of cross_entropy(hidden @ weight.T, labels), softmax and loss in fp32.

    hidden [N, H], weight [V, H], labels [N] -> scalar fp32 loss. Gradients (computed during this call, so only
    [N, H] + [V, H] of them are kept instead of [N, V] logits) come back in the inputs' dtypes. At most chunk_size x V
    fp32 logits exist at a time; chunk_size None takes default_chunk_size(device type) (cpu 1024: 206 MB at 50304
    vocab; cuda 4096). Because the gradients are made in forward, evaluate under torch.no_grad(), which skips them.

    gemm_dtype: the dtype of the three head GEMMs, None for the automatic rule of _gemm_dtype (the weight's bf16 /
    fp16 on an accelerator, fp32 on CPU or for fp32 weights; see the module docstring). torch.float32 is today's
    fp32 path everywhere; torch.bfloat16 / torch.float16 force the low-precision GEMMs (e.g. to test them on CPU).
    shard: weight is one vocabulary shard (see vocab_parallel_cross_entropy).
    """
    if hidden.dim() != 2 or labels.shape != hidden.shape[:1]:
        raise ValueError(f"hidden must be [N, H] and labels [N], got {tuple(hidden.shape)} and {tuple(labels.shape)}")
    device_type = hidden.device.type
    if gemm_dtype is None:
        gemm_dtype = _gemm_dtype(weight.dtype, device_type)
    elif gemm_dtype not in (torch.float32, *LOW_PRECISION_DTYPES):
        raise ValueError(f"gemm_dtype must be None, torch.float32, torch.bfloat16 or torch.float16, got {gemm_dtype}")
    if chunk_size is None:
        chunk_size = default_chunk_size(device_type)
    grad = torch.is_grad_enabled()  # forward runs with grad off, so decide here whether to make gradients at all
    return _LinearCrossEntropy.apply(
        hidden,
        weight,
        labels,
        chunk_size,
        ignore_index,
        gemm_dtype,
        grad and hidden.requires_grad,
        grad and weight.requires_grad,
        shard,
    )


def vocab_parallel_cross_entropy(
    hidden: torch.Tensor,
    weight_shard: torch.Tensor,
    labels: torch.Tensor,
    shard: VocabShard,
    chunk_size: int | None = None,
    ignore_index: int = IGNORE_INDEX,
    *,
    gemm_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """linear_cross_entropy with the head's rows split over the ranks of shard.group (Megatron's vocab-parallel
    cross-entropy, chunked): this rank holds rows shard.vocab_start.. of the weight and only [chunk, V / tp] fp32
    logits at a time; each chunk's row max and sum of exps, and the target's logit, are all-reduced over the group.

    hidden [N, H] and labels [N] must be the same on every rank of the group (all ranks call this together); every
    rank returns the same loss. weight_shard's gradient is its rows' whole gradient; hidden's is this rank's share,
    which the caller sums over the group (a column-parallel linear's input gradient: all-reduce, or reduce-scatter
    onto sequence shards).
    """
    return linear_cross_entropy(
        hidden, weight_shard, labels, chunk_size, ignore_index, gemm_dtype=gemm_dtype, shard=shard
    )


def fused_head_loss(
    head: nn.Module,
    x: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
    *,
    chunk_size: int | None = None,
    gemm_dtype: torch.dtype | None = None,
):
    """Mean next-token loss of `head` on the final hidden states x [b, s, h]; labels [b, s] already shifted.

    The fused chunked path (linear_cross_entropy): the [b, s, vocab] logits never exist. GEMMs in the head weight's
    bf16 / fp16 on an accelerator, in fp32 on CPU or for an fp32 head; softmax and loss in fp32 (chunk_size and
    gemm_dtype: see linear_cross_entropy). It reads head.weight as the whole vocabulary, so it needs a bias-free
    nn.Linear holding a plain (not DTensor) weight, or the nn.Embedding a tied head shares (its weight is [vocab,
    hidden] too). A head split over tensor-parallel ranks takes a vocab-parallel loss instead: the parallelize step
    sets model.head_loss to it.
    """
    weight = getattr(head, "weight", None)
    if type(head) not in (nn.Linear, nn.Embedding) or getattr(head, "bias", None) is not None:
        raise TypeError(
            f"fused_head_loss needs a bias-free nn.Linear head, got {type(head).__name__}"
            f"{' with a bias' if type(head) is nn.Linear else ''} (a tied head passes its nn.Embedding); use"
            " logits_loss for this head"
        )
    if type(weight) not in (torch.Tensor, nn.Parameter):  # e.g. a DTensor: one vocabulary shard per TP rank
        raise TypeError(
            f"fused_head_loss needs the head's whole weight as a plain tensor, got {type(weight).__name__}"
            " (a tensor-parallel head?); use a vocab-parallel loss (vocab_parallel_cross_entropy) or logits_loss"
        )
    return linear_cross_entropy(
        x.flatten(0, 1), weight, labels.flatten(), chunk_size, ignore_index, gemm_dtype=gemm_dtype
    )


def logits_loss(head: nn.Module, x: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX):
    """The same loss through head(x): full [b, s, vocab] logits, then cross-entropy in fp32.

    For any head, a tensor-parallel one too (a DTensor-sharded nn.Linear, a Neuron ColumnParallelLinear whose own
    forward gathers the full logits from the vocabulary shards), at the cost of the whole vocabulary's logits on
    every rank: the memory benchmark's reference (bench/bench_memory.py --loss).
    """
    logits = head(x)
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=ignore_index)
