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
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from trnrecipes.parallel import family_plan, require_divisible_sequence


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
    for i in range(len(model.layers)):
        for kind, names in (("column", plan.COLUMN_PARALLEL), ("row", plan.ROW_PARALLEL)):
            for name in names:
                full = f"layers.{i}.{name}"
                linear = model.get_submodule(full)
                specs.append(LinearSpec(full, kind, linear.in_features, linear.out_features, linear.bias is not None))
    return specs


def sequence_parallel_params(model: nn.Module, family: str) -> list[str]:
    """Names of the parameters that sequence parallelism replicates but feeds only a sequence shard: every norm's
    (each layer's plan.NORMS and the final `norm`). The row-parallel biases NxD tags itself."""
    plan = family_plan(family)
    norms = [f"layers.{i}.{name}" for i in range(len(model.layers)) for name in plan.NORMS] + ["norm"]
    return [f"{norm}.{p}" for norm in norms for p, _ in model.get_submodule(norm).named_parameters()]


def _keep_uninitialized(weight: torch.Tensor) -> None:
    """NxD layers' init_method: their weights are overwritten with our shards right after construction."""


def apply_neuron_tensor_parallel(model: nn.Module, family: str, sequence_parallel: bool = False) -> nn.Module:
    """Replace the model's linears/embedding/head with NxD layers, each allocating only this rank's shard, left
    unfilled: the model is built on the meta device and trnrecipes.train.build fills every parameter afterwards
    (initialised or read from a checkpoint, by the shard's place in the full tensor: its partition_dim).
    Call after neuronx_distributed.parallel_layers.parallel_state.initialize_model_parallel(tp)."""
    try:
        from neuronx_distributed.parallel_layers import layers, mappings, parallel_state
    except ImportError as err:  # PyPI's neuronx-distributed is a placeholder that fails on import as well
        raise RuntimeError(
            "the neuron backend needs neuronx-distributed from the Neuron SDK (a Trainium host with the Neuron"
            " repository configured); it is not installable here. Use backend cpu, cuda or xla elsewhere."
        ) from err
    tp = parallel_state.get_tensor_model_parallel_size()
    family_plan(family).check_tensor_parallel(model.args, tp)
    # Under SP only the row-parallel linears use NxD's sequence-parallel mode (reduce-scatter of the output along the
    # sequence); see the hooks below for the gathers.
    sp = {"sequence_parallel_enabled": True, "sequence_dimension": 1} if sequence_parallel else {}

    def layer_args(dtype: torch.dtype) -> dict:
        # reduce_dtype = the weights' dtype: NxD all-reduces the input gradient in reduce_dtype, and when that differs
        # (its default fp32 vs bf16 weights) it reduces a converted copy and returns the unreduced original
        # (layers_utils._linear_autograd_bwd_grad_reduce, NxD 2.29). The no-op init skips filling weights that are
        # filled right after.
        return {"dtype": dtype, "reduce_dtype": dtype, "init_method": _keep_uninitialized}

    for spec in linear_specs(model, family):
        dtype = model.get_submodule(spec.name).weight.dtype
        if spec.kind == "column":
            new = layers.ColumnParallelLinear(
                spec.in_features, spec.out_features, bias=spec.bias, gather_output=False, **layer_args(dtype)
            )
        else:
            new = layers.RowParallelLinear(
                spec.in_features, spec.out_features, bias=spec.bias, input_is_parallel=True, **layer_args(dtype), **sp
            )
        model.set_submodule(spec.name, new)
    model.embed = layers.ParallelEmbedding(
        model.embed.num_embeddings,
        model.embed.embedding_dim,
        dtype=model.embed.weight.dtype,
        init_method=_keep_uninitialized,
    )
    model.head = layers.ColumnParallelLinear(
        model.head.in_features,
        model.head.out_features,
        bias=False,
        gather_output=True,
        **layer_args(model.head.weight.dtype),
    )
    if sequence_parallel:
        params = dict(model.named_parameters())
        for name in sequence_parallel_params(model, family):
            params[name].sequence_parallel_enabled = True
        require_divisible_sequence(model, tp)
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
        for i in range(len(model.layers)):
            for name in plan.BRANCHES:
                model.get_submodule(f"layers.{i}.{name}").register_forward_pre_hook(gather_sequence)
        model.head.register_forward_pre_hook(gather_sequence)
    return model


# ---- what the step loop needs on Neuron besides the layers (trnrecipes.train.loop calls these on backend neuron)


def move_to_device(model: nn.Module, device: torch.device) -> None:
    """model.to(device) that keeps NxD's parameter attributes (tensor_model_parallel, partition_dim, our
    sequence_parallel_enabled tags): moving to an XLA device otherwise makes new Parameters without them, and
    clip_grad_norm and reduce_sequence_parallel_gradients would silently treat every shard as replicated."""
    from neuronx_distributed.utils.model_utils import move_model_to_device

    move_model_to_device(model, device)


def initialize(tp: int, dp: int) -> tuple[int, int]:
    """NxD's process groups (after init_process_group("xla")); returns this rank's (TP rank, DP rank) in them.

    NxD decides which ranks form a TP group (consecutive on trn1 at TP 8 and 32, strided by 8 at TP 4), so the
    caller must use these ranks, not rank % tp."""
    from neuronx_distributed.parallel_layers import parallel_state

    # Logical NeuronCore size (trn2 runs LNC=2): NxD orders TP groups differently for it. Passed only when set, as
    # NxD releases before trn2 have no such argument.
    lnc = int(os.environ.get("NEURON_LOGICAL_NC_CONFIG", "1"))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, **({"lnc_size": lnc} if lnc != 1 else {}))
    if parallel_state.get_data_parallel_size() != dp:
        raise RuntimeError(f"neuronx-distributed made {parallel_state.get_data_parallel_size()} DP groups, not {dp}")
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_data_parallel_rank()


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


def param_norm(params: list[nn.Parameter]) -> torch.Tensor:
    """L2 norm of the whole model's parameters (a logged metric): NxD-sharded ones summed over the TP group,
    replicated ones counted once. NxD shards are plain tensors, so full_tensor() cannot gather them."""
    from neuronx_distributed.parallel_layers.mappings import reduce_from_tensor_model_parallel_region

    sharded = replicated = torch.zeros((), dtype=torch.float32, device=params[0].device)
    for p in params:
        square = p.detach().float().pow(2).sum()
        if getattr(p, "tensor_model_parallel", False):
            sharded = sharded + square
        else:
            replicated = replicated + square
    return (reduce_from_tensor_model_parallel_region(sharded) + replicated).sqrt()


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Global grad norm over TP shards (replicated parameters counted once) and clipping; NxD's own, since its
    sharded parameters are plain tensors tagged `tensor_model_parallel` rather than DTensors."""
    from neuronx_distributed.parallel_layers.grads import clip_grad_norm as nxd_clip_grad_norm

    return nxd_clip_grad_norm(params, max_norm if max_norm > 0 else float("inf"))
