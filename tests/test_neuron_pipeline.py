"""Pipeline parallelism on the neuron backend (trnrecipes.parallel.nxd_pipeline.NeuronPipeline) against a stand-in for
neuronx-distributed's NxDPPModel in manual-partition mode. The Neuron SDK installs only on Trainium hosts: what is
checked here is the wiring (what the adapter hands NxD, how NxD's manual mode would call it back, who reduces the
gradients) and, with the pipeline ranks simulated in one process, that a PP-2 neuron run computes what the
unpipelined model computes; not NxD's send/recv, its XLA graphs or its collectives."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from test_neuron_parallel import install_fake_nxd, stand_in_dims
from torch import nn

from trnrecipes.backends.neuron_xla import NeuronXlaBackend
from trnrecipes.backends.torch import TorchBackend
from trnrecipes.backends.xla import XlaBackend
from trnrecipes.config.recipe import load_recipe
from trnrecipes.config.sections import RecipeError
from trnrecipes.config.stages import neuron_pipeline_problem as pipeline_problem
from trnrecipes.models import build_model
from trnrecipes.parallel import nxd
from trnrecipes.parallel.nxd import param_norm
from trnrecipes.parallel.nxd_pipeline import NeuronPipeline
from trnrecipes.parallel.pipeline import StageModule
from trnrecipes.train.build import build_model_shard

# -- the stand-in ------------------------------------------------------------------------------------------------


class PipeWorld:
    """The pipeline ranks of one model replica, simulated in one process. Each rank's NxDPPModel joins the world
    when it runs (run_train / run_eval); once every rank has joined, the schedule runs for all of them, as NxD's
    send/recv complete only with both ends in them. Call the ranks in order: the last rank's call runs the step and
    returns the loss, as it would on Trainium."""

    def __init__(self, pp: int):
        self.pp = pp
        self.waiting: dict[int, tuple] = {}
        self.built: dict[int, list] = {r: [] for r in range(pp)}  # each rank's NxDPPModels, in construction order

    def join(self, rank: int, model, train: bool, inputs: list, labels: list) -> None:
        assert rank not in self.waiting, f"pipeline rank {rank} entered twice"
        self.waiting[rank] = (model, train, inputs, labels)
        if len(self.waiting) == self.pp:
            ranks, self.waiting = [self.waiting[r] for r in range(self.pp)], {}
            self._run(ranks)

    def _run(self, ranks: list[tuple]) -> None:
        """One step of NxD's manual pipeline over every rank: per micro-batch, each stage's forward on what the stage
        before it sent (detached copies of its output tensors, as a send/recv makes), the loss on the last stage,
        (loss / num_microbatches).backward() there and the received gradients backward through the earlier stages;
        then each rank's _reduce_grads_task. The order of the micro-batches' backward passes on each stage is 1F1B's
        (micro-batch 0 first), so every gradient accumulates in the same order as there."""
        models = [r[0] for r in ranks]
        train = ranks[0][1]
        assert all(r[1] == train for r in ranks), "pipeline ranks ran different schedules"
        n = models[0].num_microbatches
        assert all(m.num_microbatches == n for m in models)
        inputs, labels = ranks[0][2], ranks[-1][3]  # the first stage reads the inputs, the last the labels
        with torch.set_grad_enabled(train):
            for mb in range(n):
                received = [inputs[mb]]  # NxD: inputs = [model_inputs], the micro-batch as a list [ids]
                sent_between: list[tuple[list, list]] = []
                for r, model in enumerate(models):
                    outputs = model.local_stage_modules[0](*received)
                    if r < self.pp - 1:
                        sent = _tensors(outputs)
                        copies = [t.detach().clone().requires_grad_(t.requires_grad) for t in sent]
                        sent_between.append((sent, copies))
                        received = [_rebuild(outputs, iter(copies))]
                        continue
                    loss = model.manual_pp_loss_fn(outputs[0], labels[mb][0])  # NxD: loss_fn(outputs[0], labels[0])
                    model.losses_for_printing.append(loss.detach().clone())
                    if train:
                        (loss / n).backward()  # NxD's _bwd_step_task on the last stage
                        for sent, copies in reversed(sent_between):
                            pairs = [(s, c.grad) for s, c in zip(sent, copies, strict=True) if s.requires_grad]
                            torch.autograd.backward([s for s, _ in pairs], grad_tensors=[g for _, g in pairs])
        for model in models:
            if train:
                model.reduce_grads()
            model.finish()


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    return [t for item in obj for t in _tensors(item)]


def _rebuild(obj, tensors):
    if isinstance(obj, torch.Tensor):
        return next(tensors)
    return type(obj)(_rebuild(item, tensors) for item in obj)


def _fake_nxdpp_model(world: PipeWorld, pp_rank: int, grads: types.ModuleType) -> type:
    """NxD 2.29's NxDPPModel (neuronx_distributed/pipeline/model.py, fbac349): the constructor keyword for keyword,
    defaults included, and manual-partition mode only: module is a list, partitioned by manual_pp_stage_partition_fn
    (or NxD's even split) into a PipelineStageModule of this rank's entries, chained in its forward; run_train /
    run_eval take exactly `inputs` and `labels`, whole-step host batches cut along dim 0 into num_microbatches
    micro-batches, each a one-element list; the last stage's loss is manual_pp_loss_fn(outputs[0], labels[0]);
    _reduce_grads_task all-reduces the gradients over DP unless use_zero1_optimizer or use_optimizer_wrapper; the
    returned loss is the micro-batches' mean on the last PP rank (on the host if return_loss_on_cpu), else None."""

    class NxDPPModel(nn.Module):
        def __init__(
            self,
            module,
            transformer_layer_cls=None,
            num_microbatches=1,
            virtual_pipeline_size=1,
            output_loss_value_spec=None,
            return_mb_loss=False,
            broadcast_and_average_loss=False,
            use_zero1_optimizer=False,
            use_model_wrapper=False,
            use_optimizer_wrapper=False,
            pipeline_cuts=None,
            input_names=None,
            leaf_module_cls=None,
            autowrap_functions=None,
            autowrap_modules=None,
            autowrap_obj_methods=None,
            tracer_cls=None,
            param_init_fn=None,
            trace_file_path=None,
            return_loss_on_cpu=True,
            deallocate_pipeline_outputs=False,
            auto_partition=False,
            fuse_microbatches=False,
            manual_pp_partition=False,
            manual_pp_stage_partition_fn=None,
            manual_pp_loss_fn=None,
            _delay_tracing=False,
            _turn_off_odd_even_scheduler=False,
            _all_reduce_send_recv=False,
            _fused_send_recv=False,
            _fused_fwd_bwd=False,
            _mark_step_before_pp_runtime=True,
            _mark_step_after_pp_runtime=True,
            _deallocate_send_tensors=True,
            _use_gloo_for_metadata_comm=False,
            _debug_mode=False,
            _debug_pp_size=8,
            _debug_pp_rank=0,
        ):
            config = {k: v for k, v in locals().items() if k not in ("self", "module", "__class__")}
            super().__init__()
            if transformer_layer_cls is None and manual_pp_partition is False:
                raise ValueError("NxDPPModel requires transformer_layer_cls as input")
            if not manual_pp_partition:
                raise NotImplementedError("the stand-in models NxD's manual partition only")
            assert type(module) is list, "module should be a list of layers"
            self.config = config
            self.num_microbatches = num_microbatches
            self.manual_pp_loss_fn = manual_pp_loss_fn
            self.output_loss = manual_pp_loss_fn is not None
            # PipelineStageModule._partition
            mapping = (manual_pp_stage_partition_fn or _partition_evenly)(module, world.pp)
            assert len(mapping) == len(module), "partition_fn must return a mapping for all layers"
            self.partition = mapping
            self.local_stage_modules = [_PipelineStage([m for m in module if mapping[m] == pp_rank])]
            self.losses_for_printing: list[torch.Tensor] = []
            self.result = None
            world.built[pp_rank].append(self)

        def _join(self, train: bool, kwargs: dict):
            # _create_model_inputs_and_labels_iter: both keywords, nothing else
            assert len(kwargs) == 2 and set(kwargs) == {"inputs", "labels"}, kwargs.keys()
            micro = []
            for t in (kwargs["inputs"], kwargs["labels"]):
                # MpDeviceLoader uploads host tensors (the traced mode's check: "model inputs should be all on cpu")
                assert isinstance(t, torch.Tensor) and t.device == torch.device("cpu")
                if t.shape[0] % self.num_microbatches:
                    raise RuntimeError(f"Input batch size {t.shape[0]} must be divisible with the num_microbatches")
                size = t.shape[0] // self.num_microbatches
                micro.append([[t[k * size : (k + 1) * size]] for k in range(self.num_microbatches)])
            self.losses_for_printing = []
            self.result = None
            world.join(pp_rank, self, train, *micro)
            return self.result

        def run_train(self, *args, **kwargs):
            return self._join(True, kwargs)

        def run_eval(self, *args, **kwargs):
            with torch.no_grad():
                return self._join(False, kwargs)

        def reduce_grads(self):  # _reduce_grads_task
            if not self.config["use_zero1_optimizer"] and not self.config["use_optimizer_wrapper"]:
                local = [p.grad.data for p in self.local_stage_modules[0].parameters() if p.grad is not None]
                grads.bucket_allreduce_gradients(local)

        def finish(self):  # _process_loss
            if not self.output_loss or pp_rank != world.pp - 1:
                return
            loss = torch.sum(torch.stack(self.losses_for_printing), dim=0) / len(self.losses_for_printing)
            self.result = loss.detach().cpu() if self.config["return_loss_on_cpu"] else loss.detach()

        def forward(self, *args, **kwargs):
            raise RuntimeError("model.forward() is not supported in pipeline model.")

        def train(self, *args, **kwargs):
            raise RuntimeError("model.train() is not supported in pipeline mode.")

    return NxDPPModel


def _partition_evenly(layers, num_stages):  # PipelineStageModule._partition_evenly
    chunk = len(layers) // num_stages
    return {layer: min(i // chunk, num_stages - 1) for i, layer in enumerate(layers)}


class _PipelineStage(nn.Module):
    """PipelineStageModule: this rank's entries, held in a plain list (not registered), chained."""

    def __init__(self, stage_modules: list):
        super().__init__()
        self.stage_modules = stage_modules

    def forward(self, x):
        output = x
        for mod in self.stage_modules:
            output = mod(output)
        return output

    def parameters(self, recurse: bool = True):
        for mod in self.stage_modules:
            yield from mod.parameters(recurse)


def install_fake_pipeline(monkeypatch, world: PipeWorld, pp_rank: int, **nxd) -> None:
    """install_fake_nxd for pipeline rank `pp_rank` of `world`, with neuronx_distributed.pipeline.NxDPPModel."""
    install_fake_nxd(monkeypatch, pp=world.pp, pp_rank=pp_rank, **nxd)
    module = types.ModuleType("neuronx_distributed.pipeline")
    module.NxDPPModel = _fake_nxdpp_model(world, pp_rank, sys.modules["neuronx_distributed.parallel_layers.grads"])
    monkeypatch.setitem(sys.modules, module.__name__, module)


# -- tests ---------------------------------------------------------------------------------------------------------

PP2 = ["layout.pp=2", "cluster.workers_per_node=2", "batch.seq_len=16", "model.num_layers=3"]


def _dims(pp_rank: int, pp: int = 2, **fields) -> types.SimpleNamespace:
    return stand_in_dims(**dict(pp=pp, pp_rank=pp_rank, world=pp, rank=pp_rank) | fields)


def _ranks(monkeypatch, recipe, micro_batches: int, zero1: bool = False):
    """Each pipeline rank of a PP-2 neuron run, built as the trainer builds it (stand-in NxD per rank): its dims,
    backend, StagedModel and pipeline."""
    world = PipeWorld(2)
    ranks = []
    for pp_rank in range(2):
        install_fake_pipeline(monkeypatch, world, pp_rank)
        dims = _dims(pp_rank, zero1=zero1)
        backend = NeuronXlaBackend("neuron", torch.device("cpu"))
        model = build_model_shard(recipe, dims=dims, backend=backend)
        ranks.append((dims, backend, model, backend.pipeline(model, recipe, dims, micro_batches)))
    return world, ranks


def _batches(recipe, n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (recipe.batch.micro_batch, recipe.batch.seq_len + 1)
    return [torch.randint(0, recipe.model.vocab_size, shape, generator=g) for _ in range(n)]


def test_neuron_runs_pipelines_and_plain_xla_does_not():
    assert NeuronXlaBackend.supports_pp and TorchBackend.supports_pp
    assert not XlaBackend.supports_pp, (
        "plain XLA has no pipeline schedule (torch.distributed.pipelining needs gloo/nccl)"
    )


@pytest.mark.parametrize("sdk", ["2.21", "2.22", "2.28"])
def test_nxd_manual_pipeline_needs_sdk_2_22_and_is_refused_when_the_recipe_loads(sdk):
    over = [f"cluster.neuron_sdk={sdk}"]  # neox20b: TP8 PP4 on backend neuron
    if sdk == "2.21":  # refused before any job is rendered, let alone a weight built
        with pytest.raises(RecipeError, match=r"Neuron SDK 2\.22 or newer; cluster\.neuron_sdk is '2\.21'"):
            load_recipe("neox20b", overrides=over)
    else:
        assert load_recipe("neox20b", overrides=over).layout.pp == 4
    assert load_recipe("neox20b", overrides=[*over, "layout.pp=1"]).layout.pp == 1  # no pipeline: any SDK


def test_nxd_manual_pipeline_runs_1f1b_with_one_stage_per_rank():
    assert "1F1B schedule only" in pipeline_problem("2.26", "gpipe", 1)
    assert "layout.pp_schedule=1f1b" in pipeline_problem("2.26", "gpipe", 1)
    assert "one stage per pipeline rank" in pipeline_problem("2.26", "interleaved_1f1b", 2)
    assert pipeline_problem("2.26", "1f1b", 1) is None
    with pytest.raises(RecipeError, match="gpipe"):
        load_recipe("neox20b", overrides=["layout.pp_schedule=gpipe"])


def test_initialize_asks_nxd_for_the_pipeline_and_takes_its_ranks(monkeypatch):
    """NxD decides each rank's place in its PP group (ring layouts): the dims must follow it, so that the stage a
    rank builds is the one NxD runs there."""
    install_fake_nxd(monkeypatch, tp=2, rank=1, dp=2, dp_rank=0, pp=2, pp_rank=1)
    state = sys.modules["neuronx_distributed.parallel_layers.parallel_state"]
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    dims = types.SimpleNamespace(tp=2, dp=2, pp=2, pp_rank=0, dp_rank=1, tp_rank=0, pp_group=None, fsdp=False)
    NeuronXlaBackend("neuron", torch.device("cpu")).init_process_groups(dims)
    assert state.calls == [dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, lnc_size=1)]
    assert (dims.pp_rank, dims.dp_rank, dims.tp_rank, dims.pp_group) == (1, 0, 1, "nxd-pp-group")
    with pytest.raises(RuntimeError, match="pipeline groups of 2 ranks, not 4"):
        nxd.initialize(2, 2, 4)


def test_the_adapter_hands_nxd_its_stage_the_split_and_the_flags(monkeypatch):
    """What NxDPPModel gets on each rank: manual partition, one entry per stage with this rank's StageModule (the
    recipe's split: layer 0 + embedding, then layers 1-2 + norm + head), the step's micro-batch count, the loss on
    the last stage, and the flags that keep NxD from reducing gradients over DP (the backend's step does, once)."""
    recipe = load_recipe("neox-tiny", overrides=PP2)
    world, ranks = _ranks(monkeypatch, recipe, micro_batches=4)
    for (dims, _, model, pipeline), pp_model in zip(ranks, (world.built[0][0], world.built[1][0]), strict=True):
        c = pp_model.config
        assert c["manual_pp_partition"] and c["num_microbatches"] == 4 and c["virtual_pipeline_size"] == 1
        assert c["use_optimizer_wrapper"] and not c["use_zero1_optimizer"]
        assert not c["return_loss_on_cpu"] and not c["broadcast_and_average_loss"] and not c["return_mb_loss"]
        assert c["manual_pp_loss_fn"] == pipeline._loss
        assert sorted(pp_model.partition.values()) == [0, 1]
        (entry,) = pp_model.local_stage_modules[0].stage_modules
        stage = entry.stage
        assert isinstance(stage, StageModule) and stage.stage.index == dims.pp_rank
        assert all(a is model.layers[str(i)] for a, i in zip(stage.layers, stage.stage.layers, strict=True))
        assert list(stage.stage.layers) == ([0] if dims.pp_rank == 0 else [1, 2])
        assert (stage.embed is not None, stage.norm is not None) == (dims.pp_rank == 0, dims.pp_rank == 1)
        # the other rank's stage is a placeholder that is never run here
        (remote,) = [m for m, s in pp_model.partition.items() if s != dims.pp_rank]
        assert not list(remote.parameters()) and pp_model.partition[entry] == dims.pp_rank
        # the same Parameter objects as the StagedModel's (optimizer, norms, checkpoints), under the full names
        assert {id(p) for p in entry.parameters()} == {id(p) for p in model.parameters()}
        assert any(n.startswith("layers.2.") for n, _ in model.named_parameters()) == (dims.pp_rank == 1)
    with pytest.raises(ValueError, match="4 micro-batches per step, got 2"):
        ranks[0][3].train(_batches(recipe, 2, 0))


def test_zero1_is_passed_on(monkeypatch):
    recipe = load_recipe("neox-tiny", overrides=PP2)
    world, _ = _ranks(monkeypatch, recipe, micro_batches=2, zero1=True)
    assert world.built[0][0].config["use_zero1_optimizer"] and world.built[1][0].config["use_optimizer_wrapper"]


def test_a_stage_built_for_another_rank_than_nxds_is_refused(monkeypatch):
    recipe = load_recipe("neox-tiny", overrides=PP2)
    install_fake_pipeline(monkeypatch, PipeWorld(2), pp_rank=1)
    backend = NeuronXlaBackend("neuron", torch.device("cpu"))
    model = build_model_shard(recipe, dims=_dims(0), backend=backend)
    with pytest.raises(RuntimeError, match="holds pipeline stage 0, but NxD's PP rank is 1"):
        NeuronPipeline(model, 2, pp=2, zero1=False)


@pytest.mark.parametrize("recipe_name", ["neox-tiny", "llama2-tiny"])
def test_neuron_pp2_computes_what_the_unpipelined_model_computes(monkeypatch, recipe_name):
    """A PP-2 neuron run through the adapter and the stand-in (3 layers split 1 + 2, 4 micro-batches, fp32) against
    the whole model on the cpu backend's path, (loss / 4).backward() per micro-batch: the same mean loss and every
    gradient, bitwise, on the rank that holds its parameter; the evaluation loss over 3 batches likewise; NxD did
    not reduce the gradients, and the backend's step reduces them over DP once."""
    recipe = load_recipe(recipe_name, overrides=PP2)
    steps, micro, val = 2, 4, _batches(recipe, 3, seed=99)

    reference = build_model(recipe.model)
    reference.init_weights(seed=recipe.train.seed)
    world, ranks = _ranks(monkeypatch, recipe, micro_batches=micro)
    for step in range(steps):
        batches = _batches(recipe, micro, seed=step)
        total = torch.zeros(())
        for tokens in batches:
            loss = reference(tokens[:, :-1], labels=tokens[:, 1:])
            (loss / micro).backward()
            total = total + loss.detach().float()
        expected = total / micro

        losses = [pipeline.train(batches) for _, _, _, pipeline in ranks]  # rank order: the last one runs the step
        assert losses[0] is None and torch.equal(losses[1], expected), (step, losses[1], expected)
        ref_grads = {name: p.grad for name, p in reference.named_parameters()}
        held = set()
        for _, _, model, _ in ranks:
            for name, p in model.named_parameters():
                assert torch.equal(p.grad, ref_grads[name]), (step, name)
                held.add(name)
        assert held == set(ref_grads)
    # no all-reduce inside the pipeline (use_optimizer_wrapper); the step's own reduction: one DP all-reduce
    grads = sys.modules["neuronx_distributed.parallel_layers.grads"]
    assert grads.calls == []
    dims, backend, model, _ = ranks[1]
    backend.reduce_and_clip(model, dims, max_norm=0.0)
    assert [c[0] for c in grads.calls] == ["bucket_allreduce_gradients", "clip_grad_norm"]
    assert len(grads.calls[0][1]) == len(list(model.parameters()))

    with torch.no_grad():
        expected_val = sum(reference(t[:, :-1], labels=t[:, 1:]).float() for t in val) / len(val)
    val_losses = [pipeline.evaluate(val) for _, _, _, pipeline in ranks]
    assert val_losses[0] is None and torch.equal(val_losses[1], expected_val)
    assert [m.config["num_microbatches"] for m in world.built[1]] == [micro, 3]  # one NxD model per batch count
    again = [pipeline.evaluate(val) for _, _, _, pipeline in ranks]
    assert torch.equal(again[1], val_losses[1])  # the same NxD model again: one per batch count
    assert len(world.built[1]) == 2


def test_pipeline_param_norm_sums_the_stages(monkeypatch):
    """Each stage's squares summed over NxD's pipeline group (TP identity at TP 1): the whole model's norm."""
    recipe = load_recipe("neox-tiny", overrides=PP2)
    _, ranks = _ranks(monkeypatch, recipe, micro_batches=2)
    reference = build_model(recipe.model)
    reference.init_weights(seed=recipe.train.seed)
    expected = torch.cat([p.detach().double().flatten() for p in reference.parameters()]).norm().float()
    squares = [param_norm(list(model.parameters())) ** 2 for _, _, model, _ in ranks]
    seen = []

    def all_reduce(t, op=None, group=None, async_op=False):  # the other stage's contribution, as NxD's PP group sums
        seen.append(group)
        t += squares[1]

    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    dims, backend, model, _ = ranks[0]
    assert torch.allclose(backend.param_norm(model, dims), expected, rtol=1e-5)
    assert seen == ["nxd-pp-group"]


def test_training_batches_stay_on_the_host_once_a_pipeline_runs(monkeypatch):
    """NxD's pipeline uploads each micro-batch itself (MpDeviceLoader inside run_train): the backend's loader must
    not have uploaded them already."""
    recipe = load_recipe("neox-tiny", overrides=PP2)
    _, ranks = _ranks(monkeypatch, recipe, micro_batches=2)
    _, backend, _, _ = ranks[0]
    host = _batches(recipe, 2, seed=0)
    assert [b is h for b, h in zip(backend.loader(iter(host)), host, strict=True)] == [True, True]
    assert not NeuronXlaBackend("neuron", torch.device("cpu")).host_batches


@pytest.mark.parametrize("sequence_parallel", ["false", "true"])
def test_tp2_by_pp2_ranks_hold_their_stages_shards_of_the_same_model(monkeypatch, sequence_parallel):
    """NxD's TP layers on a pipeline stage: each of the 4 ranks allocates its TP shard of its stage's parameters
    only (no embedding off the first stage, no norm or head off the last); joined they are the TP-1 model."""
    over = [*PP2, "layout.tp=2", "cluster.workers_per_node=4", f"layout.sequence_parallel={sequence_parallel}"]
    recipe = load_recipe("llama2-tiny", overrides=over)
    reference = build_model(recipe.model)
    reference.init_weights(seed=recipe.train.seed)
    held: dict[str, list[torch.Tensor]] = {}
    for pp_rank in range(2):
        for tp_rank in range(2):
            install_fake_pipeline(monkeypatch, PipeWorld(2), pp_rank, tp=2, rank=tp_rank)
            dims = _dims(pp_rank, tp=2, tp_rank=tp_rank, world=4)
            model = build_model_shard(recipe, dims=dims, backend=NeuronXlaBackend("neuron", torch.device("cpu")))
            assert hasattr(model, "embed") == (pp_rank == 0) and hasattr(model, "head") == (pp_rank == 1)
            for name, p in model.named_parameters():
                held.setdefault(name, []).append(p)
    assert held.keys() == dict(reference.named_parameters()).keys()
    for name, full in reference.named_parameters():
        a, b = held[name]  # the stage's two TP ranks, and no other rank
        joined = torch.cat([a, b], dim=a.partition_dim) if getattr(a, "tensor_model_parallel", False) else a
        assert torch.equal(joined.detach(), full.detach()), name
