"""`model.attention: nki_flash`: core attention through neuronx-distributed's NKI flash attention kernel, swapped into
every CoreAttention from outside (the model code still calls self.core(q, k, v)). The neuron backend applies it on
torch-xla + NxD; the recipe check refuses it elsewhere. Written against NxD's public source (kernels/flash_attn.py,
0.10 to 0.18); the Neuron SDK installs only on Trainium hosts, so it runs here only against a stand-in with the
kernel's signatures and layouts (tests/nki_standin.py)."""

from __future__ import annotations

import functools
import inspect
import os

import torch
from torch import nn

from recipes.common.attention import CoreAttention, causal_attention


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[b, kv_heads, s, d] -> [b, kv_heads * groups, s, d], head i a copy of kv head i // groups: the order in which
    our query heads read their KV heads (as Hugging Face's and AWS's repeat_kv)."""
    if groups == 1:
        return x
    b, kv, s, d = x.shape
    return x[:, :, None].expand(b, kv, groups, s, d).reshape(b, kv * groups, s, d)


@functools.cache
def _takes_transpose_flag(kernel) -> bool:
    # NxD 0.12 (Neuron SDK 2.23) added transpose_nki_inputs, default True = inputs already [b, h, d, s]; 0.10/0.11
    # have no such keyword (passing it is a TypeError) and take [b, h, s, d].
    return "transpose_nki_inputs" in inspect.signature(kernel).parameters


def nki_flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """CoreAttention's contract (q [b, heads, s, d], k/v [b, kv_heads, s, d] -> [b, heads, s, d], causal, scale
    1/sqrt(d)) through NxD's nki_flash_attn_func, called as AWS's Llama examples call it:
    - k/v repeated to q's head count: NxD launches the kernel on a [batch, q heads] grid, one k/v head per q head;
    - [b, h, s, d] in, which NxD permutes to the kernel's [b, h, d, s] itself (0.10/0.11 always; 0.12+ with
      transpose_nki_inputs=False). AWS's 0.12+ scripts instead build q/k/v as [b, h, d, s] and pass True, which saves
      those permutes: a possible speed-up, not taken, so that one call serves every NxD version;
    - causal=True, softmax_scale None (NxD takes head_dim ** -0.5), no dropout; the output is [b, h, s, d];
    - lnc: NEURON_LOGICAL_NC_CONFIG (1 on trn1, 2 on trn2), as NxD Training passes it.
    The kernel needs the sequence to be a multiple of 2048 and head_dim <= 128 (the recipe check refuses others)."""
    from neuronx_distributed.kernels.flash_attn import nki_flash_attn_func

    groups = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, groups), repeat_kv(v, groups)
    layout = {"transpose_nki_inputs": False} if _takes_transpose_flag(nki_flash_attn_func) else {}
    lnc = int(os.environ.get("NEURON_LOGICAL_NC_CONFIG", "1"))
    return nki_flash_attn_func(q, k, v, lnc, causal=True, **layout)


KERNELS = {"sdpa": causal_attention, "nki_flash": nki_flash_attention}


def apply_attention_kernel(model: nn.Module, attention: str) -> None:
    """Make every CoreAttention of `model` compute with `attention` ("sdpa" or "nki_flash"), in place. A subclass
    with its own forward (BERT's masked encoder attention) never calls the kernel: another kernel than SDPA is
    refused there rather than ignored."""
    if attention not in KERNELS:
        raise ValueError(f"model.attention must be one of {tuple(KERNELS)}, not {attention!r}")
    for core in (m for m in model.modules() if isinstance(m, CoreAttention)):
        if type(core).forward is CoreAttention.forward:
            core.kernel = KERNELS[attention]
        elif attention != "sdpa":
            raise ValueError(f"model.attention {attention!r}: {type(core).__name__} computes its own attention")
