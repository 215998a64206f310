"""A stand-in for neuronx-distributed's NKI flash attention (neuronx_distributed.kernels.flash_attn.nki_flash_attn_func)
on trn1, for tests/test_nki_attention.py: the function's exact signature per NxD version, its layout handling and
checks, and the kernel's math written out in the kernel's own layouts (q, k [b, h, d, s]; v [b, h, s, d], or
[b, h, d, s] with should_transpose_v), so that a layout mistake by the caller shows as an error or a wrong number.

Read from aws-neuron/neuronx-distributed src/neuronx_distributed/kernels/flash_attn.py and the kernel it launches
(aws-neuron/nki-samples 8370e11 src/nki_samples/reference/attention.py, flash_fwd), at these commits:
    NxD 0.10.1 (Neuron SDK 2.21.1)  58d27de   no transpose_nki_inputs: q, k, v [b, h, s, d], permuted inside
    NxD 0.11.0 (SDK 2.22)           82a2bb3   as 0.10 (only NKIAttnFunc.backward's count of None returns changed)
    NxD 0.12.0 (SDK 2.23)           9148ac9   + transpose_nki_inputs=True: True takes [b, h, d, s] as is, False as 0.10
    NxD 0.13.0 to 0.17.0            dd06063, c63420c, fecfe75, 47f695c, 73ab227: the file as 0.12's
    NxD 0.18.0 (SDK 2.29)           fbac349   the same signature
The output is [b, h, s, d] in every version (the docstring's (batch, seqlen, nheads, headdim) is wrong: AWS's Llama
code checks (bsz, num_heads, q_len, head_dim) right after the call). Gradients come from autograd through the math
(the real NKIAttnFunc calls flash_attn_bwd); dropout and XLA's bf16 casts are not modelled.
"""

from __future__ import annotations

import sys
import types

import torch

NO_LAYOUT_FLAG, LAYOUT_FLAG = "0.10/0.11", "0.12+"
VERSIONS = {"0.10": NO_LAYOUT_FLAG, "0.11": NO_LAYOUT_FLAG, "0.12": LAYOUT_FLAG, "0.13": LAYOUT_FLAG,
            "0.14": LAYOUT_FLAG, "0.15": LAYOUT_FLAG, "0.16": LAYOUT_FLAG, "0.17": LAYOUT_FLAG,
            "0.18": LAYOUT_FLAG}  # fmt: skip


def flash_fwd(q, k, v, softmax_scale, use_causal_mask, mixed_precision, should_transpose_v):
    """The kernel (nki-samples flash_fwd) as NxD launches it, on the grid [batch, q heads]: q [b, h, d, s_q],
    k [b, h, d, s_k] (indexed by the q head: GQA would need the grid on kv heads), v [b, h, s_k, d], or
    [b, h, d, s_k] with should_transpose_v -> o [b, h, s_q, d]. Matmuls in fp32 from the IO dtype (TensorE's bf16
    products with fp32 accumulation), softmax in fp32, the probabilities cast to the IO dtype for the second matmul
    when mixed_precision."""
    b, h, d, s = q.shape
    assert d <= 128, f"head dim {d} > 128"  # the kernel's assert
    assert q.dtype == k.dtype == v.dtype, "the kernel takes one dtype for q, k and v"
    assert k.shape == (b, h, d, s), f"k {tuple(k.shape)}: the kernel's grid reads one k/v head per q head, {(b, h)}"
    assert tuple(v.shape) == ((b, h, d, s) if should_transpose_v else (b, h, s, d)), f"v {tuple(v.shape)}"
    scores = torch.einsum("bhdi,bhdj->bhij", q.float(), k.float()) * softmax_scale
    if use_causal_mask:
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    probs = scores.softmax(dim=-1)
    if mixed_precision:
        probs = probs.to(q.dtype).float()
    o = torch.einsum("bhij,bhdj->bhid" if should_transpose_v else "bhij,bhjd->bhid", probs, v.float())
    return o.to(q.dtype)


def _attend(calls, q, k, v, lnc, dropout_p, softmax_scale, causal, mixed_precision, transpose_nki_inputs):
    """nki_flash_attn_func's body (73ab227 L190-210; 58d27de L183-199 without the flag) and NKIAttnFunc.forward."""
    calls.append({"shape": tuple(q.shape), "kv_shape": tuple(k.shape), "lnc": lnc, "causal": causal,
                  "softmax_scale": softmax_scale, "transpose_nki_inputs": transpose_nki_inputs})  # fmt: skip
    if transpose_nki_inputs:
        seqlen = q.shape[3]
    else:
        seqlen = q.shape[2]
        q, k, v = (x.permute(0, 1, 3, 2) for x in (q, k, v))
    if seqlen % 2048 != 0:
        raise NotImplementedError("Only support sequence as multiples of 2K")
    assert lnc == 1, "ERROR: lnc > 1 is not supported on trn1 architecture"
    assert dropout_p == 0.0, "the stand-in models no dropout"
    if softmax_scale is None:
        softmax_scale = q.shape[-2] ** (-0.5)  # q is [b, h, d, s] here: head_dim ** -0.5
    v = v if transpose_nki_inputs else v.permute(0, 1, 3, 2)
    return flash_fwd(q, k, v, softmax_scale, causal, mixed_precision, should_transpose_v=transpose_nki_inputs)


def make_nki_flash_attn_func(version: str, calls: list[dict]):
    """nki_flash_attn_func with NxD `version`'s exact signature (keywords and defaults)."""
    if VERSIONS[version] == NO_LAYOUT_FLAG:

        def nki_flash_attn_func(q, k, v, lnc=1, dropout_p=0.0, softmax_scale=None, causal=True,
                                mixed_precision=True, seed=None, hardware_type=None):  # fmt: skip
            return _attend(calls, q, k, v, lnc, dropout_p, softmax_scale, causal, mixed_precision, False)

    else:

        def nki_flash_attn_func(q, k, v, lnc=1, dropout_p=0.0, softmax_scale=None, causal=True,
                                mixed_precision=True, seed=None, hardware_type=None,
                                transpose_nki_inputs=True):  # fmt: skip
            return _attend(calls, q, k, v, lnc, dropout_p, softmax_scale, causal, mixed_precision,
                           transpose_nki_inputs)  # fmt: skip

    return nki_flash_attn_func


def install_flash_attn(monkeypatch, version: str = "0.17") -> list[dict]:
    """Put neuronx_distributed.kernels.flash_attn (with NxD `version`'s function) into sys.modules, beside any NxD
    stand-in already there (tests/test_neuron_parallel.py's install_fake_nxd). Returns the list of its calls."""
    calls: list[dict] = []
    if "neuronx_distributed" not in sys.modules:
        monkeypatch.setitem(sys.modules, "neuronx_distributed", types.ModuleType("neuronx_distributed"))
    kernels = types.ModuleType("neuronx_distributed.kernels")
    flash_attn = types.ModuleType("neuronx_distributed.kernels.flash_attn")
    flash_attn.nki_flash_attn_func = make_nki_flash_attn_func(version, calls)
    kernels.flash_attn = flash_attn
    monkeypatch.setitem(sys.modules, kernels.__name__, kernels)
    monkeypatch.setitem(sys.modules, flash_attn.__name__, flash_attn)
    return calls
