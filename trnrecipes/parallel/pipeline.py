"""Pipeline parallelism: the part of the model one pipeline rank holds, and (cpu / cuda) the schedule that runs it.

`StagedModel` is what a pipeline rank trains: the stages trnrecipes/config/stages.py gives it, as one module whose
parameter names are the full model's (`embed.weight`, `layers.17.attn.qkv.weight`, `head.weight`: layers keyed by
their original index in a ModuleDict), so the sharded build, the init rules, the tensor-parallel plan, the optimizer
and the checkpoint code all work on it unchanged. It is cut from the full model built on the meta device, along
the top-level structure the family spec declares (FamilySpec.parts): model.py stays single-device and unchanged.

`TorchPipeline` runs it with torch.distributed.pipelining over the pp process group: one PipelineStage per stage
this rank holds, the recipe's schedule (1F1B, GPipe or interleaved 1F1B), one micro-batch per grad-accum step. The
loss (the family's head + cross-entropy, fused unless the head is tensor parallel) runs on the last stage, divided
there by the number of micro-batches, so gradients come out exactly as the non-pipelined loop's
(loss / grad_accum).backward() leaves them; the schedule's own grad scaling is off.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from trnrecipes.config.stages import Stage

if TYPE_CHECKING:
    from recipes.common.spec import ModelParts
    from trnrecipes.parallel.dims import ParallelDims


class StageModule(nn.Module):
    """One stage's forward: embedding (first stage), its layers in order, final norm (last stage). It shares its
    submodules with the StagedModel that owns them. The head is applied by the loss, on the last stage."""

    def __init__(self, staged: StagedModel, stage: Stage):
        super().__init__()
        parts = staged.parts
        self.stage = stage
        self.embed = getattr(staged, parts.embedding) if stage.first else None
        blocks = getattr(staged, parts.layers)
        self.layers = nn.ModuleList(blocks[str(i)] for i in stage.layers)
        self.norm = getattr(staged, parts.norm) if stage.last else None
        self.head = getattr(staged, parts.head) if stage.last else None  # for the parameters; used by the loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        if self.norm is not None:
            x = self.norm(x)
        return x


class StagedModel(nn.Module):
    """The stages one pipeline rank holds, as one module with the full model's parameter names (module docstring).
    Calling it directly is an error: its stages run through a pipeline schedule."""

    def __init__(self, model: nn.Module, parts: ModelParts, stages: list[Stage]):
        super().__init__()
        self.args = model.args
        self.parts = parts
        self.head_loss = model.head_loss  # the parallelize step may swap it (a TP head: vocab-parallel)
        # The whole model's parameter order: gradient and parameter norms sum per-parameter squares in it, so they
        # do not depend on how the model is split.
        self.full_parameter_names = [name for name, _ in model.named_parameters()]
        if any(s.first for s in stages):
            setattr(self, parts.embedding, getattr(model, parts.embedding))
        blocks = getattr(model, parts.layers)
        setattr(self, parts.layers, nn.ModuleDict({str(i): blocks[i] for s in stages for i in s.layers}))
        if any(s.last for s in stages):
            setattr(self, parts.norm, getattr(model, parts.norm))
            setattr(self, parts.head, getattr(model, parts.head))
        self.stages = stages

    def stage_modules(self) -> list[StageModule]:
        """One forward per stage, over this module's (parallelized, materialised) submodules."""
        return [StageModule(self, s) for s in self.stages]

    def loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The last stage's loss: the model's head_loss over the final hidden states (the mean over labels)."""
        return self.head_loss(getattr(self, self.parts.head), hidden, labels)

    def forward(self, *args, **kwargs):
        raise RuntimeError("a StagedModel holds some pipeline stages only: run it through its pipeline schedule")


def parameter_order(model: nn.Module) -> list[str]:
    """The full model's parameter names in order (a StagedModel knows them; any other model is whole)."""
    names = getattr(model, "full_parameter_names", None)
    return list(names) if names is not None else [name for name, _ in model.named_parameters()]


