"""Trainium through torch-xla + neuronx-distributed (`neuron`, the trn1 stack up to Neuron SDK 2.28): NxD owns the
process groups and the tensor-parallel layers, and its own gradient reduction, clipping and norms count its shards
(plain tensors tagged `tensor_model_parallel`, not DTensors). Pipeline parallelism runs through NxD's NxDPPModel in
manual-partition mode (Neuron SDK 2.22+, 1F1B; trnrecipes.parallel.nxd_pipeline). The NxD calls live in
trnrecipes.parallel.nxd, written against AWS's public source and tested against a stand-in: the Neuron SDK
installs only on Trainium hosts."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from trnrecipes.backends.xla import XlaBackend
from trnrecipes.config.sections import RecipeError
from trnrecipes.parallel import nxd
from trnrecipes.parallel.nki_attention import apply_attention_kernel

if TYPE_CHECKING:
    from trnrecipes.config.sections import Recipe
    from trnrecipes.parallel.dims import ParallelDims


class NeuronXlaBackend(XlaBackend):
    supports_zero1 = True  # through NxD's zero-1 optimizer (Zero1Optimizer below)
    supports_pp = True  # through NxD's NxDPPModel, manual partition (SDK 2.22+): trnrecipes.parallel.nxd_pipeline
    rounds_stochastically = True  # NEURON_RT_STOCHASTIC_ROUNDING_EN, set by the scripts (trnrecipes.jobs.neuron_env)
    pjrt_device = "NEURON"
    host_batches = False  # set by `pipeline`: NxD's pipeline takes host tensors and uploads each micro-batch itself

    @classmethod
    def check_installed(cls) -> None:
        try:
            import neuronx_distributed  # noqa: F401  (the real package exists only on Trainium hosts)
        except Exception as err:  # the PyPI placeholder raises at import
            raise RecipeError(
                f"cluster.backend neuron needs neuronx-distributed from the Neuron repository ({err});"
                " off Trainium, run the same recipe with cluster.backend=xla"
            ) from None

    def init_process_groups(self, dims: ParallelDims) -> None:
        if not dist.is_initialized():
            dist.init_process_group("xla", init_method="xla://")
        # NxD owns the groups, and its TP groups are not always consecutive ranks (trn1 at TP 4 strides them by 8):
        # the data shard, checkpoint files and re-slicing must use NxD's ranks, or a TP group mixes batches. Likewise
        # the pipeline stage a rank builds must be the one NxD's pipeline runs on it (its PP rank).
        dims.pp_rank, dims.dp_rank, dims.tp_rank = nxd.initialize(dims.tp, dims.dp, dims.pp)
        if dims.pp > 1:
            dims.pp_group = nxd.pipeline_group()

    def pipeline(self, model: nn.Module, recipe: Recipe, dims: ParallelDims, micro_batches: int):
        """NxD's manual-partition pipeline over this rank's stage (1F1B; SDK 2.22+). It takes the micro-batches on the
        host and uploads them itself, so from now on `loader` leaves the training batches there. What NxD's pipeline
        cannot run (an SDK before 2.22, another schedule) the recipe check has refused (trnrecipes.config.stages)."""
        from trnrecipes.parallel.nxd_pipeline import NeuronPipeline

        self.host_batches = True
        return NeuronPipeline(model, micro_batches, pp=dims.pp, zero1=dims.zero1)

    def loader(self, batches: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
        if self.host_batches:
            return iter(batches)
        return super().loader(batches)

    def parallelize(self, model: nn.Module, recipe: Recipe, dims: ParallelDims) -> None:
        # model.attention: nki_flash runs here only (NxD's NKI kernel; the recipe check refuses it elsewhere). The
        # kernel is the CoreAttention's function, so selective checkpointing recomputes through it.
        apply_attention_kernel(model, getattr(recipe.model, "attention", "sdpa"))
        super().parallelize(model, recipe, dims)

    def tensor_parallel(self, model: nn.Module, recipe: Recipe, dims: ParallelDims) -> None:
        nxd.apply_neuron_tensor_parallel(model, recipe.model.family, recipe.layout.sequence_parallel)

    def materialize(self, model: nn.Module) -> None:
        # The NxD layers were built on meta (trnrecipes.parallel.nxd.NXD_LAYER_DEVICE), so every parameter, each
        # shard-sized, is allocated here, on the host. Not Module.to_empty: it would drop the attributes NxD sets on
        # its Parameters.
        materialize_meta(model, torch.device("cpu"))

    def to_device(self, model: nn.Module) -> None:
        nxd.move_to_device(model, self.device)  # keeps NxD's parameter attributes

    @staticmethod
    def shard_dim(p: torch.Tensor) -> int | None:
        return int(p.partition_dim) if getattr(p, "tensor_model_parallel", False) else None

    def make_optimizer(self, model: nn.Module, recipe: Recipe, dims: ParallelDims):
        """Our AdamW, or under ZeRO-1 NxD's zero-1 optimizer, built as AWS's trainer builds it. It copies each
        shard of the weights when built: load() builds it after the weights are filled and on the device."""
        if not dims.zero1:
            return super().make_optimizer(model, recipe, dims)
        from trnrecipes.optim.adamw import no_decay_params

        o = recipe.optim
        no_decay = no_decay_params(model, o.decay_norms_and_biases)
        groups = nxd.zero1_param_groups(list(model.parameters()), no_decay)
        optimizer = nxd.make_zero1_optimizer(
            groups, lr=0.0, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, max_norm=o.clip_grad_norm
        )
        if (sharded := nxd.zero1_rank(optimizer)) != (dims.dp, dims.dp_rank):
            # the checkpoint files are named by dims' DP rank; moments saved under another would be misplaced
            raise RuntimeError(
                f"NxD's zero-1 optimizer shards over (size, rank) {sharded}, not (DP, DP rank) {dims.dp, dims.dp_rank}"
            )
        return Zero1Optimizer(optimizer)

    def step(self, model: nn.Module, optimizer, dims: ParallelDims, max_norm: float) -> torch.Tensor:
        if not isinstance(optimizer, Zero1Optimizer):
            return super().step(model, optimizer, dims, max_norm)
        # NxD's zero-1 step reduce-scatters the gradients over DP (the mean), computes the global norm and clips;
        # the sequence-parallel gradients it leaves to its caller, as NxD's own trainer does.
        nxd.reduce_sequence_parallel_gradients([p for p in model.parameters() if p.requires_grad])
        optimizer.step()
        return optimizer.grad_norm()

    def reduce_and_clip(self, model: nn.Module, dims: ParallelDims, max_norm: float) -> torch.Tensor:
        params = [p for p in model.parameters() if p.requires_grad]
        nxd.reduce_sequence_parallel_gradients(params)  # only the tagged ones (SP norms, row biases)
        nxd.average_gradients_over_dp(params)
        return nxd.clip_grad_norm(params, max_norm)

    def param_norm(self, model: nn.Module, dims: ParallelDims) -> torch.Tensor:
        return nxd.param_norm(list(model.parameters()), over_pipeline=dims.pp > 1)


class Zero1Optimizer:
    """NxD's zero-1 optimizer seen as the step loop and the checkpoint code see our AdamW: the trained parameters,
    this rank's rows of their moments (views into NxD's state, padding cut off: a checkpoint saves them over the
    same regions as our own ZeRO-1, and a restore copies into them), the step count and the learning rate.

    Unlike our AdamW it keeps an fp32 master copy of bf16 weights (NxD's design); checkpoints hold the bf16 weights,
    so a resumed bf16 run rebuilds the masters from them (fp32 runs resume bitwise)."""

    rows = None  # NxD gathers the updated rows itself

    def __init__(self, optimizer):
        self.optimizer = optimizer  # NxD's zero-1 optimizer
        self.params = [s.param for s in nxd.zero1_moments(optimizer)]

    @property
    def exp_avg(self) -> list[torch.Tensor]:
        return [s.exp_avg for s in nxd.zero1_moments(self.optimizer)]

    @property
    def exp_avg_sq(self) -> list[torch.Tensor]:
        return [s.exp_avg_sq for s in nxd.zero1_moments(self.optimizer)]

    def set_lr(self, lr: float) -> None:
        nxd.set_zero1_lr(self.optimizer, lr)

    def step(self) -> None:
        self.optimizer.step()

    def grad_norm(self) -> torch.Tensor:
        return nxd.zero1_grad_norm(self.optimizer)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def steps(self) -> int:
        return nxd.zero1_step_count(self.optimizer)

    def set_steps(self, steps: int) -> None:
        nxd.set_zero1_step_count(self.optimizer, steps)


def materialize_meta(model: nn.Module, device: torch.device) -> None:
    """Give every parameter still on the meta device real (uninitialised) memory, keeping the attributes set on the
    Parameter (NxD's tensor_model_parallel, our sequence_parallel_enabled): Module.to_empty would drop them."""
    for module in model.modules():
        for key, p in list(module._parameters.items()):
            if p is not None and p.is_meta:
                new = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                new.__dict__.update(p.__dict__)
                module._parameters[key] = new
