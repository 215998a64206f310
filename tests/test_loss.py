"""The fused chunked head + cross-entropy equals F.linear + F.cross_entropy, alone, as fused_head_loss next to
logits_loss, and as the models' labels= path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from recipes.common.loss import IGNORE_INDEX, fused_head_loss, linear_cross_entropy, logits_loss
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
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


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
def test_tensor_parallel_head_takes_logits_loss(family):
    # One rank is enough to make the head weight a DTensor, which the fused path must refuse: the parallelize step
    # sets model.head_loss = logits_loss for a tensor-parallel head (set here too, so this tests the loss alone).
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from trnrecipes.parallel import apply_tensor_parallel

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
        parallel.head_loss = logits_loss
        got = parallel(tokens, labels=shifted(tokens))
        got.backward()
    finally:
        dist.destroy_process_group()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
