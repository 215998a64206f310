"""The fused chunked head + cross-entropy equals F.linear + F.cross_entropy, alone, as fused_head_loss next to
logits_loss, and as the models' labels= path; its GEMMs run in fp32 or, on accelerators, in the weight's bf16/fp16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from recipes.common import loss as loss_module
from recipes.common.loss import (
    IGNORE_INDEX,
    _gemm_dtype,
    default_chunk_size,
    fused_head_loss,
    linear_cross_entropy,
    logits_loss,
)
from recipes.llama2.model import Llama2, Llama2Args
from recipes.neox.model import NeoX, NeoXArgs

torch.set_num_threads(2)


def inputs(n=37, h=16, v=53, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype).requires_grad_()
    weight = torch.randn(v, h, generator=g).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::5] = IGNORE_INDEX
    return hidden, weight, labels


def reference(hidden, weight, labels):
    """The plain path, in fp32 as the fused one computes, gradients back in the inputs' dtypes."""
    h, w = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    loss = F.cross_entropy(F.linear(h, w), labels, ignore_index=IGNORE_INDEX)
    loss.backward()
    return loss.detach(), h.grad.to(hidden.dtype), w.grad.to(weight.dtype)


def fused(hidden, weight, labels, **kwargs):
    loss = linear_cross_entropy(hidden, weight, labels, **kwargs)
    loss.backward()
    return loss.detach(), hidden.grad, weight.grad


@pytest.mark.parametrize("chunk_size", [1, 8, 10, 37, 64])  # 10 does not divide 37; 64 > N is one short chunk
def test_equals_linear_plus_cross_entropy(chunk_size):
    hidden, weight, labels = inputs()
    want = reference(hidden, weight, labels)
    got = fused(hidden, weight, labels, chunk_size=chunk_size)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)  # fp32 path: fp32 rounding only


def test_scaled_upstream_gradient():
    hidden, weight, labels = inputs()
    (3.0 * linear_cross_entropy(hidden, weight, labels, chunk_size=8)).backward()
    _, grad_h, grad_w = reference(hidden, weight, labels)
    torch.testing.assert_close(hidden.grad, 3.0 * grad_h, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weight.grad, 3.0 * grad_w, rtol=1e-5, atol=1e-6)


def test_all_labels_ignored_gives_zero_loss_and_grads():
    hidden, weight, labels = inputs()
    loss, grad_h, grad_w = fused(hidden, weight, torch.full_like(labels, IGNORE_INDEX), chunk_size=8)
    assert loss.item() == 0.0 and not torch.isnan(loss)
    assert torch.all(grad_h == 0) and torch.all(grad_w == 0)
    _, _, grad_w = fused(hidden[:0].detach(), weight.detach().requires_grad_(), labels[:0])  # no token at all
    assert torch.all(grad_w == 0)


def test_bf16_weight_and_hidden():
    hidden, weight, labels = inputs(dtype=torch.bfloat16)
    want = reference(hidden, weight, labels)
    got = fused(hidden, weight, labels, chunk_size=10)
    assert got[0].dtype == torch.float32 and got[1].dtype == got[2].dtype == torch.bfloat16
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1.6e-2, atol=1e-3)


def test_hidden_without_grad_and_no_grad_mode():
    hidden, weight, labels = inputs()
    hidden = hidden.detach()
    want_loss, _, want_grad_w = reference(hidden, weight, labels)
    loss = linear_cross_entropy(hidden, weight, labels, chunk_size=8)
    loss.backward()
    torch.testing.assert_close(weight.grad, want_grad_w, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(hidden, weight, labels), want_loss)


GEMMS = {torch.mm: "mm", torch.addmm: "addmm", torch.Tensor.addmm_: "addmm_", torch.Tensor.mm: "mm"}


