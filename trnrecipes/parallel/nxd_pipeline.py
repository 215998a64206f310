"""Pipeline parallelism on Neuron: neuronx-distributed's NxDPPModel in manual-partition mode, running the stages a
pipeline rank holds (trnrecipes.parallel.pipeline.StagedModel) with TorchPipeline's contract. Import-guarded like
trnrecipes.parallel.nxd (the SDK installs only on Trainium hosts); tested against a stand-in with NxD's signatures
(tests/test_neuron_pipeline.py).

Written against neuronx_distributed/pipeline/model.py (NxDPPModel) and pipeline/manual_pipe_stage.py
(PipelineStageModule) of NxD 2.29 (aws-neuron/neuronx-distributed fbac349). Manual partition arrived in Neuron SDK
2.22 (a070deb: NxDPPModel has no manual_pp_partition in 2.21.1, 977d3b7); the manual-mode code is the same from
2.22 to 2.29 (2.22 also calls torch_neuronx's neuron_layer(transformer_layer_cls), with None in NxD's own manual
tests, test/integration/parallel_layers/pipeline/manual_pp/, as here). What it does, and how we use it:
- construction (NxDPPModel.__init__ -> _create_manual_partition): `module` is the model as a list of "layers" and
  manual_pp_stage_partition_fn(layers, num_stages) maps every one of them to a stage; this rank keeps those mapped
  to its PP rank (parallel_state.get_pipeline_model_parallel_rank()) in one PipelineStageModule, whose forward
  chains them (out = layer(out)). One stage per rank: manual mode builds model chunk 0 only (no virtual stages),
  and trains with Train1F1BSchedule (1F1B, any number of micro-batches) and evaluates with InferenceSchedule.
  We pass one "layer" per pipeline stage: this rank's StageModule (trnrecipes.parallel.pipeline: embed? -> its layers ->
  norm?) behind _NxDStage, empty placeholders for the other ranks' stages (never run, never materialised here),
  and a partition that maps entry s to stage s: trnrecipes.config.stages' split, explicit pp_stage_layers included.
- run_train(inputs=..., labels=...) / run_eval(...): exactly these two keywords in manual mode
  (_create_model_inputs_and_labels_iter). Each is the whole step's batch; get_batch_iterator cuts it along dim 0
  into num_microbatches contiguous slices and MpDeviceLoader uploads them one by one: host tensors go in. Every
  rank passes both (every rank builds both iterators). The first stage is called with the micro-batch as a list
  [ids]; a later stage with what the stage before it returned (sent tensor by tensor, structure kept:
  _fwd_postprocess_task / _manual_pp_preprocess_stage_io); the last stage's loss is
  manual_pp_loss_fn(outputs[0], labels[0]) (_fwd_step_task), so a stage returns a list whose [0] is the hidden
  states, and our loss fn is StagedModel.loss(hidden, labels): the head + cross-entropy on the last stage.
- backward: the last stage runs (loss / num_microbatches).backward() per micro-batch (_bwd_step_task): the step
  loop's (loss / grad_accum).backward() scaling; earlier stages backward the received gradients.
- gradient reduction (_reduce_grads_task, after the schedule): the gradients are all-reduced over DP
  (bucket_allreduce_gradients) unless use_zero1_optimizer or use_optimizer_wrapper is set. NxD's trainer builds
  the pp model with use_model_wrapper=True (trainer/trainer.py, initialize_parallel_model) and its examples pass
  use_optimizer_wrapper=True and use_zero1_optimizer=<zero-1 on> (examples/training/llama/tp_pp_llama_hf_pretrain/
  run_llama_nxd.py, pipeline_config), leaving the reduction to NxDOptimizer.step (trainer/optimizer.py: SP
  all-reduce, DP bucket all-reduce and clip_grad_norm, whose norm sums over the TP and PP groups) or to the zero-1
  optimizer's reduce-scatter. We pass the same two flags, and the neuron backend's step does what NxDOptimizer.step
  does (reduce_sequence_parallel_gradients, average_gradients_over_dp, clip_grad_norm; or NxD's zero-1 step), so
  each gradient is reduced over DP exactly once. Weights shared between stages are all-reduced over the sharing
  stages only if marked with PipelineStageModule.mark_weight_sharing; our families' embedding and head are untied,
  so there are none.
- the loss it returns: on the last PP rank the mean of the micro-batch losses, moved to the host unless
  return_loss_on_cpu=False (a device->host sync each step); None elsewhere (broadcast_and_average_loss off). We
  take the mean of the losses our loss fn records instead (in micro-batch order, summed as the step loop sums
  them) and pass return_loss_on_cpu=False.
- names: in manual mode NxD names this rank's parameters after its own wrappers (local_named_parameters:
  "pipeline_stage_modules.0.<class>...."); nothing here uses those names. The StagedModel owns the modules the
  stages run (the same Parameter objects), with the full model's names (layers.<i>...., embed.weight, ...): the
  optimizer, norms and our checkpoints use it; NxD's pickle-based save_checkpoint is not used.
- NxDPPModel.forward/train/state_dict raise: the step loop calls .train()/.eval() on the StagedModel.
"""

