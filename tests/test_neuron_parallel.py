"""The Neuron tensor-parallel adapter: what it replaces (pure, checked here) and its import guard. The NxD layers
themselves only exist on Trainium hosts."""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import torch
from nxd_layers_standin import HostMasters, layer_modules
from torch import nn
from torch.nn import functional as F

from trnrecipes.backends.neuron_xla import NeuronXlaBackend, Zero1Optimizer
from trnrecipes.config.recipe import load_recipe
from trnrecipes.models import build_model
from trnrecipes.parallel.nxd import (
    apply_neuron_tensor_parallel,
    linear_specs,
    load_zero1_moments,
    make_zero1_optimizer,
    param_norm,
    sequence_parallel_params,
    set_zero1_lr,
    zero1_grad_norm,
    zero1_moments,
    zero1_param_groups,
    zero1_rank,
    zero1_rows,
    zero1_step_count,
)
from trnrecipes.parallel.sharding import Region, shard_region
from trnrecipes.train import build as build_module
from trnrecipes.train.build import build_model_shard


def test_specs_follow_the_family_plans_on_the_real_shapes():
    neox = load_recipe("neox20b").model
    specs = linear_specs(build_model(neox, "meta"), "neox")
    assert len(specs) == 4 * 44
    assert specs[0].name == "layers.0.attn.qkv" and (specs[0].kind, specs[0].out_features, specs[0].bias) == (
        "column", 3 * 6144, True,
    )  # fmt: skip
    llama = build_model(load_recipe("llama2-7b").model, "meta")
    by_name = {s.name: s for s in linear_specs(llama, "llama2")}
    assert by_name["layers.31.mlp.gate_up"].out_features == 2 * 11008 and by_name["layers.31.mlp.down"].kind == "row"
    assert not any(s.bias for s in by_name.values())


@pytest.mark.skipif(importlib.util.find_spec("neuronx_distributed") is not None, reason="a real Neuron host")
def test_without_the_neuron_sdk_the_adapter_says_what_is_missing():
    model = build_model(load_recipe("neox-tiny").model, "meta")
    with pytest.raises(RuntimeError, match="needs neuronx-distributed from the Neuron SDK"):
        apply_neuron_tensor_parallel(model, "neox")


@pytest.mark.parametrize(("recipe", "family"), [("neox-tiny", "neox"), ("llama2-tiny", "llama2")])
def test_sequence_parallel_tags_exactly_the_norm_parameters(recipe, family):
    """Under SP the norms see a sequence shard: their gradients must be summed over TP. Cross-checked against the
    module types, so a norm added to a model but not to its family plan fails here."""
    model = build_model(load_recipe(recipe).model, "meta")
    tagged = sequence_parallel_params(model, family)
    norm_types = ("LayerNorm", "RMSNorm")
    expected = [f"{m}.{p}" for m, mod in model.named_modules() if type(mod).__name__ in norm_types
                for p, _ in mod.named_parameters(recurse=False)]  # fmt: skip
    assert sorted(tagged) == sorted(expected) and len(tagged) == len(set(tagged))
    assert "norm.weight" in tagged and any(name.startswith("layers.1.") for name in tagged)


# -- the adapter's wiring, against a stand-in for NxD at TP 1 -------------------------------------------------------
# The stand-in has NxD 0.17's (Neuron SDK 2.28's) signatures, keyword names and defaults included, so that a misspelt
# or missing argument fails here (tests/test_nxd_signatures.py compares them with the real ones, and the adapters'
# calls with every supported release), and TP-1 behaviour: each parallel linear is the whole linear and the mappings
# are identities. Its layers (tests/nxd_layers_standin.py) handle devices as NxD's do, and record the unsharded host
# tensors NxD's init would allocate. It checks what can be checked off Trainium: every layer is built with the
# arguments the adapter means to pass, the weights land in the right layers, and the hooks keep the model's function;
# not NxD's collectives.