class RecordGemms(TorchFunctionMode):
    """Records (name, input dtypes, out_dtype) of every mm / addmm. With emulate=True it also computes the
    out_dtype=torch.float32 overloads this CPU torch has no kernel for, as cuBLAS does: bf16/fp16 products summed in
    fp32, an fp32 result (written to out=, added to the addmm input)."""

    def __init__(self, emulate=False):
        super().__init__()
        self.emulate, self.calls = emulate, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func not in GEMMS:
            return func(*args, **kwargs)
        *acc, a, b = args
        self.calls.append((GEMMS[func], a.dtype, b.dtype, kwargs.get("out_dtype")))
        if not (self.emulate and "out_dtype" in kwargs):
            return func(*args, **kwargs)
        assert kwargs.pop("out_dtype") is torch.float32 and a.dtype == b.dtype != torch.float32
        product = a.float() @ b.float()
        result = acc[0] + product if acc else product
        out = kwargs.pop("out", None)
        return result if out is None else out.copy_(result)

    def input_dtypes(self):
        return {dtype for _, a, b, _ in self.calls for dtype in (a, b)}


# bf16 keeps 8 significant bits (eps 2**-8): the gradient of the logits is rounded to it once for the backward
# GEMMs, their products (no fp32-output kernel on CPU) and the final gradients once more each, a few bf16 ulps: the
# 1.6e-2 rtol torch.testing takes for bf16, with atol 1e-3 (1/150 of the largest gradient entry, ~0.16) for entries
# that cancel towards 0. The loss sees only the logits rounded once, errors that average over rows: rtol 2e-3.
LOW_PRECISION_TOL = dict(rtol=1.6e-2, atol=1e-3)
LOSS_TOL = dict(rtol=2e-3, atol=0.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("chunk_size", [10, 64])  # 10 does not divide 37; 64 > N is one short chunk
def test_low_precision_gemms_equal_fp32_reference(dtype, chunk_size):
    hidden, weight, labels = inputs(dtype=dtype)  # labels[::5] are ignored
    want = reference(hidden, weight, labels)
    with RecordGemms() as gemms:
        got = fused(hidden, weight, labels, chunk_size=chunk_size, gemm_dtype=dtype)
    assert gemms.input_dtypes() == {dtype}, gemms.calls  # the GEMMs did run in bf16/fp16, not upcast
    assert got[0].dtype == torch.float32 and got[1].dtype == got[2].dtype == dtype
    torch.testing.assert_close(got[0], want[0], **LOSS_TOL)
    for g, w in zip(got[1:], want[1:], strict=True):
        torch.testing.assert_close(g, w, **LOW_PRECISION_TOL)


def test_low_precision_fp16_gradient_does_not_underflow():
    # A near-uniform softmax (as at initialisation) over 20000 tokens, 2048 labels: (softmax - onehot) / n_valid is
    # ~2.4e-8 off the label, under half fp16's smallest subnormal (6e-8). Cast to fp16 after the 1 / n_valid scale it
    # would flush to 0, and with it the softmax half of the gradient (~13% of d(hidden) here, all of d(weight) on rows
    # without a label); scaled after the GEMMs it keeps fp16's 11 bits.
    hidden, weight, labels = inputs(n=2048, v=20000, dtype=torch.float16)
    with torch.no_grad():
        hidden.add_(1.0)  # hidden states with a common direction, so the softmax term does not average out
        weight.mul_(0.01)
    want = reference(hidden, weight, labels)
    got = fused(hidden, weight, labels, chunk_size=1024, gemm_dtype=torch.float16)
    torch.testing.assert_close(got[0], want[0], **LOSS_TOL)
    for g, w in zip(got[1:], want[1:], strict=True):  # errors measured: 2.5e-3 and 8e-4 of the largest entry
        torch.testing.assert_close(g, w, rtol=1.6e-2, atol=5e-3 * w.abs().max().item())


@pytest.mark.parametrize("addmm_ok", [True, False])  # newer / older CUDA: fp32 accumulator as addmm's input or not
def test_fp32_output_gemms_as_on_cuda(monkeypatch, addmm_ok):
    # The out_dtype=torch.float32 branch taken on CUDA, with its GEMMs emulated: the logits come out in fp32, so the
    # loss matches the reference to fp32 rounding; the gradients still see bf16 gradients of the logits.
    monkeypatch.setitem(loss_module._FP32_OUT_SUPPORT, ("cpu", torch.bfloat16), (True, addmm_ok))
    hidden, weight, labels = inputs(dtype=torch.bfloat16)
    want = reference(hidden, weight, labels)
    with RecordGemms(emulate=True) as gemms:
        got = fused(hidden, weight, labels, chunk_size=10, gemm_dtype=torch.bfloat16)
    assert gemms.input_dtypes() == {torch.bfloat16} and {c[3] for c in gemms.calls} == {torch.float32}, gemms.calls
    assert ("addmm" in {c[0] for c in gemms.calls}) == addmm_ok
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    for g, w in zip(got[1:], want[1:], strict=True):
        torch.testing.assert_close(g, w, **LOW_PRECISION_TOL)


def test_fp32_output_gemms_trace_on_meta_device():
    # torch's meta functions for mm / addmm with out_dtype check shapes and dtypes as the CUDA kernels do.
    meta = dict(device="meta", dtype=torch.bfloat16)
    hidden, weight = torch.empty(37, 16, **meta, requires_grad=True), torch.empty(53, 16, **meta, requires_grad=True)
    loss = linear_cross_entropy(hidden, weight, torch.zeros(37, dtype=torch.long, device="meta"), chunk_size=10)
    assert loss_module._fp32_out_support(torch.device("meta"), torch.bfloat16) == (True, True)
    loss.backward()
    assert loss.dtype == torch.float32 and hidden.grad.dtype == weight.grad.dtype == torch.bfloat16


def test_automatic_gemm_dtype():
    for device_type in ("cpu", "cuda", "xla", "neuron"):
        assert _gemm_dtype(torch.float32, device_type) == torch.float32  # fp32 weights: fp32 GEMMs anywhere
    for dtype in (torch.bfloat16, torch.float16):
        assert _gemm_dtype(dtype, "cpu") == torch.float32  # CPU: upcast, as before
        for device_type in ("cuda", "xla", "neuron"):
            assert _gemm_dtype(dtype, device_type) == dtype
    assert default_chunk_size("cpu") == 1024 and default_chunk_size("cuda") == 4096
    assert default_chunk_size("xla") == default_chunk_size("neuron") == 1024


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_defaults_to_the_fp32_path(dtype):
    # On CPU, None (automatic) takes the fp32 GEMMs whatever the weight dtype: bitwise the explicit fp32 path.
    hidden, weight, labels = inputs(n=2100, dtype=dtype)  # > 1024 rows: the default chunk size is used
    with RecordGemms() as gemms:
        got = fused(hidden, weight, labels)
    assert gemms.input_dtypes() == {torch.float32}, gemms.calls
    hidden, weight, labels = inputs(n=2100, dtype=dtype)
    want = fused(hidden, weight, labels, chunk_size=1024, gemm_dtype=torch.float32)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w)
    with pytest.raises(ValueError, match="gemm_dtype"):
        linear_cross_entropy(hidden, weight, labels, gemm_dtype=torch.float64)


