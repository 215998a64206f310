"""model.attention nki_flash (trnrecipes/parallel/nki_attention.py) against a stand-in for NxD's NKI flash attention
with the function's exact signature per NxD version and the kernel's layouts (tests/nki_standin.py): SDPA's outputs
and gradients, with GQA, on a TP shard's heads, through the neuron backend's build with sequence parallelism and
selective checkpointing; where the recipe check refuses it; and what the memory estimate stops counting. The real
kernel runs only on Trainium: nothing here has run it."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
from nki_standin import install_flash_attn
from test_neuron_parallel import install_fake_nxd, stand_in_dims, whole_region

from recipes.common.attention import CoreAttention, causal_attention
from recipes.common.loss import IGNORE_INDEX
from trnrecipes.backends.neuron_xla import NeuronXlaBackend
from trnrecipes.config.recipe import load_recipe
from trnrecipes.config.sections import RecipeError
from trnrecipes.models import build_model
from trnrecipes.parallel.nki_attention import apply_attention_kernel, nki_flash_attention
from trnrecipes.plan.memory import memory_plan
from trnrecipes.train import build as build_module
from trnrecipes.train.build import build_model_shard

torch.set_num_threads(2)
SEQ = 2048  # the kernel's smallest sequence


def qkv(heads: int, kv_heads: int, dtype: torch.dtype = torch.float32, head_dim: int = 16, batch: int = 1):
    g = torch.Generator().manual_seed(0)
    shapes = [(batch, heads, SEQ, head_dim), (batch, kv_heads, SEQ, head_dim), (batch, kv_heads, SEQ, head_dim)]
    return [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in shapes]


def output_and_grads(attend, q, k, v, upstream):
    out = attend(q, k, v)
    return out.detach(), torch.autograd.grad(out, (q, k, v), upstream)


@pytest.mark.parametrize("version", ["0.11", "0.12"])  # the last without the layout flag, the first with it
def test_each_nxd_signature_is_called_in_a_layout_it_takes(monkeypatch, version):
    """0.10/0.11 have no transpose_nki_inputs (passing it is a TypeError); from 0.12 its default True means inputs
    already [b, h, d, s], so the [b, h, s, d] call must say False. Causal, NxD's default scale, lnc 1 on trn1."""
    calls = install_flash_attn(monkeypatch, version)
    q, k, v = qkv(2, 1)
    with torch.no_grad():
        assert torch.allclose(nki_flash_attention(q, k, v), causal_attention(q, k, v), atol=1e-5)
    (call,) = calls  # [b, h, s, d] taken as such: passed False (0.12+), or the only layout there is (0.10/0.11)
    assert call == {"shape": (1, 2, SEQ, 16), "kv_shape": (1, 2, SEQ, 16), "lnc": 1, "causal": True,
                    "softmax_scale": None, "transpose_nki_inputs": False}  # fmt: skip


def test_the_stand_in_refuses_what_nxd_refuses(monkeypatch):
    """A layout slip is not hidden: [b, h, s, d] under 0.12+'s default reads head_dim as the sequence; un-repeated
    GQA k/v do not fit the kernel's [batch, q heads] grid."""
    install_flash_attn(monkeypatch, "0.17")
    from neuronx_distributed.kernels.flash_attn import nki_flash_attn_func

    q, k, v = qkv(2, 1)
    with pytest.raises(NotImplementedError, match="multiples of 2K"):
        nki_flash_attn_func(q, q, q)
    with pytest.raises(AssertionError, match="one k/v head per q head"):
        nki_flash_attn_func(q, k, v, transpose_nki_inputs=False)
    install_flash_attn(monkeypatch, "0.10")
    from neuronx_distributed.kernels.flash_attn import nki_flash_attn_func as older

    with pytest.raises(TypeError, match="transpose_nki_inputs"):
        older(q, q, q, transpose_nki_inputs=False)


@pytest.mark.parametrize(
    ("dtype", "version", "atol"),
    [(torch.float32, "0.17", 1e-5), (torch.bfloat16, "0.11", 6.3e-2)],
)
def test_outputs_and_gradients_equal_sdpa_with_grouped_query_attention(monkeypatch, dtype, version, atol):
    """4 query heads over 2 KV heads: k/v repeated in the order our query heads read them (head i -> kv i // 2),
    their gradients summed back onto the 2 KV heads. bf16: within bf16's resolution at these magnitudes (|grad|
    up to ~4: a few units of the last place)."""
    install_flash_attn(monkeypatch, version)
    q, k, v = qkv(4, 2, dtype)
    upstream = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    out, grads = output_and_grads(nki_flash_attention, q, k, v, upstream)
    want_out, want_grads = output_and_grads(causal_attention, q, k, v, upstream)
    assert out.dtype == dtype and out.shape == want_out.shape
    torch.testing.assert_close(out, want_out, atol=atol, rtol=0)
    for name, got, want in zip("qkv", grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, atol=atol, rtol=0, msg=lambda m, n=name: f"d{n}: {m}")