def install_fake_nxd(
    monkeypatch, tp: int = 1, rank: int = 0, dp: int = 1, dp_rank: int = 0, pp: int = 1, pp_rank: int = 0
) -> list[dict]:
    """At tp > 1 the layers allocate NxD's shard shapes and tag them as NxD does (tensor_model_parallel,
    partition_dim, partition_stride, num_partitions): column-parallel weights and biases split rows, row-parallel
    weights split columns (their bias is whole), the embedding splits the vocabulary. Their forward is then not
    meaningful (no collectives). The layers module's host_masters (a HostMasters) records their host inits.
    The parallel state is always initialised (NxD 0.15+'s layers fall back to a non-parallel state otherwise).
    The process groups are NxD's on trn1 at TP 8 (consecutive TP groups, strided DP groups) for a world of tp x dp,
    this process being TP rank `rank` of DP rank `dp_rank`; see _fake_zero1_optimizer for the zero-1 optimizer.
    Pipeline stages (pp > 1) only answer this process's PP size, rank and group (the pipeline model itself:
    tests/test_neuron_pipeline.py). parallel_state.calls records initialize_model_parallel's keyword arguments;
    grads.calls the gradient lists bucket_allreduce_gradients reduced over DP (identical replicas: the mean is the
    identity) and clip_grad_norm's (max_norm, norm) (NxD's get_grad_norm on this process's gradients: at TP 1 and
    without the PP and DP all-reduces)."""
    built: list[dict] = []
    tp_groups = [[d * tp + t for t in range(tp)] for d in range(dp)]
    dp_groups = [[d * tp + t for d in range(dp)] for t in range(tp)]

    def scatter_to_sequence_parallel_region(input_, sequence_dimension=0, process_group=None):
        assert sequence_dimension == 1  # our activations are [batch, seq, hidden], not NxD's default [seq, ...]
        return input_

    def gather_from_sequence_parallel_region(input_, sequence_dimension=0, to_model_parallel=True, process_group=None,
                                             tile_cc=False):  # fmt: skip
        assert sequence_dimension == 1 and not to_model_parallel
        return input_

    state_calls: list[dict] = []
    kv_state: dict[str, int] = {}

    def get_kv_shared_group(as_list=False):
        """trn1's KV-shared groups (parallel_state.arrange_kv_groups, NxD 0.17): the copies of a KV head on TP ranks
        j, j + tp / r, j + 2 tp / r, ... of each TP group."""
        assert as_list
        kv = tp // kv_state["multiplier"]
        return [[group[t] for t in range(tp) if t % kv == g] for group in tp_groups for g in range(kv)]

    def set_tensor_model_parallel_attributes(tensor, is_parallel, dim, stride, num_partitions=-1, rank_ordering=None):
        assert not hasattr(tensor, "tensor_model_parallel")  # NxD asserts the attributes are not set yet
        tensor.tensor_model_parallel, tensor.partition_dim, tensor.partition_stride = is_parallel, dim, stride
        tensor.num_partitions, tensor.rank_ordering = num_partitions, rank_ordering

    def initialize_kv_group(kv_shared_group_size=1, sequential_ranks_in_group=False):
        # NxD builds the KV-shared groups once; every later layer must ask for the same size
        assert kv_state.setdefault("multiplier", kv_shared_group_size) == kv_shared_group_size

    host = HostMasters()
    layers = layer_modules(tp, rank, built, host, types.SimpleNamespace(
        set_tensor_model_parallel_attributes=set_tensor_model_parallel_attributes,
        initialize_kv_group=initialize_kv_group,
    ))  # fmt: skip

    grad_calls: list[tuple] = []

    def initialize_model_parallel(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        context_parallel_size=1,
        expert_model_parallel_size=1,
        skip_collective_init=False,
        lnc_size=1,
        mesh_only=False,
    ):
        sizes = dict(tensor_model_parallel_size=tensor_model_parallel_size, lnc_size=lnc_size)
        state_calls.append(dict(**sizes, pipeline_model_parallel_size=pipeline_model_parallel_size))

    def bucket_allreduce_gradients(grads_list, reduce_over_ep_group=False):
        grad_calls.append(("bucket_allreduce_gradients", list(grads_list)))

    def clip_grad_norm(parameters, max_norm, norm_type=2, zero1_optimizer=False, zero1_optimizer_groups=None,
                       force_spmd=True):  # fmt: skip
        params = [parameters] if not isinstance(parameters, list) else parameters
        grads = [p.grad.detach() for p in params if p.grad is not None]
        norm = torch.stack([torch.norm(g, 2.0) ** 2 for g in grads]).sum().sqrt().reshape(1)
        coeff = max_norm / (norm + 1.0e-6)
        for g in grads:
            g.mul_(torch.where(coeff < 1, coeff, torch.tensor(1.0)))
        grad_calls.append(("clip_grad_norm", max_norm, norm))
        return norm

    modules = {
        "neuronx_distributed": {},
        **layers,
        "neuronx_distributed.parallel_layers.mappings": dict(
            scatter_to_sequence_parallel_region=scatter_to_sequence_parallel_region,
            gather_from_sequence_parallel_region=gather_from_sequence_parallel_region,
            reduce_from_tensor_model_parallel_region=lambda input_, process_group=None: input_,
        ),
        "neuronx_distributed.parallel_layers.loss_functions": dict(parallel_cross_entropy=parallel_cross_entropy),
        "neuronx_distributed.parallel_layers.parallel_state": dict(
            get_tensor_model_parallel_size=lambda: tp,
            get_tensor_model_parallel_rank=lambda: rank,
            get_data_parallel_size=lambda: dp,
            get_data_parallel_rank=lambda: dp_rank,
            get_data_parallel_replica_groups=lambda: [list(g) for g in dp_groups],
            get_tensor_model_parallel_replica_groups=lambda: [list(g) for g in tp_groups],
            get_pipeline_model_parallel_size=lambda: pp,
            get_pipeline_model_parallel_rank=lambda: pp_rank,
            get_pipeline_model_parallel_group=lambda as_list=False: "nxd-pp-group",
            get_kv_shared_group=get_kv_shared_group,
            initialize_kv_group=initialize_kv_group,
            model_parallel_is_initialized=lambda: True,
            initialize_model_parallel=initialize_model_parallel,
            calls=state_calls,
        ),
        "neuronx_distributed.parallel_layers.utils": dict(
            set_tensor_model_parallel_attributes=set_tensor_model_parallel_attributes
        ),
        "neuronx_distributed.modules": {},
        "neuronx_distributed.parallel_layers.grads": dict(
            bucket_allreduce_gradients=bucket_allreduce_gradients,
            clip_grad_norm=clip_grad_norm,
            calls=grad_calls,
        ),
        "neuronx_distributed.optimizer": dict(
            NeuronZero1Optimizer=_fake_zero1_optimizer(global_rank=dp_rank * tp + rank, tp=tp, dp_groups=dp_groups)
        ),
        "neuronx_distributed.utils": {},
        "neuronx_distributed.utils.model_utils": dict(move_model_to_device=lambda model, device: model.to(device)),
    }
    package = types.ModuleType("neuronx_distributed.parallel_layers")
    monkeypatch.setitem(sys.modules, package.__name__, package)
    for name, attrs in modules.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)
        if name.startswith(package.__name__ + "."):
            setattr(package, name.rsplit(".", 1)[1], module)
    return built