def head_inputs(bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    head = nn.Linear(16, 53, bias=bias)
    with torch.no_grad():
        head.weight.copy_(torch.randn(53, 16, generator=g))
    x = torch.randn(3, 7, 16, generator=g).requires_grad_()
    labels = torch.randint(0, 53, (3, 7), generator=g)
    labels[1, :3] = IGNORE_INDEX
    return head, x, labels


def test_fused_head_loss_equals_logits_loss_on_a_plain_head():
    results = []
    for head_loss in (fused_head_loss, logits_loss):
        head, x, labels = head_inputs()
        loss = head_loss(head, x, labels)
        loss.backward()
        results.append((loss.detach(), x.grad, head.weight.grad))
    assert results[0][0].dtype == results[1][0].dtype == torch.float32
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_fused_head_loss_passes_chunk_size_and_gemm_dtype():
    head, x, labels = head_inputs()  # 21 tokens, 3 of them ignored
    head.to(torch.bfloat16)
    x = x.detach().bfloat16().requires_grad_()
    with RecordGemms() as gemms:
        loss = fused_head_loss(head, x, labels, chunk_size=7, gemm_dtype=torch.bfloat16)
    # 3 chunks of 7 tokens, 3 GEMMs each (logits, d(hidden), d(weight)), all in bf16
    assert len(gemms.calls) == 9 and gemms.input_dtypes() == {torch.bfloat16}, gemms.calls
    loss.backward()
    want = reference(x.flatten(0, 1), head.weight, labels.flatten())
    torch.testing.assert_close(loss.detach(), want[0], **LOSS_TOL)
    torch.testing.assert_close(x.grad.flatten(0, 1), want[1], **LOW_PRECISION_TOL)
    torch.testing.assert_close(head.weight.grad, want[2], **LOW_PRECISION_TOL)


def test_fused_head_loss_refuses_a_head_it_cannot_fuse():
    head, x, labels = head_inputs(bias=True)
    with pytest.raises(TypeError, match=r"bias-free nn\.Linear.*with a bias.*logits_loss"):
        fused_head_loss(head, x, labels)
    with pytest.raises(TypeError, match=r"bias-free nn\.Linear head, got Sequential.*logits_loss"):
        fused_head_loss(nn.Sequential(nn.Linear(16, 53, bias=False)), x, labels)
    logits_loss(head, x, labels).backward()  # the logits path takes any head


def shifted(tokens):
    return torch.cat([tokens[:, 1:], torch.full_like(tokens[:, :1], IGNORE_INDEX)], dim=1)


MODELS = {
    "neox": lambda: NeoX(NeoXArgs(vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, ffn_hidden_size=64,
                                  max_seq_len=16)),
    "llama2": lambda: Llama2(Llama2Args(vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                        ffn_hidden_size=48, max_seq_len=16)),
}  # fmt: skip


@pytest.mark.parametrize("family", MODELS)
def test_model_labels_path_equals_logits_plus_cross_entropy(family):
    torch.manual_seed(0)
    model = MODELS[family]().train()
    model.init_weights(seed=0)
    tokens = torch.randint(0, 97, (3, 16))
    labels = shifted(tokens)
    labels[1, :4] = IGNORE_INDEX  # e.g. a prompt that is not trained on
    logits = model(tokens)
    want = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    want.backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    got = model(tokens, labels=labels)
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want_grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("family", MODELS)
def test_model_head_loss_is_fused_by_default_and_swappable(family):
    model = MODELS[family]().train()
    model.init_weights(seed=0)
    assert model.head_loss is fused_head_loss
    assert not any("head_loss" in name for name in model.state_dict())
    tokens = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    fused = model(tokens, labels=shifted(tokens))
    model.head_loss = logits_loss
    torch.testing.assert_close(model(tokens, labels=shifted(tokens)), fused, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")
@pytest.mark.parametrize("family", MODELS)
def test_tensor_parallel_head_takes_the_vocab_parallel_loss(family):
    # One rank is enough to make the head weight a DTensor, which the fused path must refuse: the parallelize step
    # sets model.head_loss to the vocab-parallel loss (TP 2 against TP 1: tests/test_vocab_parallel_loss.py).
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from trnrecipes.parallel.tensor import apply_tensor_parallel, vocab_parallel_head_loss

    if dist.is_initialized():
        pytest.skip("a process group is already up")
    model = MODELS[family]().train()
    model.init_weights(seed=0)
    tokens = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    want = model(tokens, labels=shifted(tokens))
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        parallel = apply_tensor_parallel(model, init_device_mesh("cpu", (1,)), family, sequence_parallel=True)
        assert isinstance(parallel.head.weight, DTensor)
        with pytest.raises(TypeError, match=r"DTensor.*logits_loss"):
            fused_head_loss(parallel.head, torch.zeros(2, 16, 32), shifted(tokens))
        assert parallel.head_loss is vocab_parallel_head_loss
        got = parallel(tokens, labels=shifted(tokens))
        got.backward()
        parallel.head_loss = logits_loss  # the gathered path, still there for any head
        gathered = parallel(tokens, labels=shifted(tokens))
    finally:
        dist.destroy_process_group()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gathered, want, rtol=1e-5, atol=1e-6)