from __future__ import annotations

import torch
from torch import nn

from trnrecipes.parallel.nxd import _NXD_MISSING
from trnrecipes.parallel.pipeline import Pipeline


class _NxDStage(nn.Module):
    """One of our pipeline stages as NxD's manual pipeline calls it: the input comes as a one-element list (the
    first stage's micro-batch [ids]; a later stage gets the list the stage before it returned), and the output goes
    out as [hidden]: NxD's loss call reads outputs[0]."""

    def __init__(self, stage: nn.Module):
        super().__init__()
        self.stage = stage

    def forward(self, x):
        if isinstance(x, (list, tuple)):
            (x,) = x
        return [self.stage(x)]


class _RemoteStage(nn.Module):
    """A stage another pipeline rank runs: an entry of the list NxD partitions, never called here."""

    def __init__(self, index: int):
        super().__init__()
        self.index = index

    def forward(self, x):
        raise RuntimeError(f"pipeline stage {self.index} runs on another pipeline rank")


def _stage_per_rank(layers: list, num_stages: int) -> dict:
    """manual_pp_stage_partition_fn: entry s of our list is stage s."""
    if len(layers) != num_stages:
        raise ValueError(f"{len(layers)} stages for a pipeline of {num_stages} ranks")
    return {layer: s for s, layer in enumerate(layers)}


class NeuronPipeline(Pipeline):
    """A StagedModel's stage under NxD's NxDPPModel (manual partition, 1F1B), with TorchPipeline's contract:
    train(micro-batches) runs forward and backward over one optimizer step's micro-batches ([b, s + 1] token ids
    each) and returns their mean loss on the last stage (None elsewhere), gradients left in .grad as
    (loss / micro_batches).backward() per micro-batch leaves them, not reduced over DP (the backend's step does);
    evaluate(batches) runs forward only. See the notes above for what NxD does with each argument."""

    def __init__(self, model, micro_batches: int, *, pp: int, zero1: bool):
        try:
            from neuronx_distributed.parallel_layers import parallel_state
            from neuronx_distributed.pipeline import NxDPPModel
        except ImportError as err:
            raise RuntimeError(_NXD_MISSING) from err
        if len(model.stages) != 1:
            raise ValueError(f"NxD's manual pipeline runs one stage per rank; this rank holds {len(model.stages)}")
        super().__init__(model, micro_batches)
        (self.stage,) = model.stages
        if (nxd_rank := parallel_state.get_pipeline_model_parallel_rank()) != self.stage.index:
            # the rank built its layers for dims.pp_rank; NxD would run them as the stage of its own PP rank
            raise RuntimeError(f"this rank holds pipeline stage {self.stage.index}, but NxD's PP rank is {nxd_rank}")
        self.pp, self.zero1 = pp, zero1
        self._nxd_class = NxDPPModel
        self._train = self._make_schedule(micro_batches, train=True)

    def _make_schedule(self, n: int, *, train: bool):
        """An NxDPPModel over this rank's stage for n micro-batches (NxD fixes the count when it is built)."""
        (forward,) = self.model.stage_modules()
        layers = [_NxDStage(forward) if s == self.stage.index else _RemoteStage(s) for s in range(self.pp)]
        return self._nxd_class(
            layers,
            num_microbatches=n,
            manual_pp_partition=True,
            manual_pp_stage_partition_fn=_stage_per_rank,
            manual_pp_loss_fn=self._loss,
            use_zero1_optimizer=self.zero1,
            use_optimizer_wrapper=True,  # no DP all-reduce in the pipeline: the backend's step reduces once
            return_loss_on_cpu=False,
            broadcast_and_average_loss=False,
            return_mb_loss=False,
        )

    def _loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # The mean over this micro-batch's labels; NxD divides it by num_microbatches for backward itself.
        return self._record(self.model.loss(hidden, labels))

    def _execute(self, nxd, batches: list[torch.Tensor], *, train: bool) -> None:
        # Host tensors: NxD's MpDeviceLoader uploads each micro-batch (the neuron backend's loader leaves the
        # batches on the host while a pipeline runs; a device tensor would be copied back here).
        tokens = torch.cat([b.cpu() for b in batches])
        inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        if train:
            nxd.run_train(inputs=inputs, labels=labels)
        else:
            nxd.run_eval(inputs=inputs, labels=labels)