class _ParallelCrossEntropy(torch.autograd.Function):
    """NxD's _ParallelCrossEntropy (parallel_layers/loss_functions.py, the same file at NxD 0.10 to 0.17) at TP 1:
    its all-reduces are identities and this rank's vocabulary range is all of it. Kept from the real one: a loss per
    token, no ignore_index (a target outside the range gets predicted logit 0, so its loss is the log-sum-exp and its
    gradient the softmax), and the in-place shift of the logits it is given. Label smoothing is left out."""

    @staticmethod
    def forward(ctx, vocab_parallel_logits, target):
        logits_max = torch.max(vocab_parallel_logits, dim=-1)[0]
        vocab_parallel_logits.sub_(logits_max.unsqueeze(dim=-1))
        partition_vocab_size = vocab_parallel_logits.size()[-1]
        target_mask = (target >= 0) & (target < partition_vocab_size)
        masked_target = torch.mul(target.clone(), target_mask.long())
        logits_2d = vocab_parallel_logits.view(-1, partition_vocab_size)
        masked_target_1d = masked_target.view(-1)
        arange_1d = torch.arange(start=0, end=logits_2d.size()[0], device=logits_2d.device, dtype=torch.long)
        predicted_logits = logits_2d[arange_1d, masked_target_1d].clone().contiguous().view_as(target)
        predicted_logits = torch.mul(predicted_logits, target_mask.float())
        exp_logits = torch.exp(vocab_parallel_logits)
        sum_exp_logits = exp_logits.sum(dim=-1)
        loss = torch.log(sum_exp_logits) - predicted_logits
        exp_logits.div_(sum_exp_logits.unsqueeze(dim=-1))
        ctx.save_for_backward(exp_logits, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        grad_2d = softmax.view(-1, softmax.size()[-1])
        arange_1d = torch.arange(start=0, end=grad_2d.size()[0], device=grad_2d.device, dtype=torch.long)
        grad_2d[arange_1d, masked_target_1d] -= target_mask.view(-1).float()
        softmax.mul_(grad_output.unsqueeze(dim=-1))
        return softmax, None


def parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing=0.0):
    if label_smoothing:
        raise NotImplementedError("the stand-in has no label smoothing")
    return _ParallelCrossEntropy.apply(vocab_parallel_logits, target)