class Pipeline:
    """What the step loop asks of a pipeline (Backend.pipeline returns one): `train` runs forward and backward over
    one optimizer step's micro-batches ([b, s + 1] token ids each; gradients left in .grad as the step loop's
    (loss / micro_batches).backward() per micro-batch leaves them, not reduced over DP), `evaluate` runs forward
    only; both return the mean of the micro-batch losses on the rank that holds the last stage, None elsewhere.
    A subclass builds its schedules (`_make_schedule`; the training one, `_train`, in its __init__) and feeds them
    (`_execute`); its loss function calls `_record`.
    """

    def __init__(self, model: StagedModel, micro_batches: int):
        self.model, self.micro_batches = model, micro_batches
        self.last = any(s.last for s in model.stages)
        self._losses: list[torch.Tensor] = []
        self._eval: dict[int, object] = {}  # by number of batches: a schedule's micro-batch count is fixed

    def _make_schedule(self, n: int, *, train: bool):
        raise NotImplementedError

    def _execute(self, schedule, tokens: list[torch.Tensor], *, train: bool) -> None:
        raise NotImplementedError

    def _record(self, loss: torch.Tensor) -> torch.Tensor:
        """The last stage's loss for one micro-batch (the mean over its labels), kept for the step's mean."""
        self._losses.append(loss.detach())
        return loss

    def _run(self, schedule, batches: list[torch.Tensor], *, train: bool) -> torch.Tensor | None:
        self._losses = []
        self._execute(schedule, batches, train=train)
        if not self.last:
            return None
        # A schedule may call the loss once more on placeholder tensors before the micro-batches (torch infers the
        # shapes of the gradients between stages that way): the micro-batches' losses are the last len(batches).
        if len(self._losses) < len(batches):
            raise RuntimeError(f"the pipeline computed {len(self._losses)} losses for {len(batches)} micro-batches")
        losses = self._losses[-len(batches) :]
        total = torch.zeros((), dtype=torch.float32, device=losses[0].device)
        for loss in losses:  # micro-batch order, as the step loop sums them
            total = total + loss.float()
        return total / len(batches)

    def train(self, batches: list[torch.Tensor]) -> torch.Tensor | None:
        if len(batches) != self.micro_batches:
            raise ValueError(f"the pipeline runs {self.micro_batches} micro-batches per step, got {len(batches)}")
        return self._run(self._train, batches, train=True)

    @torch.no_grad()
    def evaluate(self, batches: list[torch.Tensor]) -> torch.Tensor | None:
        n = len(batches)
        if n not in self._eval:
            self._eval[n] = self._make_schedule(n, train=False)
        return self._run(self._eval[n], batches, train=False)


class TorchPipeline(Pipeline):
    """A StagedModel's stages under a torch.distributed.pipelining schedule (module docstring)."""

    def __init__(self, model: StagedModel, schedule: str, micro_batches: int, dims: ParallelDims, device):
        super().__init__(model, micro_batches)
        self.schedule_name, self.device = schedule, device
        self.group = dims.pp_group
        self.num_stages = dims.pp * len(model.stages)
        self.first = any(s.first for s in model.stages)
        self._train = self._make_schedule(micro_batches, train=True)

    def _make_schedule(self, n: int, *, train: bool):
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
            ScheduleLoopedBFS,
        )

        def loss_fn(hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            loss = self._record(self.model.loss(hidden, labels))
            return loss / n if train and n > 1 else loss  # as the step loop's (loss / grad_accum).backward()

        # Fresh PipelineStage objects per schedule (training, and each evaluation size): a stage keeps buffers
        # sized for the schedule that first ran it. They share the StagedModel's modules, hence its parameters.
        stages = [
            PipelineStage(m, m.stage.index, self.num_stages, self.device, group=self.group)
            for m in self.model.stage_modules()
        ]
        # Evaluation is forward only, so none of 1F1B's micro-batch rules (interleaving's whole rounds included):
        # GPipe order, or its looped form for several stages per rank (any number of validation batches).
        name = self.schedule_name if train else ("looped_bfs" if len(stages) > 1 else "gpipe")
        if name == "interleaved_1f1b":
            return ScheduleInterleaved1F1B(stages, n, loss_fn=loss_fn, scale_grads=False)
        if name == "looped_bfs":
            return ScheduleLoopedBFS(stages, n, loss_fn=loss_fn, scale_grads=False)
        kind = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[name]
        return kind(stages[0], n, loss_fn=loss_fn, scale_grads=False)

    def _execute(self, schedule, batches: list[torch.Tensor], *, train: bool) -> None:
        """Inputs to the first stage, labels to the last."""
        tokens = torch.cat([b.to(self.device) for b in batches])
        args = (tokens[:, :-1],) if self.first else ()
        target = tokens[:, 1:] if self.last else None
        if train:
            schedule.step(*args, target=target, return_outputs=False)
        else:
            schedule.eval(*args, target=target)
