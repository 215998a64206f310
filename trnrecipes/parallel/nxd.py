"""Tensor parallelism on Trainium: the family plans of recipes/<family>/parallelize.py mapped onto
neuronx-distributed's layers (ColumnParallelLinear, RowParallelLinear, ParallelEmbedding).

Written against neuronx-distributed's public API (neuronx_distributed.parallel_layers); the Neuron SDK installs only
on Trainium hosts, so this has not run here. `linear_specs` (what gets replaced, with which shapes) and
`sequence_parallel_params` (what sequence parallelism tags) are pure and tested; the import guard is tested.

Sequence parallelism (Megatron style, the sequence dim is 1 in our [batch, seq, hidden] layout): the residual stream
between the branches holds 1/TP of the sequence, and norms run on those shards. Hooks do the layout changes, so the
model code and its parameter names stay as they are: the embedding's output is scattered along the sequence
(scatter_to_sequence_parallel_region), and each attention/MLP branch and the head all-gather their input along the
sequence first (gather_from_sequence_parallel_region) because the model reads the sequence length from the branch
input (the role of PrepareModuleInput in the DTensor plan). The row-parallel linears reduce-scatter their output
back onto the shards (NxD's sequence_parallel_enabled, sequence_dimension=1). The norms' parameters and the
row-parallel biases see only their shard's gradient: they are tagged `sequence_parallel_enabled` and summed over
the TP group after backward (reduce_sequence_parallel_gradients).

ZeRO-1 (optimizer states sharded over the data-parallel group) runs through NxD's zero-1 optimizer: see the section
after the step helpers (make_zero1_optimizer, zero1_moments). Pipeline parallelism runs through NxD's NxDPPModel in
manual-partition mode (Neuron SDK 2.22+): trnrecipes/parallel/nxd_pipeline.py, which uses the groups initialize() makes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from recipes.common.loss import IGNORE_INDEX
from trnrecipes.parallel.sharding import chunk_range
from trnrecipes.parallel.tensor import family_plan, layer_ids, require_divisible_sequence


@dataclass(frozen=True)
class LinearSpec:
    name: str  # module path, e.g. layers.0.attn.qkv
    kind: str  # "column" (output features split) or "row" (input features split)
    in_features: int
    out_features: int
    bias: bool


def linear_specs(model: nn.Module, family: str) -> list[LinearSpec]:
    plan = family_plan(family)
    specs = []
    for i in layer_ids(model):
        for kind, names in (("column", plan.COLUMN_PARALLEL), ("row", plan.ROW_PARALLEL)):
            for name in names:
                full = f"layers.{i}.{name}"
                linear = model.get_submodule(full)
                specs.append(LinearSpec(full, kind, linear.in_features, linear.out_features, linear.bias is not None))
    return specs


def sequence_parallel_params(model: nn.Module, family: str) -> list[str]:
    """Names of the parameters that sequence parallelism replicates but feeds only a sequence shard: every norm's
    (each layer's plan.NORMS and the final `norm`, on the pipeline stage that holds it). The row-parallel biases
    NxD tags itself."""
    plan = family_plan(family)
    norms = [f"layers.{i}.{name}" for i in layer_ids(model) for name in plan.NORMS]
    norms += ["norm"] if hasattr(model, "norm") else []
    return [f"{norm}.{p}" for norm in norms for p, _ in model.get_submodule(norm).named_parameters()]


# The ambient device NxD's layers are built under. On meta none of them runs its host init: ColumnParallelLinear and
# RowParallelLinear (device=None takes the ambient device) and GQAQKVColumnParallelLinear skip it for a meta weight;
# ParallelEmbedding allocates with no device argument at all, so only the ambient meta device (not device=meta)
# spares it. That init (layers.py _initialize_parameter_cpu; qkv_linear.py _initialize_affine_weight, NxD 0.10 to
# 0.17) allocates the whole unsharded weight in fp32, and a downcast copy, on every rank at once, to slice one shard
# out of it. trnrecipes.train.build then allocates each shard alone (the backend's materialize) and fills it.
NXD_LAYER_DEVICE = torch.device("meta")


def _keep_uninitialized(weight: torch.Tensor) -> None:
    """NxD layers' init_method: never called on meta; where a layer does run its host init, the values drawn would
    be overwritten by our shards right after construction."""


def _layer_args(dtype: torch.dtype) -> dict:
    """The keywords every NxD linear gets. reduce_dtype = the weights' dtype: NxD all-reduces the input gradient in
    reduce_dtype, and when that differs (its default fp32 vs bf16 weights) it reduces a converted copy and returns the
    unreduced original (layers_utils._linear_autograd_bwd_grad_reduce, NxD 2.29)."""
    return {"dtype": dtype, "reduce_dtype": dtype, "init_method": _keep_uninitialized}


def apply_neuron_tensor_parallel(model: nn.Module, family: str, sequence_parallel: bool = False) -> nn.Module:
    """Replace the model's linears/embedding/head with NxD layers, built on the meta device (NXD_LAYER_DEVICE): each
    describes this rank's shard and allocates nothing; trnrecipes.train.build materialises the shards and fills every
    parameter afterwards (initialised or read from a checkpoint, by the shard's place in the full tensor: its
    partition_dim). Call after neuronx_distributed.parallel_layers.parallel_state.initialize_model_parallel(tp)."""
    try:
        from neuronx_distributed.parallel_layers import layers, mappings, parallel_state
    except ImportError as err:  # PyPI's neuronx-distributed is a placeholder that fails on import as well
        raise RuntimeError(
            "the neuron backend needs neuronx-distributed from the Neuron SDK (a Trainium host with the Neuron"
            " repository configured); it is not installable here. Use backend cpu, cuda or xla elsewhere."
        ) from err
    tp = parallel_state.get_tensor_model_parallel_size()
    family_plan(family).check_tensor_parallel(model.args, tp)
    kv_heads = getattr(model.args, "num_kv_heads", None)
    replicated = kv_heads is not None and tp > kv_heads  # TP wider than the KV heads: NxD's GQA QKV layer
    # Under SP only the row-parallel linears use NxD's sequence-parallel mode (reduce-scatter of the output along the
    # sequence); see the hooks below for the gathers.
    sp = {"sequence_parallel_enabled": True, "sequence_dimension": 1} if sequence_parallel else {}
    # A pipeline stage (trnrecipes.parallel.pipeline.StagedModel) holds the embedding on the first stage, the head last.
    has_embed, has_head = hasattr(model, "embed"), hasattr(model, "head")
    with torch.device(NXD_LAYER_DEVICE):
        for spec in linear_specs(model, family):
            dtype = model.get_submodule(spec.name).weight.dtype
            if replicated and spec.name.endswith(".attn.qkv"):
                attn = model.get_submodule(spec.name.removesuffix(".qkv"))
                attn.qkv = replicated_qkv(model.args, tp, dtype)
                attn.q_per_kv = model.args.num_heads // tp
                continue
            if spec.kind == "column":
                new = layers.ColumnParallelLinear(
                    spec.in_features, spec.out_features, bias=spec.bias, gather_output=False, **_layer_args(dtype)
                )
            else:
                new = layers.RowParallelLinear(
                    spec.in_features,
                    spec.out_features,
                    bias=spec.bias,
                    input_is_parallel=True,
                    **_layer_args(dtype),
                    **sp,
                )
            model.set_submodule(spec.name, new)
        if has_embed:
            model.embed = layers.ParallelEmbedding(
                model.embed.num_embeddings,
                model.embed.embedding_dim,
                dtype=model.embed.weight.dtype,
                init_method=_keep_uninitialized,
            )
        if has_head:
            model.head = layers.ColumnParallelLinear(
                model.head.in_features,
                model.head.out_features,
                bias=False,
                gather_output=False,  # the logits stay on the vocabulary shards: nxd_head_loss
                **_layer_args(model.head.weight.dtype),
            )
    if replicated:  # NxD's tiled KV copies move each rank's query heads: its o_proj columns move with them
        from trnrecipes.parallel.kv_replication import OUT_ATTRIBUTE

        for i in layer_ids(model):
            attn = model.get_submodule(f"layers.{i}.attn")
            setattr(attn.out, OUT_ATTRIBUTE, attn.qkv.kv_replication)
    model.head_loss = nxd_head_loss  # each rank's head holds one vocabulary shard, and so do its logits
    if sequence_parallel:
        params = dict(model.named_parameters())
        for name in sequence_parallel_params(model, family):
            params[name].sequence_parallel_enabled = True
        require_divisible_sequence(model, tp)
        if has_embed:
            # the embedding's output (complete on every rank) -> this rank's sequence shard; backward all-gathers
            model.embed.register_forward_hook(
                lambda _m, _i, out: mappings.scatter_to_sequence_parallel_region(out, sequence_dimension=1)
            )

        def gather_sequence(_module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
            # Forward all-gather along the sequence; backward keeps this rank's slice (to_model_parallel=False)
            # because the plain column-parallel linear behind it already all-reduces its input gradient.
            full = mappings.gather_from_sequence_parallel_region(args[0], sequence_dimension=1, to_model_parallel=False)
            return (full, *args[1:])

        # Each attention/MLP branch (and the head) sees the whole sequence, as the model code assumes (it reads the
        # sequence length from its input): DTensor's PrepareModuleInput does the same off Neuron.
        plan = family_plan(family)
        for i in layer_ids(model):
            for name in plan.BRANCHES:
                model.get_submodule(f"layers.{i}.{name}").register_forward_pre_hook(gather_sequence)
        if has_head:
            model.head.register_forward_pre_hook(gather_sequence)
    return model


def nxd_head_loss(head: nn.Module, x: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX):
    """The mean loss over labels != ignore_index from the head's vocabulary shard of the logits [b, s, V / tp]
    (gather_output=False), by NxD's vocab-parallel cross-entropy: no rank holds the whole vocabulary's logits, but
    each holds the micro-batch's [b x s, V / tp] in fp32, unchunked (the DTensor path chunks them).

    neuronx_distributed.parallel_layers.loss_functions.parallel_cross_entropy(vocab_parallel_logits, target,
    label_smoothing=0.0), the same file at NxD 0.10 to 0.17 (Neuron SDK 2.21 to 2.28): Megatron's, one loss per
    token, no ignore_index (an ignored row gets its log-sum-exp as loss and the softmax as gradient), and it shifts
    the logits in place. So the labels are masked to 0 (NxD's own masking would also cope with -100) and the
    ignored rows zeroed here, their gradient with them. The logits go in as fp32 (softmax and loss in fp32, as
    fused_head_loss): a copy of bf16 ones; the in-place shift is harmless either way, the head's backward keeps its
    input and weight, not its output. model(tokens) without labels returns this rank's shard too: training always
    passes labels, and inference runs a plain model."""
    from neuronx_distributed.parallel_layers.loss_functions import parallel_cross_entropy

    logits = head(x)
    valid = labels != ignore_index
    per_token = parallel_cross_entropy(logits.float(), labels.masked_fill(~valid, 0))
    return (per_token * valid).sum() / valid.sum().clamp_min(1)  # a tensor, no .item(): no host sync under XLA


def replicated_qkv(args, tp: int, dtype: torch.dtype) -> nn.Module:
    """An attention's qkv for TP wider than the KV heads: NxD's GQAQKVColumnParallelLinear with kv_size_multiplier
    tp / num_kv_heads (neuronx-distributed 2.29, src/neuronx_distributed/modules/qkv_linear.py), as AWS's Llama 3
    examples build it (fuse_qkv, kv_replicator = tp / 8). Each rank holds H / tp query heads and one copy of one KV
    head in one fused weight [q | k | v], our model's fused layout for one local KV group, so the layer is wrapped
    only to return that one output and to name its weight `weight` (parameter names and checkpoints stay the plain
    model's). NxD sums the copies' gradients over their group in the layer's backward and, on trn1, tiles the copies
    over the ranks (rank t: KV head t % kv), so rank t's query heads are block (t % kv) * r + t // kv, not t: the
    build fills qkv and o_proj (marked by apply_neuron_tensor_parallel) with that block, and checkpoints record it
    (trnrecipes/parallel/kv_replication.py)."""
    from neuronx_distributed.modules.qkv_linear import GQAQKVColumnParallelLinear
    from neuronx_distributed.parallel_layers.utils import set_tensor_model_parallel_attributes

    from trnrecipes.parallel.kv_replication import ATTRIBUTE, KVReplication

    class FusedQKV(GQAQKVColumnParallelLinear):
        @property
        def weight_qkv(self) -> nn.Parameter:
            # NxD's code reads its fused weight by this name; it is registered as `weight` once built (below)
            for name in ("weight", "weight_qkv"):
                if self._parameters.get(name) is not None:
                    return self._parameters[name]
            raise AttributeError("weight_qkv")  # while NxD's __init__ registers it (register_parameter's hasattr)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.cat(super().forward(x), dim=-1)

    hd, kv = args.head_dim, args.num_kv_heads
    with torch.device(NXD_LAYER_DEVICE):  # no host init (its _initialize_affine_weight): see NXD_LAYER_DEVICE
        layer = FusedQKV(
            args.hidden_size,
            [args.num_heads * hd, kv * hd],
            bias=False,
            gather_output=False,
            kv_size_multiplier=tp // kv,
            fuse_qkv=True,
            **_layer_args(dtype),
        )
    layer._parameters["weight"] = layer._parameters.pop("weight_qkv")
    if not getattr(layer.weight, "tensor_model_parallel", False):
        # NxD leaves the fused weight untagged: on meta it skips _initialize_affine_weight, which tags the q/k/v
        # views, and initialize_weight_biases replaces the fused weight by a new Parameter (torch.cat of the views)
        # anyway (NxD 0.10 to 0.17). Untagged, its clip_grad_norm would count it on TP rank 0 only and shard_dim
        # would be None.
        set_tensor_model_parallel_attributes(layer.weight, True, 0, 1, num_partitions=tp)
    layout = KVReplication(kv, tp // kv, args.num_heads // kv, hd, interleaved=True)
    check_kv_groups(layout)
    setattr(layer, ATTRIBUTE, layout)
    return layer


def check_kv_groups(layout) -> None:
    """Refuse to train unless NxD's KV-shared groups (the ranks whose k/v gradients its layer sums) are the ranks
    our mapping gives each KV head's copies (trn1's tiled order), in every TP group: else the gradients of different
    heads would be summed, silently."""
    from neuronx_distributed.parallel_layers import parallel_state

    expected = {frozenset(t for t in range(layout.tp) if layout.place(t)[0] == g) for g in range(layout.kv_heads)}
    tp_groups = parallel_state.get_tensor_model_parallel_replica_groups()
    shared = [set(g) for g in parallel_state.get_kv_shared_group(as_list=True)]
    for tp_group in tp_groups:
        found = {frozenset(tp_group.index(r) for r in g) for g in shared if g <= set(tp_group)}
        if found != expected:
            raise RuntimeError(
                f"neuronx-distributed shares KV heads among TP ranks {sorted(map(sorted, found))}, not the tiled order"
                f" {sorted(map(sorted, expected))} this build maps checkpoints by (trn1's): not supported on this"
                " platform or NxD version; use a layout.tp that divides model.num_kv_heads"
            )


# ---- what the step needs on Neuron besides the layers (the neuron backend, trnrecipes/backends/neuron_xla.py)


def move_to_device(model: nn.Module, device: torch.device) -> None:
    """model.to(device) that keeps NxD's parameter attributes (tensor_model_parallel, partition_dim, our
    sequence_parallel_enabled tags): moving to an XLA device otherwise makes new Parameters without them, and
    clip_grad_norm and reduce_sequence_parallel_gradients would silently treat every shard as replicated."""
    from neuronx_distributed.utils.model_utils import move_model_to_device

    move_model_to_device(model, device)


def initialize(tp: int, dp: int, pp: int = 1) -> tuple[int, int, int]:
    """NxD's process groups (after init_process_group("xla")); returns this rank's (PP rank, DP rank, TP rank) in
    them.

    NxD decides which ranks form a TP group (consecutive on trn1 at TP 8 and 32, strided by 8 at TP 4) and, with
    its ring layouts, which place a rank has in its PP group (parallel_state.get_pipeline_model_parallel_rank
    searches the replica groups under LOGIC2), so the caller must use these ranks, not rank % tp or rank // (dp * tp):
    the stages a rank builds must be the ones NxD's pipeline runs on it."""
    from neuronx_distributed.parallel_layers import parallel_state

    # Logical NeuronCore size (trn2 runs LNC=2): NxD orders TP groups differently for it. Passed only when set, as
    # NxD releases before trn2 have no such argument.
    lnc = int(os.environ.get("NEURON_LOGICAL_NC_CONFIG", "1"))
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, **({"lnc_size": lnc} if lnc != 1 else {})
    )
    if parallel_state.get_data_parallel_size() != dp:
        raise RuntimeError(f"neuronx-distributed made {parallel_state.get_data_parallel_size()} DP groups, not {dp}")
    pp_rank = 0
    if pp > 1:
        if (made := parallel_state.get_pipeline_model_parallel_size()) != pp:
            raise RuntimeError(f"neuronx-distributed made pipeline groups of {made} ranks, not {pp}")
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    return pp_rank, parallel_state.get_data_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()