def _pad_and_chunk(tensor: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    """torch-xla's ZeroRedundancyOptimizer._shard_tensor (_pad_to_world_size, then chunk): zero rows appended on dim
    0 up to a multiple of world_size, and chunk `rank` of world_size."""
    if tensor.size(0) % world_size != 0:
        pad_size = world_size - tensor.size(0) % world_size
        tensor = F.pad(tensor, [0, 0] * (tensor.dim() - 1) + [0, pad_size])
    return tensor.chunk(world_size)[rank]


def _fake_zero1_optimizer(global_rank: int, tp: int, dp_groups: list[list[int]]) -> type:
    """NxD 2.29's NeuronZero1Optimizer (neuronx_distributed/optimizer/zero_redundancy_optimizer.py, fbac349): its
    arguments go to torch-xla v2.9.0's ZeroRedundancyOptimizer (torch_xla/distributed/zero_redundancy_optimizer.py,
    5fab7053, the same in v2.8.x), whose constructor is copied here keyword for keyword, defaults included; NxD
    defaults sharding_groups to the DP replica groups and replaces the grad norm with its get_grad_norm.

    Behaviour on one process, as the real step() orders it: param_groups synced into the base optimizer; each
    gradient padded and reduce-scattered (mean) over the sharding group; the grad norm (shards summed over the
    sharding group and TP) kept in grad_norm and the shard gradients clipped; the base optimizer steps the shards;
    the shards all-gathered into the parameters. The collectives are modelled by assuming every DP replica holds the
    same gradient (the mean is this rank's chunk; the norm summed over the DP slices is the whole gradient's) and
    TP 1 (identity); the all-gather writes this rank's chunk and leaves the rows that other ranks would send."""

    class NeuronZero1Optimizer(torch.optim.Optimizer):
        def __init__(
            self,
            params,
            optimizer_class,
            optimizer_dtype=None,
            grad_clipping=True,
            max_norm=None,
            pin_layout=True,
            sharding_groups=None,
            grad_norm_groups=None,
            lazy_init=False,
            bucket_cap_mb_all_gather=0,
            bucket_cap_mb_reduce_scatter=0,
            use_grad_acc_hook=False,
            save_master_weights=False,
            higher_cc_precision=False,
            **defaults,
        ):
            if sharding_groups is None:  # NeuronZero1Optimizer's default
                sharding_groups = [list(g) for g in dp_groups]
            super().__init__(params, defaults)
            self._sharding_groups, self._grad_norm_groups = sharding_groups, grad_norm_groups
            self.optimizer_class, self.defaults = optimizer_class, defaults
            self.optimizer_dtype = optimizer_dtype if optimizer_dtype is not None else torch.float32
            self.grad_clipping = grad_clipping
            self.max_norm = max_norm if max_norm is not None else 1.0
            self.flags = dict(
                pin_layout=pin_layout,
                lazy_init=lazy_init,
                bucket_cap_mb_all_gather=bucket_cap_mb_all_gather,
                bucket_cap_mb_reduce_scatter=bucket_cap_mb_reduce_scatter,
                use_grad_acc_hook=use_grad_acc_hook,
                save_master_weights=save_master_weights,
                higher_cc_precision=higher_cc_precision,
            )
            self._grad_norm = None
            self.inited = False
            if not lazy_init:
                self.init_zero()

        def init_zero(self):
            self.local_world_size = len(self._sharding_groups[0])
            self.local_rank = None
            for group in self._sharding_groups:
                if global_rank in group:
                    self.local_rank = list(group).index(global_rank)
            if self.local_rank is None:
                raise ValueError(f"Current rank {global_rank} is missing from the sharding_groups")
            sharded_groups = []
            for group in self.param_groups:
                shards = []
                for param in group["params"]:
                    data = _pad_and_chunk(param.data.to(device="cpu"), self.local_world_size, self.local_rank)
                    shards.append(nn.Parameter(data.to(dtype=self.optimizer_dtype).clone(), param.requires_grad))
                sharded_groups.append({**group, "params": shards})
            self.base_optimizer = self.optimizer_class(sharded_groups, **self.defaults)
            self._sync_param_groups(self.param_groups, self.base_optimizer.param_groups)
            self.inited = True

        @property
        def grad_norm(self):
            return self._grad_norm

        @staticmethod
        def _sync_param_groups(src_param_groups, dst_param_groups):
            for src, dst in zip(src_param_groups, dst_param_groups, strict=True):
                for key in (k for k in src if k != "params"):
                    dst[key] = src[key]

        def _pairs(self):
            for group, sharded in zip(self.param_groups, self.base_optimizer.param_groups, strict=True):
                yield from zip(group["params"], sharded["params"], strict=True)

        @torch.no_grad()
        def step(self, closure=None):
            assert self.inited, "must call init_zero() first"
            self._sync_param_groups(self.param_groups, self.base_optimizer.param_groups)
            ws, rank = self.local_world_size, self.local_rank
            total = torch.zeros(1, dtype=self.optimizer_dtype)
            for param, shard in self._pairs():
                if param.grad is not None:
                    shard.grad = _pad_and_chunk(param.grad, ws, rank).to(dtype=self.optimizer_dtype)
                    square = torch.norm(param.grad.to(dtype=self.optimizer_dtype), 2.0) ** 2
                    # NxD's get_grad_norm: TP-replicated parameters / tp, then the TP all-reduce (identity at tp 1)
                    total += square if getattr(param, "tensor_model_parallel", False) else square / tp
            if self.grad_clipping:
                self._grad_norm = torch.pow(total, 0.5).detach().clone()
                clip_coeff = self.max_norm / (self._grad_norm + 1.0e-6)
                for _, shard in self._pairs():
                    if shard.grad is not None:
                        shard.grad.mul_(torch.where(clip_coeff < 1, clip_coeff, torch.tensor(1.0)))
            self.base_optimizer.step(closure=None)
            self.base_optimizer.zero_grad(set_to_none=True)
            for param, shard in self._pairs():
                if param.grad is not None:
                    padded = param.data.clone()  # holding, where other ranks' rows go, what they would send
                    if param.size(0) % ws:
                        padded = F.pad(padded, [0, 0] * (param.dim() - 1) + [0, ws - param.size(0) % ws])
                    padded.chunk(ws)[rank].copy_(shard.data.to(dtype=param.dtype))
                    param.data.copy_(padded[: param.size(0)])
            self._sync_param_groups(self.base_optimizer.param_groups, self.param_groups)

        def zero_grad(self, set_to_none=False):
            super().zero_grad(set_to_none=set_to_none)

    return NeuronZero1Optimizer


def stand_in_dims(**fields) -> types.SimpleNamespace:
    """A ParallelDims stand-in for one rank built in this process: one of everything unless `fields` say otherwise;
    shards_moments derived as ParallelDims derives it."""
    dims = dict(tp=1, tp_rank=0, dp=1, dp_rank=0, pp=1, pp_rank=0, world=1, rank=0, zero1=False, fsdp=False, mesh=None,
                ep=1, ep_rank=0, cp=1, cp_rank=0)  # fmt: skip
    dims |= fields
    shard = dict(shard_n=dims["dp"] * dims["cp"], shard_rank=dims["dp_rank"] * dims["cp"] + dims["cp_rank"])
    return types.SimpleNamespace(**dims, **shard, shards_moments=dims["zero1"] or dims["fsdp"])


def whole_region(shape, dim, tp, rank, *_, **__) -> Region:
    """shard_region as if TP were 1: the TP-1 NxD stand-in makes whole layers."""
    return shard_region(shape, dim, 1, 0)


def _neuron_build(recipe, tp: int, rank: int) -> nn.Module:
    dims = stand_in_dims(tp=tp, tp_rank=rank)
    return build_model_shard(recipe, dims=dims, backend=NeuronXlaBackend("neuron", torch.device("cpu")))


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize(("recipe", "family"), [("neox-tiny", "neox"), ("llama2-tiny", "llama2")])
def test_adapter_builds_nxd_layers_that_keep_the_function(monkeypatch, recipe, family, dtype, sequence_parallel):
    """Through the training build (meta model -> NxD layers -> each shard filled): at TP 1 the stand-in is the
    whole model, so the result must compute what the plain model with the same seed computes."""
    built = install_fake_nxd(monkeypatch)
    layout = ["layout.tp=2", "cluster.workers_per_node=2", f"layout.sequence_parallel={sequence_parallel}"]
    r = load_recipe(recipe, overrides=[f"precision.dtype={dtype}", *layout])
    model = build_model(r.model)
    model.init_weights(seed=r.train.seed)
    model.to(torch.bfloat16 if dtype == "bf16" else torch.float32)
    tokens = torch.randint(0, model.args.vocab_size, (2, 16))
    with torch.no_grad():
        expected = model(tokens)
    monkeypatch.setattr(build_module, "shard_region", whole_region)
    parallel = _neuron_build(r, 2, 0)  # tp 2 routes through NxD; the TP-1 stand-in makes whole layers
    with torch.no_grad():
        assert torch.equal(parallel(tokens), expected)  # weights filled into the right layers, hooks harmless

    linears = [b for b in built if b["layer"] != "ParallelEmbedding"]
    assert len(linears) == len(linear_specs(model, family)) + 1  # + the head
    for b in built:
        assert b["dtype"] == expected.dtype and b["init_method"].__name__ == "_keep_uninitialized"
    for b in linears:
        # NxD reduces the input gradient in reduce_dtype; any other dtype than the weights' loses the reduction.
        assert b["reduce_dtype"] == expected.dtype
        row = b["layer"] == "RowParallelLinear"
        assert b["sp"] == ((True, 1) if row and sequence_parallel else (False, None))
        assert b.get("input_is_parallel", True) and b.get("gather_output", False) is False  # the head's logits too


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize(("recipe", "family"), [("neox-tiny", "neox"), ("llama2-tiny", "llama2")])
def test_the_neuron_head_loss_is_nxds_parallel_cross_entropy_over_the_labelled_tokens(
    monkeypatch, recipe, family, dtype
):
    """model.head_loss on the NxD path: NxD's parallel_cross_entropy on the head's shard (the TP-1 stand-in), masked
    to the labelled tokens and averaged over them: the plain model's loss and gradients. Without the mask, the
    ignored rows' log-sum-exp (NxD has no ignore_index) would be in the mean."""
    install_fake_nxd(monkeypatch)
    r = load_recipe(recipe, overrides=[f"precision.dtype={dtype}", "layout.tp=2", "cluster.workers_per_node=2"])
    model = build_model(r.model)
    model.init_weights(seed=r.train.seed)
    model.to(torch.bfloat16 if dtype == "bf16" else torch.float32)
    tokens = torch.randint(0, model.args.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    tokens, labels = tokens[:, :-1], tokens[:, 1:].clone()
    labels[0, :5] = -100
    expected = model(tokens, labels=labels)
    expected.backward()
    monkeypatch.setattr(build_module, "shard_region", whole_region)
    parallel = _neuron_build(r, 2, 0)
    assert parallel.head_loss.__name__ == "nxd_head_loss"
    got = parallel(tokens, labels=labels)
    got.backward()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    grads = {n: p.grad for n, p in model.named_parameters()}
    for name, p in parallel.named_parameters():  # bf16: both round the same fp32 gradient of the logits
        tol = dict(rtol=1e-5, atol=1e-6) if dtype == "fp32" else dict(rtol=2e-2, atol=2e-3)
        torch.testing.assert_close(p.grad, grads[name], **tol, msg=name)


@pytest.mark.parametrize("recipe", ["neox-tiny", "llama2-tiny"])
def test_each_neuron_tp_rank_allocates_and_fills_only_its_shard_of_the_same_model(monkeypatch, recipe):
    """TP 2 stand-in with NxD's shard shapes: each rank's parameters are its shard (half of every split one) of the
    TP-1 init, found by partition_dim; joined they are that model bitwise."""
    r = load_recipe(recipe)
    reference = build_model(r.model)
    reference.init_weights(seed=r.train.seed)
    shards = []
    for rank in (0, 1):
        install_fake_nxd(monkeypatch, tp=2, rank=rank)
        shards.append(dict(_neuron_build(r, 2, rank).named_parameters()))
    split = 0
    for name, full in reference.named_parameters():
        a, b = shards[0][name], shards[1][name]
        if getattr(a, "tensor_model_parallel", False):
            split += 1
            assert a.numel() * 2 == full.numel()
            assert torch.equal(torch.cat([a, b], dim=a.partition_dim), full.detach()), name
        else:
            assert torch.equal(a, full) and torch.equal(b, full), name
    assert split == 2 * len(linear_specs(reference, r.model.family)) + 2 - sum(
        not s.bias or s.kind == "row" for s in linear_specs(reference, r.model.family)
    )


@pytest.mark.parametrize("recipe", ["neox-tiny", "llama2-tiny"])
def test_each_neuron_tp_rank_reads_only_its_shard_from_a_checkpoint(monkeypatch, tmp_path, recipe):
    """Per-rank loading on Neuron: a TP-1 checkpoint (other weights than the seed draws) read into the TP-2 stand-in:
    each rank's NxD shard, found by partition_dim, is exactly its slice of the saved tensors."""
    from trnrecipes.checkpoint import write_model_checkpoint

    r = load_recipe(recipe)
    saved = build_model(r.model)
    saved.init_weights(seed=r.train.seed + 1)
    ckpt = write_model_checkpoint(tmp_path / "ckpt", saved.state_dict(), r)
    dims = stand_in_dims(tp=2)
    for rank in (0, 1):
        install_fake_nxd(monkeypatch, tp=2, rank=rank)
        dims.tp_rank = rank
        backend = NeuronXlaBackend("neuron", torch.device("cpu"))
        shard = build_model_shard(r, dims=dims, backend=backend, weights=ckpt)
        for name, p in shard.named_parameters():
            full = saved.get_parameter(name).detach()
            dim = backend.shard_dim(p)
            expected = full if dim is None else full.chunk(2, dim=dim)[rank]
            assert torch.equal(p.detach(), expected), (rank, name)


def test_param_norm_counts_sharded_and_replicated_parameters(monkeypatch):
    """At TP 1 the TP sum is the identity, so the split into NxD-sharded and replicated parameters must add up to
    the plain norm (a parameter dropped or counted twice would not)."""
    install_fake_nxd(monkeypatch)
    model = build_model(load_recipe("neox-tiny").model)
    model.init_weights()
    params = list(model.parameters())
    for p in params[::2]:
        p.tensor_model_parallel = True
    expected = torch.cat([p.detach().double().flatten() for p in params]).norm().float()
    assert torch.allclose(param_norm(params), expected, rtol=1e-5)


# -- ZeRO-1 through NxD's zero-1 optimizer, against the stand-in above -----------------------------------------------


class _TinyLM(nn.Module):
    """Parameters of several row counts (11, 5, 2: uneven over 3 DP ranks, one leaving a rank only padding), 1-D
    ones among them (the no-decay group), all used by the loss."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.proj = nn.Linear(6, 5)
        self.norm = nn.LayerNorm(5)
        self.mix = nn.Linear(5, 2)
        self.back = nn.Linear(2, 5, bias=False)
        self.head = nn.Linear(5, 11, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.proj(self.embed(tokens)))
        return self.head(h + self.back(torch.tanh(self.mix(h))))


HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _groups(model: nn.Module) -> list[dict]:
    return zero1_param_groups(list(model.parameters()), {id(p) for p in model.parameters() if p.dim() < 2})


def _reference_adamw(model: nn.Module) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay}, {"params": others, "weight_decay": 0.0}], **HYPER)


def test_zero1_optimizer_is_built_as_nxd_trainer_builds_it(monkeypatch):
    """TP 2 x DP 4, this process TP rank 1 of DP rank 3 (global rank 7): the states must be sharded over its DP group
    ([1, 3, 5, 7], where it is 3rd of 4), not its TP group ([6, 7]) or the world; AdamW gets our hyper-parameters."""
    install_fake_nxd(monkeypatch, tp=2, rank=1, dp=4, dp_rank=3)
    monkeypatch.delenv("ALL_GATHER_REDUCE_SCATTER_BUCKET_CAP_MB", raising=False)
    model = _TinyLM()
    opt = make_zero1_optimizer(_groups(model), **HYPER, max_norm=1.0)
    assert opt._sharding_groups == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert opt._grad_norm_groups == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert zero1_rank(opt) == (4, 3)
    assert opt.optimizer_class is torch.optim.AdamW and opt.optimizer_dtype == torch.float32
    assert opt.grad_clipping and opt.max_norm == 1.0
    assert opt.flags == dict(
        pin_layout=False,
        lazy_init=False,
        bucket_cap_mb_all_gather=130 // 4,
        bucket_cap_mb_reduce_scatter=130,
        use_grad_acc_hook=False,
        save_master_weights=False,
        higher_cc_precision=False,
    )
    decay, no_decay = opt.base_optimizer.param_groups
    assert [p.dim() for p in opt.param_groups[0]["params"]] == [2] * 5
    assert [p.dim() for p in opt.param_groups[1]["params"]] == [1] * 4
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    for group in (decay, no_decay):
        assert (group["lr"], group["betas"], group["eps"]) == (3e-3, (0.9, 0.95), 1e-8)
    # embed.weight: 11 rows over 4 ranks -> 3 per rank, rank 3 holds row 9, row 10 and a padding row
    assert opt.base_optimizer.param_groups[0]["params"][0].shape == (3, 6)
    with pytest.raises(RuntimeError, match="no grad norm"):
        zero1_grad_norm(opt)

    # No clipping still measures the norm (coefficient 1); decaying every parameter leaves one group.
    everything = zero1_param_groups(list(model.parameters()), set())
    unclipped = make_zero1_optimizer(everything, **HYPER, max_norm=0.0)
    assert unclipped.grad_clipping and unclipped.max_norm == float("inf") and len(unclipped.param_groups) == 1


@pytest.mark.skipif(importlib.util.find_spec("neuronx_distributed") is not None, reason="a real Neuron host")
def test_without_the_neuron_sdk_the_zero1_optimizer_says_what_is_missing():
    with pytest.raises(RuntimeError, match="needs neuronx-distributed from the Neuron SDK"):
        make_zero1_optimizer(_groups(_TinyLM()), **HYPER, max_norm=1.0)


def test_zero1_rows_are_torch_xla_padding_and_chunking():
    """Which real rows torch-xla's pad-then-chunk gives each DP rank, read off a tensor of row numbers, is
    zero1_rows' range, and the checkpoint rule (shard_region) agrees; every chunk has ceil(rows / dp) rows."""
    pairs = 0
    for rows in range(1, 41):
        numbered = torch.arange(1, rows + 1).repeat(3, 1).T  # [rows, 3], row i holds i + 1; padding holds 0
        for dp in range(1, 13):
            for dp_rank in range(dp):
                shard = _pad_and_chunk(numbered, dp, dp_rank)
                start, stop = zero1_rows(rows, dp, dp_rank)
                assert shard.shape == (-(-rows // dp), 3)
                real = shard[:, 0][shard[:, 0] > 0]
                assert real.tolist() == list(range(start + 1, stop + 1)), (rows, dp, dp_rank)
                assert not shard[stop - start :].any()  # the rest is padding
                assert shard_region((rows, 3), None, 1, 0, dp, dp_rank) == Region((start, 0), (stop - start, 3))
                pairs += 1
    assert pairs == 40 * sum(range(1, 13))


def test_zero1_at_dp1_steps_as_plain_adamw_with_clipping(monkeypatch):
    """Through the adapter (param groups, lr per step, clipping, norm) the stand-in at DP 1 must train a model as
    torch.optim.AdamW after clip_grad_norm_ does, step for step; the norm is the one before clipping."""
    install_fake_nxd(monkeypatch)
    torch.manual_seed(0)
    model = _TinyLM()
    reference = _TinyLM()
    reference.load_state_dict(model.state_dict())
    opt = make_zero1_optimizer(_groups(model), **HYPER, max_norm=0.5)
    ref_opt = _reference_adamw(reference)
    clipped = 0
    for step, lr in enumerate([1e-3, 3e-3, 2e-3, 5e-4, 1e-4]):
        tokens = torch.randint(0, 11, (4, 7))
        for m in (model, reference):
            F.cross_entropy(m(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
        set_zero1_lr(opt, lr)
        for group in ref_opt.param_groups:
            group["lr"] = lr
        expected_norm = torch.nn.utils.clip_grad_norm_(list(reference.parameters()), 0.5)
        ref_opt.step()
        opt.step()
        norm = zero1_grad_norm(opt)
        assert norm.shape == () and torch.allclose(norm, expected_norm, rtol=1e-6)
        clipped += bool(expected_norm > 0.5)
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        assert zero1_step_count(opt) == step + 1
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6, msg=name)
    assert clipped >= 2 and not torch.equal(model.head.weight, _TinyLM().head.weight)
    slices = zero1_moments(opt)
    assert [s.param for s in slices] == [p for g in opt.param_groups for p in g["params"]]
    for s in slices:
        ref_state = ref_opt.state[_twins(model, reference)[id(s.param)]]
        assert s.rows == (0, s.param.shape[0])
        torch.testing.assert_close(s.exp_avg, ref_state["exp_avg"], rtol=1e-5, atol=1e-8)
        torch.testing.assert_close(s.exp_avg_sq, ref_state["exp_avg_sq"], rtol=1e-5, atol=1e-12)
        assert torch.equal(s.master, s.param.detach())  # fp32 weights: the master is the weight


@pytest.mark.parametrize("dp_rank", [0, 1, 2])
def test_zero1_moments_cover_this_ranks_rows_and_round_trip(monkeypatch, dp_rank):
    """DP 3, every replica with the same gradients: this rank's moments (padding cut off) are plain AdamW's moments
    of its rows, its rows of the weights are AdamW's, and moments saved from it and loaded into a fresh optimizer
    continue bitwise as the original does."""
    install_fake_nxd(monkeypatch, dp=3, dp_rank=dp_rank)
    torch.manual_seed(1)
    model = _TinyLM()
    reference = _TinyLM()
    reference.load_state_dict(model.state_dict())
    same = _twins(model, reference)
    opt = make_zero1_optimizer(_groups(model), **HYPER, max_norm=0.5)
    ref_opt = _reference_adamw(reference)
    before = zero1_moments(opt)  # no step yet: zero states of the right shapes
    assert all(not s.exp_avg.any() and s.exp_avg.shape[0] == s.rows[1] - s.rows[0] for s in before)
    assert zero1_step_count(opt) == 0

    def step(optimizers, grads):
        for p, g in zip(model.parameters(), grads, strict=True):
            p.grad = g.clone()
        for p, g in zip(reference.parameters(), grads, strict=True):
            p.grad = g.clone()
        torch.nn.utils.clip_grad_norm_(list(reference.parameters()), 0.5)
        for o in optimizers:
            o.step()

    for _ in range(3):
        step([opt, ref_opt], [torch.randn_like(p) for p in model.parameters()])
    slices = zero1_moments(opt)
    assert {s.rows for s in slices if s.param is model.mix.bias} == {zero1_rows(2, 3, dp_rank)}
    assert any(s.rows[0] == s.rows[1] for s in slices) == (dp_rank == 2)  # mix: 2 rows, rank 2 holds padding only
    for s in slices:
        start, stop = s.rows
        ref_param, ref_state = same[id(s.param)], ref_opt.state[same[id(s.param)]]
        torch.testing.assert_close(s.exp_avg, ref_state["exp_avg"][start:stop], rtol=1e-5, atol=1e-8)
        torch.testing.assert_close(s.exp_avg_sq, ref_state["exp_avg_sq"][start:stop], rtol=1e-5, atol=1e-12)
        torch.testing.assert_close(s.param[start:stop], ref_param[start:stop], rtol=1e-6, atol=1e-6)
        shard_state = opt.base_optimizer.state[_shard_of(opt, s.param)]
        assert not shard_state["exp_avg"][stop - start :].any()  # padding rows never move
    assert zero1_step_count(opt) == 3

    saved = [{"exp_avg": s.exp_avg.clone(), "exp_avg_sq": s.exp_avg_sq.clone()} for s in slices]
    resumed_model = _TinyLM()
    resumed_model.load_state_dict(model.state_dict())
    resumed = make_zero1_optimizer(_groups(resumed_model), **HYPER, max_norm=0.5)
    with pytest.raises(ValueError, match="exp_avg of rows"):
        load_zero1_moments(resumed, [{k: v[:0] for k, v in m.items()} if i == 0 else m for i, m in enumerate(saved)], 3)
    load_zero1_moments(resumed, saved, steps=3)
    assert zero1_step_count(resumed) == 3
    grads = [torch.randn_like(p) for p in model.parameters()]
    step([opt], grads)
    for p, g in zip(resumed_model.parameters(), grads, strict=True):
        p.grad = g.clone()
    resumed.step()
    for a, b in zip(zero1_moments(opt), zero1_moments(resumed), strict=True):
        assert torch.equal(a.exp_avg, b.exp_avg) and torch.equal(a.exp_avg_sq, b.exp_avg_sq)
    for p, q in zip(model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(p, q)


def _twins(model: nn.Module, reference: nn.Module) -> dict[int, nn.Parameter]:
    """id() of each parameter of `model` -> the same parameter of `reference`."""
    return dict(zip(map(id, model.parameters()), reference.parameters(), strict=True))


def _shard_of(opt, param: nn.Parameter) -> nn.Parameter:
    """The base optimizer's shard of one of the zero-1 optimizer's parameters."""
    params = [p for g in opt.param_groups for p in g["params"]]
    shards = [p for g in opt.base_optimizer.param_groups for p in g["params"]]
    return next(shard for p, shard in zip(params, shards, strict=True) if p is param)


# -- ZeRO-1 through the neuron backend and the checkpoint code ------------------------------------------------------


def test_neuron_zero1_trains_like_adamw_and_its_checkpoint_resumes_on_torch_at_dp1(monkeypatch, tmp_path):
    """The neuron backend under layout.zero1 at DP 2 (each DP rank simulated in turn by the stand-in): its optimizer
    is NxD's, the step is NxD's (reduce-scatter, norm, clip, update, gather), the weights follow torch AdamW, and
    each rank's checkpoint files hold its rows under the names and regions our own ZeRO-1 uses, so the run resumes
    on the cpu backend at DP 1 with every moment in place."""
    from trnrecipes.backends.torch import TorchBackend
    from trnrecipes.checkpoint.writer import HostBuffers, snapshot, write_files
    from trnrecipes.optim.adamw import AdamW, no_decay_params
    from trnrecipes.train.restore import restore_training_state

    recipe = load_recipe("neox-tiny", overrides=["optim.clip_grad_norm=0.05", "optim.warmup_steps=0"])
    tokens = torch.randint(0, recipe.model.vocab_size, (2, 17), generator=torch.Generator().manual_seed(3))
    lr, steps = 1e-3, 2

    reference = build_model(recipe.model)
    reference.init_weights(seed=recipe.train.seed)
    o = recipe.optim
    groups = zero1_param_groups(list(reference.parameters()), no_decay_params(reference, o.decay_norms_and_biases))
    ref_opt = torch.optim.AdamW(groups, lr=lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    for _ in range(steps):
        reference(tokens[:, :-1], labels=tokens[:, 1:]).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), o.clip_grad_norm)
        ref_opt.step()
        ref_opt.zero_grad()

    ranks = []
    for dp_rank in (0, 1):
        install_fake_nxd(monkeypatch, dp=2, dp_rank=dp_rank)
        dims = stand_in_dims(dp=2, dp_rank=dp_rank, world=2, rank=dp_rank, zero1=True)
        backend = NeuronXlaBackend("neuron", torch.device("cpu"))
        model = build_model_shard(recipe, dims=dims, backend=backend)
        opt = backend.make_optimizer(model, recipe, dims)
        assert isinstance(opt, Zero1Optimizer)
        ranks.append((dims, backend, model, opt))
    for _ in range(steps):
        for dims, backend, model, opt in ranks:
            model(tokens[:, :-1], labels=tokens[:, 1:]).backward()
            opt.set_lr(lr)
            norm = backend.step(model, opt, dims, o.clip_grad_norm)
            opt.zero_grad()
            assert norm.shape == ()
        # The stand-in updates this rank's rows only; the real all-gather brings the others': do it between them.
        with torch.no_grad():
            for mine, theirs in ((ranks[0], ranks[1]), (ranks[1], ranks[0])):
                for p, q in zip(mine[2].parameters(), theirs[2].parameters(), strict=True):
                    start, stop = zero1_rows(p.shape[0], 2, mine[0].dp_rank)
                    q[start:stop] = p[start:stop]
    ckpt = tmp_path / "step_2"
    for dims, backend, model, opt in ranks:
        assert opt.steps() == steps
        for (name, p), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
            assert torch.allclose(p, ref, rtol=1e-6, atol=1e-7), name
        files = snapshot(model, opt, dims, steps, None, recipe, HostBuffers(), num_docs=7, shard_dim=backend.shard_dim)
        assert ("optim-tp00-of-01-dp0001-of-0002.safetensors" in files) == (dims.dp_rank == 1)
        ckpt.mkdir(exist_ok=True)
        write_files(ckpt, files)

    # Resume on the torch backend at DP 1 (our AdamW, no ZeRO-1): every row of every moment comes from the rank
    # that held it, and the step count carries over.
    dims1 = stand_in_dims()
    cpu = TorchBackend("cpu", torch.device("cpu"))
    model1 = build_model_shard(recipe, dims=dims1, backend=cpu)
    opt1 = AdamW(list(model1.parameters()), recipe.optim)
    restore_training_state(
        ckpt,
        model1,
        opt1,
        dims1,
        lambda *a: None,
        num_docs=7,
        allowed=("layout.dp",),
        shard_dim=cpu.shard_dim,
    )
    assert opt1.steps() == steps
    ref_state = [ref_opt.state[p] for p in reference.parameters()]
    for i, (name, _) in enumerate(model1.named_parameters()):
        assert torch.allclose(opt1.exp_avg[i], ref_state[i]["exp_avg"], rtol=1e-5, atol=1e-9), name
        assert torch.allclose(opt1.exp_avg_sq[i], ref_state[i]["exp_avg_sq"], rtol=1e-5, atol=1e-12), name