@pytest.mark.parametrize(("heads", "kv_heads", "tp"), [(8, 4, 2), (4, 1, 2)])
def test_a_tensor_parallel_shards_heads_give_its_slice_of_attention(monkeypatch, heads, kv_heads, tp):
    """TP rank 1's heads as the plans shard them: whole KV groups (8 over 4 at TP 2: query heads 4-7 over KV heads
    2-3), or one KV head's copy with its query heads (4 over 1 at TP 2: KV head 0 replicated). Its output and q
    gradient are the slice of whole-model SDPA's."""
    install_flash_attn(monkeypatch)
    q, k, v = qkv(heads, kv_heads)
    upstream = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    want_out, want_grads = output_and_grads(causal_attention, q, k, v, upstream)
    rank, local = 1, heads // tp
    qs = slice(rank * local, (rank + 1) * local)
    kvs = slice(rank * kv_heads // tp, (rank + 1) * kv_heads // tp) if kv_heads >= tp else slice(0, 1)
    shard = [x.detach()[:, s].clone().requires_grad_() for x, s in ((q, qs), (k, kvs), (v, kvs))]
    out, grads = output_and_grads(nki_flash_attention, *shard, upstream[:, qs])
    torch.testing.assert_close(out, want_out[:, qs], atol=1e-5, rtol=0)
    torch.testing.assert_close(grads[0], want_grads[0][:, qs], atol=1e-5, rtol=0)
    if kv_heads >= tp:  # whole KV groups: this rank's k/v gradients are the whole model's for those heads
        torch.testing.assert_close(grads[1], want_grads[1][:, kvs], atol=1e-5, rtol=0)


# -- the neuron backend's build (meta model -> NxD layers -> shards filled) with the NxD stand-ins -------------------


def tiny_recipe(sequence_parallel: bool = False, **model):
    """Llama 3.1's tiny recipe at the kernel's sequence (2 layers, 2 query heads over 1 KV head), on trn1 at TP 2."""
    changes = {"max_seq_len": SEQ, "num_heads": 2, **model}
    return load_recipe("llama3.1-tiny", overrides=[
        "cluster.instance=trn1.32xlarge", "cluster.backend=neuron", "cluster.workers_per_node=2", "layout.tp=2",
        f"layout.sequence_parallel={sequence_parallel}", f"batch.seq_len={SEQ}", "batch.micro_batch=1",
        *(f"model.{k}={v}" for k, v in changes.items())])  # fmt: skip


def loss_and_grads(model, tokens, labels):
    loss = model(tokens, labels=labels)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize(("sequence_parallel", "checkpointing"), [(False, "none"), (True, "selective")])
def test_a_llama_trains_through_the_kernel_on_the_neuron_build(monkeypatch, sequence_parallel, checkpointing):
    """Forward and backward of the tiny Llama through NeuronXlaBackend's build (NxD's layers, TP 2 routed through
    the TP-1 stand-in: whole layers) with nki_flash: the loss and every gradient are the plain SDPA model's. Every
    layer's core attention calls the kernel on the whole sequence, after sequence parallelism's all-gather (the
    stand-in's gather is the identity: the order is what is checked); selective checkpointing recomputes through
    the kernel in backward."""
    install_fake_nxd(monkeypatch)
    calls = install_flash_attn(monkeypatch)
    mappings = sys.modules["neuronx_distributed.parallel_layers.mappings"]
    gather = mappings.gather_from_sequence_parallel_region

    def recorded_gather(input_, **kwargs):
        calls.append({"gather": tuple(input_.shape)})
        return gather(input_, **kwargs)

    monkeypatch.setattr(mappings, "gather_from_sequence_parallel_region", recorded_gather)
    monkeypatch.setattr(build_module, "shard_region", whole_region)  # the TP-1 stand-in makes whole layers
    r = tiny_recipe(sequence_parallel, attention="nki_flash", activation_checkpointing=checkpointing)
    reference = build_model(dataclasses.replace(r.model, attention="sdpa"))
    reference.init_weights(seed=r.train.seed)
    tokens = torch.randint(0, r.model.vocab_size, (1, SEQ + 1), generator=torch.Generator().manual_seed(2))
    tokens, labels = tokens[:, :-1], tokens[:, 1:].clone()
    labels[0, :7] = IGNORE_INDEX
    want_loss, want_grads = loss_and_grads(reference, tokens, labels)

    dims = stand_in_dims(tp=2)
    model = build_model_shard(r, dims=dims, backend=NeuronXlaBackend("neuron", torch.device("cpu")))
    loss, grads = loss_and_grads(model, tokens, labels)
    torch.testing.assert_close(loss, want_loss, atol=1e-5, rtol=0)
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")

    layers = r.model.num_layers
    kernel = [i for i, c in enumerate(calls) if "shape" in c]
    assert all(calls[i]["shape"] == (1, 2, SEQ, 32) and calls[i]["kv_shape"] == (1, 2, SEQ, 32) for i in kernel)
    assert len(kernel) == layers * (2 if checkpointing == "selective" else 1)  # + one recomputation per layer
    if sequence_parallel:  # each forward kernel call right after its attention's all-gather of the whole sequence
        assert all(calls[i - 1] == {"gather": (1, SEQ, r.model.hidden_size)} for i in kernel[:layers])


def test_every_core_attention_gets_the_kernel_and_a_masked_core_refuses_it():
    model = build_model(tiny_recipe().model, "meta")
    assert all(m.kernel is causal_attention for m in model.modules() if isinstance(m, CoreAttention))
    apply_attention_kernel(model, "nki_flash")
    assert [m.kernel for m in model.modules() if isinstance(m, CoreAttention)] == [nki_flash_attention] * 2
    bert = build_model(load_recipe("bert-tiny").model, "meta")
    apply_attention_kernel(bert, "sdpa")  # its own masked attention: nothing to swap
    with pytest.raises(ValueError, match=r"model\.attention .nki_flash.: EncoderCoreAttention computes its own"):
        apply_attention_kernel(bert, "nki_flash")
    with pytest.raises(ValueError, match=r"model.attention must be one of \('sdpa', 'nki_flash'\), not 'flash'"):
        apply_attention_kernel(model, "flash")


# -- where the recipe check lets it run (torch-free) -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ("cluster.instance=trn2.48xlarge cluster.neuron_sdk=2.33 layout.tp=8 compile.optlevel=1",
         "model.attention nki_flash on TorchNeuron (cluster.neuron_sdk 2.33): AWS documents neither an SDPA-to-NKI"
         " dispatch nor an NKI flash-attention op for training there; use model.attention sdpa, or torch-xla + NxD"
         " (cluster.neuron_sdk 2.21 to 2.28)"),
        ("cluster.instance=p5.48xlarge cluster.backend=cuda layout.tp=8",
         "model.attention nki_flash runs on backend neuron with torch-xla + NxD (cluster.neuron_sdk 2.21 to 2.28),"
         " not on backend cuda; use model.attention sdpa"),
        ("batch.seq_len=3072",
         "model.attention nki_flash: batch.seq_len 3072 must be a multiple of 2048 (NxD's flash attention), e.g. 2048"
         " or 4096; use model.attention sdpa for other lengths"),
        ("model.num_heads=16 model.num_kv_heads=8 layout.tp=16",
         "model.attention nki_flash: head_dim 256 (model.hidden_size / num_heads) is above the kernel's 128; use"
         " model.attention sdpa"),
    ],
)  # fmt: skip
def test_the_recipe_check_refuses_it_where_the_kernel_does_not_run(overrides, says):
    with pytest.raises(RecipeError) as refused:
        load_recipe("llama3.1-8b", overrides=f"{overrides} model.attention=nki_flash")
    assert says in str(refused.value)
    load_recipe("llama3.1-8b", overrides=f"{overrides} model.attention=sdpa")  # the way out it names