def pipeline_group():
    """NxD's process group over this rank's pipeline stages (same DP and TP rank)."""
    from neuronx_distributed.parallel_layers import parallel_state

    return parallel_state.get_pipeline_model_parallel_group()


def average_gradients_over_dp(params: list[nn.Parameter]) -> None:
    """Bucketed all-reduce of the gradients over the DATA-parallel group, scaled by 1 / DP size (not the world)."""
    from neuronx_distributed.parallel_layers.grads import bucket_allreduce_gradients

    bucket_allreduce_gradients([p.grad for p in params if p.grad is not None])


def reduce_sequence_parallel_gradients(params: list[nn.Parameter]) -> None:
    """Sum over the TP group the gradients of parameters tagged `sequence_parallel_enabled` (norms, row-parallel
    biases), in place, as NxD's allreduce_sequence_parallel_gradients does for a torch optimizer's params."""
    from neuronx_distributed.parallel_layers.mappings import reduce_from_tensor_model_parallel_region

    for p in params:
        if getattr(p, "sequence_parallel_enabled", False) and p.grad is not None:
            reduce_from_tensor_model_parallel_region(p.grad.data)


def param_norm(params: list[nn.Parameter], over_pipeline: bool = False) -> torch.Tensor:
    """L2 norm of the whole model's parameters (a logged metric): NxD-sharded ones summed over the TP group,
    replicated ones counted once; with `over_pipeline`, the squares summed over the pipeline stages too (each holds
    other parameters; none is shared between stages in our families), as NxD's get_grad_norm sums grad norms over
    its PP group. NxD shards are plain tensors, so full_tensor() cannot gather them."""
    from neuronx_distributed.parallel_layers.mappings import reduce_from_tensor_model_parallel_region

    sharded = replicated = torch.zeros((), dtype=torch.float32, device=params[0].device)
    for p in params:
        square = p.detach().float().pow(2).sum()
        if getattr(p, "tensor_model_parallel", False):
            sharded = sharded + square
        else:
            replicated = replicated + square
    squares = reduce_from_tensor_model_parallel_region(sharded) + replicated
    if over_pipeline:
        torch.distributed.all_reduce(squares, group=pipeline_group())
    return squares.sqrt()


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Global grad norm over TP shards (replicated parameters counted once) and clipping; NxD's own, since its
    sharded parameters are plain tensors tagged `tensor_model_parallel` rather than DTensors."""
    from neuronx_distributed.parallel_layers.grads import clip_grad_norm as nxd_clip_grad_norm

    return nxd_clip_grad_norm(params, max_norm if max_norm > 0 else float("inf"))


# ---- ZeRO-1 on Neuron: NxD's zero-1 optimizer (optimizer states sharded over the data-parallel group)
#
# Written against neuronx_distributed/optimizer/zero_redundancy_optimizer.py (NeuronZero1Optimizer, the same file
# from NxD 2.26 to 2.29, aws-neuron/neuronx-distributed fbac349) and the class it extends, torch-xla's
# torch_xla/distributed/zero_redundancy_optimizer.py (ZeroRedundancyOptimizer, the same file from v2.8.0 to v2.9.0,
# pytorch/xla 5fab7053). NeuronZero1Optimizer passes its arguments through to ZeroRedundancyOptimizer, defaults
# sharding_groups to NxD's DP replica groups and computes the grad norm with NxD's get_grad_norm. What it does:
# - construction: each parameter (this TP rank's local tensor, on the XLA device) is copied, padded with zero rows
#   to a multiple of the sharding group size along dim 0 and chunked along dim 0; this DP rank's chunk, cast to
#   optimizer_dtype (an fp32 master copy when the weights are bf16), is the parameter of the base optimizer
#   (`base_optimizer`, built as optimizer_class(sharded param groups, **defaults)). The copy is taken then: build
#   the optimizer after the weights are filled and on the device.
# - step(): param_groups are synced into base_optimizer (so lr set on optimizer.param_groups applies); each
#   gradient is padded and reduce-scattered over the sharding group with scale 1/DP (the DP mean: no all-reduce of
#   our own before it); with grad_clipping, the norm of the shards' gradients summed over the TP group (replicated
#   parameters counted once), the pipeline group and the sharding group is kept as `optimizer.grad_norm` (a
#   1-element tensor, before clipping) and the shard gradients are scaled by max_norm / (norm + 1e-6) where that is
#   < 1 (torch.nn.utils.clip_grad_norm_'s rule); base_optimizer.step() updates the shards; they are all-gathered
#   over the sharding group and copied, cast to the weights' dtype, into the parameters in place.
# - it does not reduce sequence-parallel gradients: NxD's own NxDOptimizer.step runs
#   allreduce_sequence_parallel_gradients before calling it, and so must we (reduce_sequence_parallel_gradients).
# - state: base_optimizer.state[shard] is torch.optim.AdamW's {"step", "exp_avg", "exp_avg_sq"} of the padded shard
#   ("step" a CPU scalar tensor per parameter), created lazily at the first step.
# How AWS builds it: neuronx_distributed/trainer/trainer.py (initialize_optimizer_from_class, zero_one_enabled)
# passes sharding_groups=get_data_parallel_replica_groups(), grad_norm_groups=get_tensor_model_parallel_replica_
# groups(), pin_layout=False and, on torch >= 2.2, bucketed collectives (130 MB reduce-scatter buckets, 130 / DP MB
# all-gather buckets; ALL_GATHER_REDUCE_SCATTER_BUCKET_CAP_MB overrides); the examples' param groups are
# [{"params": decayed, "weight_decay": wd}, {"params": others, "weight_decay": 0.0}]. (grad_norm_groups is read only
# by torch-xla's own norm, which NeuronZero1Optimizer replaces; passed as AWS does.)

_NXD_MISSING = (
    "the neuron backend needs neuronx-distributed from the Neuron SDK (a Trainium host with the Neuron repository"
    " configured); it is not installable here. Use backend cpu, cuda or xla elsewhere."
)
# AWS's default bucket for the coalesced reduce-scatter / all-gather of zero-1 ("Bucket cap >140MB causes NaN at
# step 3 (known issue)", trainer.py)
ZERO1_BUCKET_CAP_MB = 130


def zero1_param_groups(params: list[nn.Parameter], no_decay: set[int]) -> list[dict]:
    """The trained parameters as torch param groups: weight-decayed ones, then those in `no_decay` (id()s, as for
    trnrecipes.optim.adamw.AdamW) with weight_decay 0. An empty group is left out."""
    trained = [p for p in params if p.requires_grad]
    groups = [
        {"params": [p for p in trained if id(p) not in no_decay]},
        {"params": [p for p in trained if id(p) in no_decay], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def make_zero1_optimizer(
    param_groups: list[dict],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    max_norm: float,
):
    """NxD's NeuronZero1Optimizer over torch.optim.AdamW, built as NxD's trainer builds it (DP replica groups shard
    the states, TP replica groups for the norm, unpinned layouts, bucketed collectives), with fp32 states.

    Clipping stays on whatever max_norm is: the optimizer computes the grad norm only when it clips, and the step
    loop logs it. max_norm <= 0 (no clipping) becomes inf, whose coefficient is 1.
    Call after initialize(), with the model's weights filled and on the XLA device (the shards are copied here)."""
    try:
        from neuronx_distributed.optimizer import NeuronZero1Optimizer
        from neuronx_distributed.parallel_layers import parallel_state
    except ImportError as err:
        raise RuntimeError(_NXD_MISSING) from err
    dp = parallel_state.get_data_parallel_size()
    bucket = int(os.environ.get("ALL_GATHER_REDUCE_SCATTER_BUCKET_CAP_MB", ZERO1_BUCKET_CAP_MB))
    return NeuronZero1Optimizer(
        [g for g in param_groups if g["params"]],
        torch.optim.AdamW,
        optimizer_dtype=torch.float32,
        grad_clipping=True,
        max_norm=max_norm if max_norm > 0 else float("inf"),
        pin_layout=False,
        sharding_groups=parallel_state.get_data_parallel_replica_groups(),
        grad_norm_groups=parallel_state.get_tensor_model_parallel_replica_groups(),
        bucket_cap_mb_all_gather=max(1, bucket // dp),
        bucket_cap_mb_reduce_scatter=bucket,
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
    )


def zero1_rows(local_rows: int, dp: int, dp_rank: int) -> tuple[int, int]:
    """[start, stop) of the dim-0 rows of a TP-local parameter whose optimizer state DP rank `dp_rank` holds.

    torch-xla pads dim 0 with zero rows to a multiple of dp and takes chunk dp_rank of dp: every chunk has
    ceil(rows / dp) rows, and chunk i covers real rows [i * c, (i + 1) * c) cut at `rows`, which is torch.chunk's
    split of the unpadded rows (trnrecipes.parallel.sharding.chunk_range, the rule the checkpoint files use). Trailing
    ranks may hold only padding (an empty range)."""
    return chunk_range(local_rows, dp, dp_rank)


def zero1_rank(optimizer) -> tuple[int, int]:
    """(sharding group size, this rank's place in it) as the optimizer sharded: the DP size and rank that its rows
    follow (check them against the ranks the checkpoint files are named by)."""
    return optimizer.local_world_size, optimizer.local_rank


@dataclass(frozen=True)
class Zero1Slice:
    """One trained parameter's part of this rank's ZeRO-1 state. The tensors are views (padding rows cut off) into
    the optimizer's own: read them to save, copy_ into them to restore."""

    param: nn.Parameter  # the model's (TP-local) parameter
    rows: tuple[int, int]  # [start, stop) of its dim 0 that the views cover
    exp_avg: torch.Tensor  # fp32, shape (stop - start, *param.shape[1:])
    exp_avg_sq: torch.Tensor
    master: torch.Tensor  # the optimizer's fp32 copy of those rows (finer than bf16 weights; rebuilt from them)


def _zero1_pairs(optimizer):
    for group, shard_group in zip(optimizer.param_groups, optimizer.base_optimizer.param_groups, strict=True):
        yield from zip(group["params"], shard_group["params"], strict=True)


def _zero1_state(optimizer, shard: torch.Tensor) -> dict:
    """The base AdamW's state of a shard, created as torch.optim.AdamW creates it at its first step (zero moments
    like the shard, a CPU step count; AdamW then uses what it finds) so that it can be filled before any step."""
    state = optimizer.base_optimizer.state[shard]
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(shard, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(shard, memory_format=torch.preserve_format)
    return state


def zero1_moments(optimizer) -> list[Zero1Slice]:
    """Per trained parameter (in the optimizer's order), this DP rank's rows of its AdamW moments: what a checkpoint
    saves as exp_avg.<name> / exp_avg_sq.<name> over region shard_region(full shape, tp dim, tp, tp rank, dp,
    dp rank), and what a restore fills (the states are created, zero, if no step has run yet)."""
    dp, rank = zero1_rank(optimizer)
    slices = []
    for param, shard in _zero1_pairs(optimizer):
        start, stop = zero1_rows(param.shape[0], dp, rank)
        state = _zero1_state(optimizer, shard)
        n = stop - start
        slices.append(Zero1Slice(param, (start, stop), state["exp_avg"][:n], state["exp_avg_sq"][:n], shard.data[:n]))
    return slices


def load_zero1_moments(optimizer, moments: list[dict[str, torch.Tensor]], steps: int) -> None:
    """Restore this rank's moments: moments[i] = {"exp_avg", "exp_avg_sq"} of zero1_moments(optimizer)[i]'s rows
    (any device, any float dtype), and the optimizer step count. (A reader that fills tensors in place can write
    into zero1_moments' views instead, then call set_zero1_step_count.)"""
    slices = zero1_moments(optimizer)
    if len(moments) != len(slices):
        raise ValueError(f"moments for {len(moments)} parameters, but the optimizer trains {len(slices)}")
    with torch.no_grad():
        for s, m in zip(slices, moments, strict=True):
            for key in ("exp_avg", "exp_avg_sq"):
                dest = getattr(s, key)
                if tuple(m[key].shape) != tuple(dest.shape):
                    raise ValueError(f"{key} of rows {s.rows}: {tuple(m[key].shape)}, expected {tuple(dest.shape)}")
                dest.copy_(m[key])
    set_zero1_step_count(optimizer, steps)


def zero1_step_count(optimizer) -> int:
    """Optimizer steps taken (AdamW keeps one count per parameter, a CPU tensor: reading it does not sync)."""
    counts = {int(optimizer.base_optimizer.state[shard]["step"]) if optimizer.base_optimizer.state[shard] else 0
              for _, shard in _zero1_pairs(optimizer)}  # fmt: skip
    if len(counts) != 1:
        raise RuntimeError(f"ZeRO-1 parameters disagree on the step count: {sorted(counts)}")
    return counts.pop()


def set_zero1_step_count(optimizer, steps: int) -> None:
    """Every parameter's AdamW step count (bias correction), e.g. on resume."""
    for _, shard in _zero1_pairs(optimizer):
        _zero1_state(optimizer, shard)["step"].fill_(float(steps))


def set_zero1_lr(optimizer, lr: float) -> None:
    """The learning rate of the next step(), which copies param_groups into the base optimizer. A Python float:
    torch-xla uploads non-0/1 scalars as device data, so a changing lr compiles no new graph."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def zero1_grad_norm(optimizer) -> torch.Tensor:
    """The global grad norm (all TP shards and DP slices, before clipping) computed by the last step(), a 0-dim
    device tensor."""
    norm = optimizer.grad_norm
    if norm is None:
        raise RuntimeError("the ZeRO-1 optimizer has no grad norm: it is computed by step() with grad_clipping on")
    return norm.reshape(())
