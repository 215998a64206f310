"""The interface every backend implements: what the step loop, the sharded build and the checkpoint code ask of the
place they run. Adding a backend = one subclass answering these (docs/training.md: "Adding a backend").

A backend answers for:
- the device, the torch.distributed backend, and the process groups (`init_process_groups`);
- graphs and data: where a lazy graph ends (`sync`), a loader that feeds the device, the compile counter, the
  generators random ops draw from (`seed_rng`);
- the model: how it is parallelized (`parallelize`: the TP/SP plan, the loss path, activation checkpointing,
  torch.compile per block under train.compile), where
  its shards are materialised and moved (`materialize`, `to_device`), and where a shard lives in its parameter
  (`shard_dim`);
- the step: the optimizer (`make_optimizer`; ZeRO-1 where `supports_zero1`), gradient reduction, clipping and the
  optimizer step (`step` = `reduce_and_clip` + `optimizer_step` unless the optimizer does both), the parameter
  norm, and whether the hardware rounds bf16 stochastically itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from trnrecipes.parallel.activation_checkpointing import apply_activation_checkpointing
from trnrecipes.parallel.compile import compile_blocks
from trnrecipes.parallel.dims import local_tensor
from trnrecipes.parallel.expert import expert_layouts

if TYPE_CHECKING:
    from trnrecipes.config.sections import Recipe
    from trnrecipes.parallel.dims import ParallelDims


class Backend:
    name: str
    dist_backend: ClassVar[str] = "gloo"  # torch.distributed backend: gloo, nccl or xla
    # NCCL and XLA's process group reduce device tensors only; gloo takes CPU ones (metrics are reduced there).
    collectives_on_device: ClassVar[bool] = False
    supports_zero1: ClassVar[bool] = False  # can shard optimizer states over the DP group (layout.zero1)
    supports_pp: ClassVar[bool] = False  # can run pipeline parallelism (layout.pp > 1): `pipeline`
    no_pp_reason: ClassVar[str] = "not built for it"
    supports_cp: ClassVar[bool] = False  # can run context parallelism (layout.cp > 1): trnrecipes/parallel/context.py
    # The hardware rounds bf16 stochastically (Neuron's NEURON_RT_STOCHASTIC_ROUNDING_EN): our AdamW must not too.
    rounds_stochastically: ClassVar[bool] = False
    # torch.compile backend for train.compile (None: the backend compiles graphs its own way, e.g. XLA), and whether
    # train.compile left unset means on.
    compile_backend: ClassVar[str | None] = None
    compiles_by_default: ClassVar[bool] = False

    def __init__(self, name: str, device: torch.device):
        self.name, self.device = name, device

    # ------------------------------------------------------------------ graphs and data
    def sync(self) -> None:
        """Cut the lazy graph here and run it (XLA); nothing to do for eager backends."""

    def loader(self, batches: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
        """Batches on the device."""
        return (b.to(self.device, non_blocking=True) for b in batches)

    def seed_rng(self, seed: int) -> None:
        """Seed the default generators the model's random ops draw from (dropout; torch.compile's kernels take
        their seeds from them too): the host's and every accelerator torch knows (CUDA, a PrivateUse1 device such as
        TorchNeuron's)."""
        torch.manual_seed(seed)

    def compilations(self) -> int | None:
        """Graphs compiled so far in this process (XLA cache misses); None where nothing is compiled."""
        return None

    # ------------------------------------------------------------------ process groups
    def init_process_groups(self, dims: ParallelDims) -> None:
        """Create the process groups (where a single process needs any) and set dims' mesh and dp_group, and its
        tp_rank / dp_rank where the backend's library decides which ranks form a group."""
        raise NotImplementedError

    # ------------------------------------------------------------------ the model
    def parallelize(self, model: nn.Module, recipe: Recipe, dims: ParallelDims) -> None:
        """Apply the layout to a model built on the meta device, in place: the tensor-parallel plan (and with it the
        loss path: a TP head does not hold the whole vocabulary, so the plan swaps the fused head + loss for its
        vocab-parallel form), then activation checkpointing, which wraps what the plan produced."""
        if dims.tp > 1:
            self.tensor_parallel(model, recipe, dims)
        m = recipe.model
        apply_activation_checkpointing(model, m.activation_checkpointing, m.activation_checkpointing_full_layers)
        if self.compiles(recipe):
            compile_blocks(model, self.compile_backend)

    def compiles(self, recipe: Recipe) -> bool:
        """Whether train.compile applies here: torch.compile per block (trnrecipes/parallel/compile.py)."""
        wanted = recipe.train.compile
        if wanted is None:  # unset: where it is tested (not yet under PP)
            wanted = self.compiles_by_default and recipe.layout.pp == 1
        return self.compile_backend is not None and wanted

    def tensor_parallel(self, model: nn.Module, recipe: Recipe, dims: ParallelDims) -> None:
        raise NotImplementedError

    def materialize(self, model: nn.Module) -> None:
        """Give the parameters (each its local shard) real, unfilled memory where they will be filled."""
        model.to_empty(device=self.device)

    def to_device(self, model: nn.Module) -> None:
        """Move the filled model to the device, if it was filled elsewhere."""

    @staticmethod
    def shard_dim(p: torch.Tensor) -> int | None:
        """The dim of the full tensor this parameter's TP shards split; None if replicated."""
        raise NotImplementedError

    def pipeline(self, model: nn.Module, recipe: Recipe, dims: ParallelDims, micro_batches: int):
        """The schedule that runs this rank's pipeline stages (a StagedModel, trnrecipes/parallel/pipeline.py): an
        object with train(micro-batches) -> mean loss (None off the last stage), after forward and backward over them,
        and evaluate(batches) -> mean loss (None off the last stage)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ the step
    def make_optimizer(self, model: nn.Module, recipe: Recipe, dims: ParallelDims):
        """AdamW over the model's trained parameters; under ZeRO-1 (dims.zero1) each DP rank keeps moments for, and
        updates, only its rows of each parameter (trnrecipes.optim.adamw), but of expert-parallel experts all of them
        (each rank's experts are its own already; the dp / ep ranks holding the same ones update them alike). Where
        train.compile compiles the blocks, the optimizer step is compiled too: one graph per parameter group."""
        from trnrecipes.optim.adamw import AdamW, no_decay_params
        from trnrecipes.optim.rounding import rounding_seed

        params = [p for p in model.parameters() if p.requires_grad]
        sharded = expert_layouts(model)  # expert parallelism's experts: split by EP already, their moments kept whole
        ids = {id(q) for name, q in model.named_parameters() if name in sharded}
        experts = {i for i, p in enumerate(params) if id(p) in ids}
        rows = None
        if dims.zero1:
            rows = [
                (0, local_tensor(p).shape[0]) if i in experts else dims.zero1_rows(local_tensor(p).shape[0])
                for i, p in enumerate(params)
            ]
        p = recipe.precision
        optimizer = AdamW(
            params,
            recipe.optim,
            no_decay_params(model, recipe.optim.decay_norms_and_biases),
            stochastic_rounding=p.stochastic_rounding and p.dtype == "bf16" and not self.rounds_stochastically,
            seed=rounding_seed(recipe.train.seed, dims),
            rows=rows,
            # under TP, the parameters each TP rank holds whole round alike on every TP rank (their copies stay equal)
            tp_replicated={id(q) for q in params if self.shard_dim(q) is None} if dims.tp > 1 else None,
            tp_replicated_seed=rounding_seed(recipe.train.seed, dims, tp_replicated=True),
            compile_backend=self.compile_backend if self.compiles(recipe) else None,
        )
        optimizer.whole_rows = experts
        return optimizer

    def optimizer_step(self, optimizer, dims: ParallelDims) -> None:
        """One optimizer step (the learning rate already set); under ZeRO-1 each DP rank then shares the rows it
        updated, so every replica holds the whole updated weights."""
        optimizer.step()
        if optimizer.rows is not None:
            shared = [i for i in range(len(optimizer.params)) if i not in optimizer.whole_rows]
            dims.gather_zero1(
                [local_tensor(optimizer.params[i]).data for i in shared], [optimizer.rows[i] for i in shared]
            )

    def step(self, model: nn.Module, optimizer, dims: ParallelDims, max_norm: float) -> torch.Tensor:
        """Everything after backward: reduce and clip the gradients, step the optimizer (its lr already set);
        returns the global grad norm before clipping."""
        grad_norm = self.reduce_and_clip(model, dims, max_norm)
        self.optimizer_step(optimizer, dims)
        return grad_norm

    def reduce_and_clip(self, model: nn.Module, dims: ParallelDims, max_norm: float) -> torch.Tensor:
        """Average the gradients over the DP group, clip them by the global norm (every TP shard, each parameter
        counted once; max_norm <= 0: no clipping) and return that norm."""
        raise NotImplementedError

    def param_norm(self, model: nn.Module, dims: ParallelDims) -> torch.Tensor:
        """L2 norm of the whole model's parameters, each counted once however it is sharded."""
        raise NotImplementedError