def test_the_memory_estimate_stops_counting_attention_probabilities_with_the_kernel():
    """Without checkpointing, SDPA off CUDA keeps each layer's probabilities (heads / TP x seq a token); the flash
    kernel keeps a logsumexp row instead. Selective checkpointing recomputes them: SDPA still materialises one
    layer's at a time (in its forward and its recompute), the kernel none."""
    plans = {}
    for attention in ("sdpa", "nki_flash"):
        for checkpointing in ("none", "selective"):
            r = load_recipe("llama3.1-8b", overrides=f"model.attention={attention}"
                            f" model.activation_checkpointing={checkpointing}")  # fmt: skip
            plans[attention, checkpointing] = memory_plan(r, dp=32, grad_accum=32).activations
    m, tokens = r.model, r.batch.micro_batch * r.batch.seq_len
    probabilities = m.num_layers * m.num_heads / r.layout.tp * r.batch.seq_len * tokens * 2  # bf16-mixed: 2 bytes
    assert plans["sdpa", "none"] - plans["nki_flash", "none"] == pytest.approx(probabilities)
    assert plans["nki_flash", "none"] == plans["nki_flash", "selective"]
    assert plans["sdpa", "selective"] - plans["nki_flash", "selective"] == pytest.approx(probabilities / m.num_layers)


def test_a_run_resumes_across_a_change_of_kernel(tmp_path):
    """The kernel changes how attention is computed, not what: a checkpoint saved with SDPA (as every run before this
    option was) resumes under nki_flash without checkpoint.allow_changes."""
    from trnrecipes.checkpoint import write_model_checkpoint
    from trnrecipes.train.resume_compat import resume_differences

    r = load_recipe("llama3.1-tiny")
    model = build_model(r.model)
    model.init_weights(seed=0)
    ckpt = write_model_checkpoint(tmp_path / "ckpt", model.state_dict(), r)
    current = r.to_dict()
    current["model"]["attention"] = "nki_flash"
    assert resume_differences(ckpt, current, None, allowed=()) == ([], [])


def test_the_trn1_llama_3_1_recipes_train_with_it():
    for name in ("llama3.1-8b", "llama3.1-70b"):
        assert load_recipe(name).model.attention == "nki_flash"
    assert load_recipe("llama3.1-tiny").model.attention == "sdpa"  # the default
