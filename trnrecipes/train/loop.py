"""The step loop: the same code on cpu, cuda, xla and neuron (the Amazon Search M5 post's XLA discipline applied
everywhere).

One optimizer step = grad_accum micro-batches of fixed shape [micro_batch, seq_len + 1] (under context parallelism
each rank reads its two chunks of them: SequenceChunks) (forward + backward, a graph cut after each), gradients
averaged over the DATA-parallel group only (dividing by the world size under TP is the divergence bug the 128-node
Llama 2 post reports), the global grad norm across TP shards, clipping, AdamW, and a graph cut after the optimizer
step. Validation and checkpoint passes use the same fixed shapes, so XLA compiles nothing
new after the first of each.

A checkpoint write that fails on any rank stops every rank at the next step (the writer's health rides on the
all-reduce each step already makes), with the writer's error: CheckpointWriteError for a read-only or full disk.

TRNRECIPES_CRASH_ONCE=<path>:<step>:<rank> (test-only: the Slurm requeue test) kills global rank <rank> with SIGKILL
right after optimizer step <step> (its metrics and save included) if <path> does not exist, creating it first; the
requeued run finds the file and trains on.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import math
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from trnrecipes import REPO_ROOT
from trnrecipes.backends import make_backend
from trnrecipes.checkpoint import verify
from trnrecipes.checkpoint.format import STEP_DIR, CheckpointWriteError, step_dirs
from trnrecipes.checkpoint.writer import Checkpointer, HostBuffers, snapshot
from trnrecipes.config.changes import changes_data_order
from trnrecipes.config.cluster import get_instance
from trnrecipes.config.families import family_spec
from trnrecipes.config.profiling import describe as describe_profiling
from trnrecipes.config.saved_recipe import init_from_problem
from trnrecipes.config.sections import Recipe, RecipeError
from trnrecipes.config.tracking import tracker_setting_problems
from trnrecipes.data.blend import DataPosition
from trnrecipes.data.classify import ClassificationStream
from trnrecipes.data.pack import Prefetcher, batches, split_documents
from trnrecipes.data.sources import OpenedSource, data_stream, open_labelled, open_sources
from trnrecipes.optim.schedule import lr_at
from trnrecipes.parallel.context import SequenceChunks
from trnrecipes.parallel.dims import ParallelDims, local_tensor
from trnrecipes.parallel.expert import expert_layouts, gather_experts
from trnrecipes.parallel.kv_replication import layouts as kv_layouts
from trnrecipes.parallel.kv_replication import stored_full
from trnrecipes.plan.layout import compute_layout, plan
from trnrecipes.schema import shown
from trnrecipes.train.monitor import Clock, Metrics, SpikeDetector, progress_line
from trnrecipes.train.profile import StepProfiler, rank_env
from trnrecipes.train.restore import load
from trnrecipes.train.resume_compat import check_resume
from trnrecipes.train.run_dir import (
    RunDirLock,
    record_fresh_start,
    require_writable,
    restarted_job,
    settle_checkpoints,
)
from trnrecipes.train.step_rng import step_seed
from trnrecipes.train.trackers import Outcome, TrackedRun, Tracker, open_trackers, require_packages


@dataclass
class RunResult:
    losses: list[float] = field(default_factory=list)  # per optimizer step, averaged over DP
    val_losses: dict[int, float] = field(default_factory=dict)
    compilations: list[int | None] = field(default_factory=list)  # XLA compile counter after each step
    checkpoints: list[Path] = field(default_factory=list)
    stopped_early: bool = False
    already_done: bool = False  # the run dir's checkpoint had reached the last step
    position: DataPosition | None = None


def _loss(model: torch.nn.Module, batch: torch.Tensor | SequenceChunks) -> torch.Tensor:
    """Mean next-token loss of a [b, s + 1] batch, or of a CP rank's chunks of one. Every family's forward takes
    labels: the fused head + cross-entropy, or full logits where the head is tensor parallel (recipes/common/loss.py
    decides)."""
    if isinstance(batch, SequenceChunks):
        return model(batch.tokens, labels=batch.labels, labelled=batch.labelled)
    return model(batch[:, :-1], labels=batch[:, 1:])


def compact_grads(model: torch.nn.Module) -> None:
    """Give each gradient that holds more memory than its own elements a storage of its own size.

    A compiled block's backward (inductor) may return a weight's gradient as a view into a larger buffer it reused
    (the gradient of an activation: at micro-batch 2 x 4096 tokens, the [8192, 22016] SwiGLU input's gradient holds
    the [22016, 4096] gate/up weight's). The first micro-batch's gradients become the parameters' .grad as they are,
    so that buffer stayed alive for the whole step: on an H200, 1.07B parameters at that shape, 1.3 GB more at the
    step's peak (bench_gpu --memory-snapshot). Called once after the first micro-batch's backward (later ones add
    into .grad in place), where the activations are already freed, so the copies do not raise the peak."""
    for p in model.parameters():
        g = p.grad
        if g is None:
            continue
        local = local_tensor(g)
        if local.untyped_storage().nbytes() > local.numel() * local.element_size():
            p.grad = g.clone()


def _classify(model: torch.nn.Module, batch: torch.Tensor, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean cross-entropy in fp32, number of correct predictions) of a [b, s + 1] classification batch: s padded
    tokens then the label (trnrecipes/data/classify.py); padding is masked out of attention and pooling."""
    tokens, labels = batch[:, :-1], batch[:, -1]
    logits = model(tokens, attention_mask=tokens != pad_id)
    loss = torch.nn.functional.cross_entropy(logits.float(), labels)
    return loss, (logits.detach().argmax(-1) == labels).sum().float()


class Trainer:
    def __init__(
        self,
        recipe: Recipe,
        compile_only: bool = False,
        run_dir: Path | None = None,
        log=print,
        job_dir: Path | None = None,
    ):
        self.recipe, self.compile_only = recipe, compile_only
        self.job_dir: Path | None = job_dir  # the job dir whose recipe.yaml this is: its provenance tags trackers
        require_packages(recipe.monitor.trackers)  # every rank, before anything is built
        if problems := tracker_setting_problems(recipe.monitor.trackers):
            raise RecipeError(problems[0])
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        # before the Neuron runtime starts
        rank_env(recipe, int(os.environ.get("RANK", "0")), local_rank, os.environ.get("TRNRECIPES_RUN_DIR"))
        self.backend = make_backend(recipe.runtime_backend, local_rank)
        self.dims = ParallelDims(recipe, self.backend)
        self.layout = compute_layout(recipe)
        self.log = log if self.dims.rank == 0 else (lambda *a, **k: None)
        if self.dims.zero1_unavailable:
            self.log(
                f"[trnrecipes] warning: layout.zero1 is not available on backend {self.backend.name} (valid on cpu,"
                " cuda and neuron): optimizer states stay replicated over data parallel"
            )
        env_dir = os.environ.get("TRNRECIPES_RUN_DIR")
        default = Path(recipe.run_dir) if recipe.run_dir else Path("runs") / recipe.job_name
        self.run_dir = Path(run_dir or env_dir or default)
        if not self.run_dir.is_absolute():
            self.run_dir = REPO_ROOT / self.run_dir
        self.lock: RunDirLock | None = None
        self.data_order_changed = False
        self.classify = family_spec(recipe.model.family).objective == "classification"
        self.train_correct: torch.Tensor | None = None  # classification: correct predictions in the last step
        self.val_accuracy: float | None = None  # classification: set by validate()
        resume = self._claim_run_dir()
        try:
            self._build(resume)
        except BaseException:
            self._release()  # not dims.close(): its barrier would wait for ranks that may not fail with this one
            raise

    def _build(self, resume: Path | None) -> None:
        recipe, dims = self.recipe, self.dims
        weights, source = resume, f"the checkpoint resumed from ({resume})"
        if resume is None and recipe.train.init_from:
            weights, source = self._init_from(), f"train.init_from {recipe.train.init_from}"
            self._check_init_from(weights)
        started = time.perf_counter()
        self._open_data()
        train, val = sum(len(s.train) for s in self.sources), sum(len(s.val) for s in self.sources)
        self.log(
            f"[trnrecipes] data: {len(self.sources)} source(s), {train + val:,} documents ({train:,} train,"
            f" {val:,} validation) in {time.perf_counter() - started:.1f} s",
            flush=True,
        )
        started = time.perf_counter()
        what = f"loading {source}" if weights is not None else f"initialised from train.seed {recipe.train.seed}"
        self.log(f"[trnrecipes] building the model ({what}) ...", flush=True)
        state = load(
            weights,
            recipe,
            dims=dims,
            backend=self.backend,
            num_docs=self.num_docs,
            weights_only=resume is None,
            keep_optimizer=resume is None and recipe.train.init_optimizer == "keep",
            source=source,
            allowed=recipe.checkpoint.allow_changes,
            data_order_changed=self.data_order_changed,
            log=self.log,
        )
        self.model, self.optimizer = state.model, state.optimizer
        self.log(f"[trnrecipes] model ready in {time.perf_counter() - started:.1f} s", flush=True)
        # Pipeline parallelism: this rank's stages run under the backend's schedule, one micro-batch per accum step.
        self.pipeline = self.backend.pipeline(self.model, recipe, dims, self.layout.grad_accum) if dims.pp > 1 else None
        # Compiled blocks' gradients may hold buffers bigger than themselves (compact_grads); FSDP makes its own.
        self.compacts_grads = self.backend.compiles(recipe) and not dims.fsdp
        self.start_step, self.start_position = state.step, state.position
        if resume is not None:
            self.log(f"[trnrecipes] resuming from {resume} (step {self.start_step})")
        self.host = HostBuffers()
        self.checkpointer = Checkpointer(
            self.run_dir / "checkpoints",
            recipe,
            self.tokenizer.path,
            self.dims.rank,
            self.dims.world,
            recipe.checkpoint.keep_last,
            recipe.checkpoint.async_save,
            self.log,
            newest_valid=self.start_step if resume is not None else None,
        )

    def _check_init_from(self, path: Path) -> None:
        """Rank 0 verifies the checkpoint to fine-tune from (every file's hash: for a 70B model ~140 GB read, once
        per job rather than once per rank) and compares its model section with the recipe's; every rank learns
        the outcome, so an error stops them all instead of leaving them waiting in a collective."""
        error = None
        if self.dims.rank == 0:
            try:
                verify(path)
                if problem := init_from_problem(self.recipe, path):  # sbatch asked the same (jobs/data_check.py)
                    raise RecipeError(problem)
            except RecipeError as err:
                error = err
        (failed,) = self.dims.max_over_ranks([error is not None], self.backend.device)
        if error is not None:
            raise error
        if failed:
            raise RecipeError(f"rank 0 refused train.init_from {path} (its message says why)")

    def _claim_run_dir(self) -> Path | None:
        """Rank 0 locks the run dir for the whole run and settles the checkpoints already in it (run_dir.py): the
        one to resume from (auto-resume, checkpoint.resume, on by default), checked against this recipe. Every rank
        learns the outcome: an error on rank 0 stops them all instead of leaving them waiting in a collective.
        Compile mode writes nothing and takes nothing."""
        if self.compile_only:
            return None
        c, root = self.recipe.checkpoint, self.run_dir / "checkpoints"
        error, step, reorder = None, -1, False
        if self.dims.rank == 0:
            try:
                require_writable(self.run_dir)
                self.lock = RunDirLock(self.run_dir, self.log).acquire()
                restarted = restarted_job(self.run_dir)  # a requeue resumes its own checkpoints, never archives
                if c.force_fresh and not c.resume and not restarted:
                    self._refuse_init_from_inside(root)
                found = settle_checkpoints(root, c.resume, c.force_fresh, self.log, restarted=restarted)
                if found is None and not c.resume:
                    record_fresh_start(self.run_dir)  # which job started it: that job's restarts resume
                if found is not None:
                    tokenizer = REPO_ROOT / self.recipe.data.tokenizer  # an absolute path stays itself
                    accepted = check_resume(found[1], self.recipe.to_dict(), tokenizer, c.allow_changes, self.log)
                    step, reorder = found[0], changes_data_order(accepted)
            except RecipeError as err:
                error = err
            except OSError as err:  # the run dir's file system, not a checkpoint: say which file, no traceback
                error = RecipeError(f"run dir {self.run_dir}: {err.strerror or err} ({shown(err.filename)})")
            except BaseException:
                self._release()
                raise
        failed, step, reorder = self.dims.max_over_ranks([error is not None, step, reorder], self.backend.device)
        self.data_order_changed = bool(reorder)
        if error is not None:
            self._release()
            raise error
        if failed:
            raise RecipeError(f"rank 0 refused the run dir {self.run_dir} (its message says why)")
        return root / f"step_{step}" if step >= 0 else None

    # ------------------------------------------------------------------ data
    def _open_data(self) -> None:
        d, b = self.recipe.data, self.recipe.batch
        seed = self.recipe.train.seed
        if self.classify:
            documents, self.tokenizer = open_labelled(self.recipe, REPO_ROOT)
            train, val = split_documents(documents.num_docs, d.val_fraction, seed, source=d.path)
            self.sources = [OpenedSource(d.path, 1.0, documents, train, val)]
        else:
            self.sources, self.tokenizer = open_sources(d, REPO_ROOT, seed, self.recipe.model.vocab_size)
        for i, s in enumerate(self.sources):  # found now, not after the model is built and restored
            if len(s.train) < self.dims.dp:
                name = f"data.sources[{i}] {s.path}" if d.sources else f"data.path {s.path}"
                raise RecipeError(
                    f"{name}: {len(s.train)} training document(s) cannot be shared by {self.dims.dp} data-parallel"
                    " ranks (each reads its own); use a corpus with more documents"
                )
        counts = [s.documents.num_docs for s in self.sources]
        self.num_docs = counts[0] if len(counts) == 1 else counts  # what the saved data positions index
        if self.tokenizer.vocab_size > self.recipe.model.vocab_size:
            raise RecipeError(
                f"tokenizer {d.tokenizer} has {self.tokenizer.vocab_size} ids but model.vocab_size is"
                f" {self.recipe.model.vocab_size}"
            )
        # Validation: the same fixed batches every time (a fresh stream from its start), split over DP ranks; a
        # blend's from every source by the same weights.
        held_out = min(len(s.val) for s in self.sources)
        fewest = min(self.sources, key=lambda s: len(s.val)).path  # names the corpus where a message needs one
        val_dp = min(self.dims.dp, held_out) if held_out else 0
        if self.classify and val_dp:  # one sample per document: more batches than documents would count some twice
            per_rank, wanted = held_out // val_dp, self.recipe.train.val_batches * b.micro_batch
            if wanted > per_rank:
                raise RecipeError(
                    f"train.val_batches {self.recipe.train.val_batches} x batch.micro_batch {b.micro_batch} = {wanted}"
                    f" validation examples per data-parallel rank, but data.val_fraction {d.val_fraction} holds out"
                    f" {held_out} of {counts[0]} documents ({per_rank} per rank over"
                    f" {val_dp}): raise data.val_fraction or lower train.val_batches"
                )
        # FSDP's forward gathers over DP, expert parallelism's exchanges tokens in its group: every rank must run it
        if (self.dims.fsdp or self.dims.ep > 1) and 0 < val_dp < self.dims.dp:
            under = "layout.fsdp" if self.dims.fsdp else f"layout.ep {self.dims.ep}"
            raise RecipeError(
                f"data.val_fraction {d.val_fraction} leaves {held_out} validation document(s) of {fewest} for"
                f" {self.dims.dp} data-parallel ranks; under {under} each rank needs one: raise data.val_fraction"
            )
        self.val_batches: list[torch.Tensor | SequenceChunks] = []
        self.validates = bool(val_dp)  # data.val_fraction 0 holds nothing out: no validation (not a NaN loss)
        if val_dp and self.dims.dp_rank < val_dp:
            it = batches(self._stream("val", 0, self.dims.dp_rank, val_dp, None), b.micro_batch)
            self.val_batches = [
                self.rank_batch(torch.from_numpy(next(it)[0])) for _ in range(self.recipe.train.val_batches)
            ]
        if self.classify and val_dp:
            self._log_majority_class()

    def _log_majority_class(self) -> None:
        """Log the validation examples' most frequent class and its share: the accuracy a model that learned nothing
        reaches, the number val acc must beat. A collective (class counts summed over every rank: each TP copy of a
        replica adds its counts once more, which the share cancels)."""
        counts = torch.zeros(self.recipe.model.num_labels)
        if self.dims.holds_loss:
            for batch in self.val_batches:  # each sample's label is its last column, as _classify reads it
                counts += torch.bincount(batch[:, -1], minlength=len(counts)).float()
        counts = self.dims.sum_over_ranks(counts, self.backend.device)
        share = float(counts.max() / counts.sum())
        self.log(
            f"[trnrecipes] validation: majority class {int(counts.argmax())} at {share:.3f} of the examples"
            f" (the accuracy of a model that learned nothing: val acc must beat it)"
        )

    def rank_batch(self, samples: torch.Tensor) -> torch.Tensor | SequenceChunks:
        """What this rank reads (and its loader moves to the device) of a micro-batch of packed samples [b, s + 1]:
        all of it, or under context parallelism its two chunks of each sample (packed at the full length: where
        documents start is a property of the whole sample)."""
        if self.dims.cp == 1:
            return samples
        return SequenceChunks.of(samples, self.dims.cp, self.dims.cp_rank)

    def _stream(self, part: str, seed: int, dp_rank: int, dp: int, start):
        """Packed text (one token stream cut into samples; several sources blended by weight) or one padded,
        labelled sample per document, of the sources' `part` ("train" or "val")."""
        if self.classify:
            s = self.sources[0]
            return ClassificationStream(s.documents, getattr(s, part), seed, dp_rank, dp, True, start)
        return data_stream(self.sources, part, self.recipe.batch.seq_len, seed, dp_rank, dp, start)

    def _train_loader(self, start: DataPosition | None):
        b, dims = self.recipe.batch, self.dims
        seed = self.recipe.train.seed
        stream = self._stream("train", seed, dims.dp_rank, dims.dp, start)
        self._prefetch = Prefetcher(batches(stream, b.micro_batch))
        positions: collections.deque[DataPosition] = collections.deque()

        def host_batches():
            for array, position in self._prefetch:
                positions.append(position)  # popped in the same order as the batches are consumed
                yield self.rank_batch(torch.from_numpy(array))

        return self.backend.loader(host_batches()), positions

    # ------------------------------------------------------------------ steps
    def _autocast(self):
        if self.recipe.precision.dtype != "bf16-mixed":
            return contextlib.nullcontext()
        return torch.autocast(self.backend.device.type, dtype=torch.bfloat16)

    def accumulate(self, loader, grad_accum: int) -> torch.Tensor:
        """Forward + backward over grad_accum micro-batches; returns their mean loss (this rank's; with pipeline
        stages, the last stage's, and 0 on the others, which mean_over_holders does not count)."""
        self.model.train()
        if self.pipeline is not None:
            with self._autocast():
                loss = self.pipeline.train([next(loader) for _ in range(grad_accum)])
            self.backend.sync()
            return loss if loss is not None else torch.zeros((), device=self.backend.device)
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.backend.device)
        correct = torch.zeros((), dtype=torch.float32, device=self.backend.device)
        for i in range(grad_accum):
            with self._autocast():
                loss, right = self._forward(next(loader))
            if right is not None:
                correct = correct + right
            (loss / grad_accum).backward()
            if i == 0 and self.compacts_grads:
                compact_grads(self.model)
            loss_sum = loss_sum + loss.detach().float()
            self.backend.sync()  # cut: one forward+backward graph, reused by every micro-batch
        self.train_correct = correct if self.classify else None
        return loss_sum / grad_accum

    def _forward(self, batch: torch.Tensor | SequenceChunks) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(mean loss, correct predictions or None for a language model) of one micro-batch."""
        if self.classify:
            return _classify(self.model, batch, self.recipe.model.pad_token_id)
        return _loss(self.model, batch), None

    def reduce_and_clip(self) -> torch.Tensor:
        """Average gradients over the DP group, then clip by the global norm (all TP shards); returns the norm."""
        return self.backend.reduce_and_clip(self.model, self.dims, self.recipe.optim.clip_grad_norm)

    def optimizer_step(self, step: int) -> None:
        """The optimizer step alone, after reduce_and_clip (tests drive the two halves separately; under NxD's zero-1
        optimizer, whose step reduces and clips again, use train_step)."""
        self.optimizer.set_lr(lr_at(step, self.recipe.optim))
        self.backend.optimizer_step(self.optimizer, self.dims)
        self.optimizer.zero_grad()
        self.backend.sync()

    def train_step(self, step: int, loader, grad_accum: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step: (this rank's mean loss, the global grad norm before clipping)."""
        dims = self.dims
        # step_rng.py; a replica's CP ranks hold other tokens, so each draws its own: the rank's index among the
        # dp x cp ranks (ParallelDims.shard_rank; at CP 1 the DP rank)
        self.backend.seed_rng(step_seed(self.recipe.train.seed, step, dims.shard_rank, dims.pp_rank))
        loss = self.accumulate(loader, grad_accum)
        self.optimizer.set_lr(lr_at(step, self.recipe.optim))
        grad_norm = self.backend.step(self.model, self.optimizer, self.dims, self.recipe.optim.clip_grad_norm)
        self.optimizer.zero_grad()
        self.backend.sync()  # cut: the optimizer step is the second graph
        return loss, grad_norm

    @torch.no_grad()
    def validate(self) -> float:
        self.model.eval()
        if self.pipeline is not None:
            with self._autocast():
                mean = self.pipeline.evaluate(self.val_batches) if self.val_batches else None
            local = mean.cpu() if mean is not None else torch.zeros(())
        else:
            total = torch.zeros((), dtype=torch.float32, device=self.backend.device)
            correct = torch.zeros((), dtype=torch.float32, device=self.backend.device)
            for batch in self.val_batches:
                with self._autocast():
                    loss, right = self._forward(batch.to(self.backend.device))
                    total = total + loss.float()
                if right is not None:
                    correct = correct + right
                self.backend.sync()
            local = total.cpu() / max(1, len(self.val_batches))
        held = bool(self.val_batches) and self.dims.holds_loss
        counted = torch.tensor([float(local) if held else 0.0, float(held)])
        if self.classify:  # correct predictions and examples seen, summed like the loss
            seen = len(self.val_batches) * self.recipe.batch.micro_batch if held else 0
            counted = torch.cat([counted, torch.tensor([float(correct) if held else 0.0, float(seen)])])
        # Each DP replica's loss arrives once per TP rank: the TP copies cancel in the ratio.
        counted = self.dims.sum_over_ranks(counted, self.backend.device)
        if self.classify:
            self.val_accuracy = float(counted[2] / counted[3])
        return float(counted[0] / counted[1])

    def _train_accuracy(self) -> float:
        """The last step's accuracy over the whole global batch (every DP rank's micro-batches)."""
        seen = self.layout.grad_accum * self.recipe.batch.micro_batch
        counted = torch.stack([self.train_correct.detach().float().cpu(), torch.tensor(float(seen))])
        counted = self.dims.sum_over_ranks(counted, self.backend.device)
        return float(counted[0] / counted[1])

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """CPU weights with their TP shards (and expert-parallel experts) gathered (under PP: this rank's stages
        only). A collective: every rank takes part."""
        replicated = kv_layouts(self.model)  # replicated KV heads: in the stored layout, each once
        weights = {k: stored_full(v, replicated.get(k)).detach().cpu() for k, v in self.model.state_dict().items()}
        for k, shard in expert_layouts(self.model).items():
            weights[k] = gather_experts(weights[k], shard, self.dims.ep_group)
        return weights

    def save(self, step: int, position: DataPosition | None) -> None:
        """Copy this rank's state to host memory (the only part the step waits for) and hand it to the writer.
        Compile mode traces the same copies (and TP gathers) and writes nothing."""
        self.checkpointer.join()  # the previous writer may still read the host buffers this copy reuses
        files = snapshot(
            self.model,
            self.optimizer,
            self.dims,
            step,
            position,
            self.recipe,
            self.host,
            num_docs=self.num_docs,
            shard_dim=self.backend.shard_dim,
        )
        if not self.compile_only:
            self.checkpointer.save(step, files)

    def _dp_mean(self, value: torch.Tensor) -> float:
        return self.dims.mean_over_holders(value, self.backend.device)

    # ------------------------------------------------------------------ run
    def run(self, max_steps: int | None = None) -> RunResult:
        r, lay = self.recipe, self.layout
        steps = r.compile.steps if self.compile_only else (max_steps or r.train.max_steps)
        result = RunResult(position=self.start_position)
        crash = _crash_once(os.environ.get("TRNRECIPES_CRASH_ONCE"))
        if self.start_step >= steps:
            self.log(f"[trnrecipes] {r.name}: already trained to step {self.start_step} of {steps}; nothing to do")
            result.already_done = True  # a success: a requeue after the last save must not fail the job
            return result
        spikes = SpikeDetector()
        profiler = StepProfiler(
            r,
            self.run_dir,
            self.dims.rank,
            int(os.environ.get("LOCAL_RANK", "0")),
            self.backend.device.type,
            log=print,  # every profiling rank says where its trace is
            enabled=not self.compile_only,
        )
        stop_file = os.environ.get("TRNRECIPES_STOP_FILE")
        loader, positions = self._train_loader(self.start_position)
        mode = "compile (tracing every graph; nothing is written)" if self.compile_only else "train"
        dp_mode = " (FSDP)" if self.dims.fsdp else " (ZeRO-1)" if self.dims.zero1 else ""
        dp_mode += f" (experts over EP {self.dims.ep})" if self.dims.ep > 1 else ""
        dp_mode += f" x CP {lay.cp}" if lay.cp > 1 else ""
        compiled = "; torch.compile per block" if self.backend.compiles(r) else ""
        self.log(
            f"[trnrecipes] {mode}: {r.name} on {self.backend.name}{compiled}, {self.dims.world} rank(s) = PP {lay.pp}"
            f" x DP {lay.dp}{dp_mode} x TP {lay.tp}; global batch {r.batch.global_batch} = micro {r.batch.micro_batch}"
            f" x accum {lay.grad_accum} x DP {lay.dp}; steps {self.start_step + 1}-{steps}; run dir {self.run_dir}"
        )
        tokens_per_step = r.batch.global_batch * r.batch.seq_len
        every_s = r.checkpoint.every_minutes * 60 if r.checkpoint.every_minutes else None
        last_save = time.monotonic()
        # Opened just before the loop, whose `finally` closes them: a failure before (the data loader's) leaves no
        # tracker run open.
        metrics = Metrics(
            self.run_dir,
            enabled=self.dims.rank == 0 and not self.compile_only,
            tensorboard="tensorboard" in r.monitor.trackers,
            previous=self._previous_phase(),
            resumed_from=self.start_step,  # the records of steps beyond it are retrained: they leave metrics.jsonl
        )
        outcome: Outcome = "failed"
        if metrics.enabled:
            try:
                metrics.trackers = self._open_trackers(metrics.history_offset)
            except BaseException:
                metrics.close(outcome)
                raise
        for norm in metrics.grad_norms_at_resume:  # as if the run had not stopped: its window and its count
            spikes.update(norm)
        signals = _catch_stop_signals()
        clock = Clock(self.start_step, steps)
        # tokens before this launch: as the resumed step's record says (the batch or length may have changed since)
        tokens_before = metrics.tokens_at_resume
        if tokens_before is None:
            tokens_before = self.start_step * tokens_per_step
        if (profiling := describe_profiling(r)) and not self.compile_only:
            self.log(f"[trnrecipes] {profiling}")
        self.log(
            f"[trnrecipes] step {self.start_step + 1}: the first step builds its graphs (on XLA and Neuron it traces"
            " and compiles them: minutes for a large model); its line follows",
            flush=True,
        )
        try:
            for step in range(self.start_step, steps):
                start = time.perf_counter()
                with profiler.start_step(step + 1):
                    loss, grad_norm = self.train_step(step, loader, lay.grad_accum)
                for _ in range(lay.grad_accum):  # where the data stream stands after this step's batches
                    result.position = positions.popleft()
                loss_value = self._dp_mean(loss)
                elapsed = time.perf_counter() - start
                result.losses.append(loss_value)
                if not math.isfinite(loss_value):
                    raise FloatingPointError(f"loss is {loss_value} at step {step + 1}; stopping")
                norm_value = float(grad_norm.cpu())  # the global norm: the same on every rank
                if not math.isfinite(norm_value):  # the update applied it: the weights are not finite either
                    raise FloatingPointError(
                        f"grad norm is {norm_value} at step {step + 1} (loss {loss_value:.4g}); stopping before this"
                        " step's weights are saved over the last good checkpoint"
                    )
                record = {
                    "step": step + 1,
                    "loss": loss_value,
                    "grad_norm": norm_value,
                    "lr": lr_at(step, r.optim),
                    "tokens_per_s": tokens_per_step / elapsed,
                    "seq_per_s": r.batch.global_batch / elapsed,
                    "step_time_s": elapsed,
                }
                cost = plan(r, seq_per_s=record["seq_per_s"])
                record["mfu"], record["tokens_per_dollar"] = cost["mfu"], cost["tokens_per_dollar"]
                if r.cluster.backend == "cpu":  # the host's cores the workers' threads use, not the catalog's 2
                    record["mfu"] = cost["mfu"] * cost["peak_tflops"] / cpu_peak_tflops(r, lay.workers_per_node)
                record["spike"] = spikes.update(record["grad_norm"])
                if profiler.profiled(step + 1):
                    record["profiled"] = True  # its time includes the profiler's
                if hasattr(self.model, "router_health"):  # a mixture of experts: this rank's last micro-batch
                    record |= self.model.router_health()
                if self.classify:
                    record["accuracy"] = self._train_accuracy()
                last = step + 1 == steps
                first = self.compile_only and step == self.start_step  # compile: trace validation and saving once
                # Decisions only some ranks can see (a stop file, a signal, the clock) are agreed on by all ranks.
                stop_seen = bool(stop_file and os.path.exists(stop_file)) or signals.caught is not None
                time_due = every_s is not None and time.monotonic() - last_save >= every_s
                stop, time_due = self._agree(stop_seen, time_due)
                if self.validates and ((step + 1) % r.train.val_every == 0 or last or first):
                    record["val_loss"] = result.val_losses[step + 1] = self.validate()
                    if self.val_accuracy is not None:
                        record["val_accuracy"] = self.val_accuracy
                record["tokens_seen"] = tokens_before + (step + 1 - self.start_step) * tokens_per_step
                record["elapsed_s"], record["eta_s"] = clock.tick(step + 1)
                if (step + 1) % r.train.log_every == 0 or last or "val_loss" in record:
                    record["param_norm"] = float(self.backend.param_norm(self.model, self.dims).cpu())
                    self.log(progress_line(record, steps), flush=True)
                metrics.log(record)  # before the save: a checkpoint at step N always has step N's record
                profiler.end_step(step + 1)
                if (step + 1) % r.checkpoint.every_steps == 0 or last or first or time_due or stop:
                    self.save(step + 1, result.position)
                    last_save = time.monotonic()
                result.compilations.append(self.backend.compilations())
                if crash is not None and (step + 1, self.dims.rank) == crash[1:] and not crash[0].exists():
                    crash[0].write_text(f"{step + 1}\n")
                    os.kill(os.getpid(), signal.SIGKILL)
                if stop and not last:
                    self._finish_saves()
                    if self.dims.rank == 0 and stop_file:
                        Path(stop_file + ".saved").write_text(f"{step + 1}\n")
                    why = signals.caught or "stop file"
                    self.log(f"[trnrecipes] stop requested ({why}): saved at step {step + 1}, exiting")
                    result.stopped_early = True
                    break
            self._finish_saves()  # exit waits for every save
            if spikes.spikes:
                self.log(f"[trnrecipes] grad-norm spikes: {spikes.summary()}")
            outcome = "stopped" if result.stopped_early else "finished"
        finally:
            signals.restore()
            self._prefetch.close()
            metrics.close(outcome)
            profiler.close()
        result.checkpoints = list(self.checkpointer.saved)
        return result

    def _refuse_init_from_inside(self, root: Path) -> None:
        """checkpoint.force_fresh moves the run dir's checkpoints/ to archived/<time>/ before init_from is read: a
        train.init_from inside it would be gone when loaded, after the move. Refused before anything moves."""
        if not self.recipe.train.init_from or not step_dirs(root):  # nothing to move: nothing moves
            return
        ckpt, checkpoints = os.path.realpath(self._init_from()), os.path.realpath(root)
        if os.path.commonpath([ckpt, checkpoints]) == checkpoints:
            raise RecipeError(
                f"train.init_from {self.recipe.train.init_from} is in this run dir's {root}, which"
                " checkpoint.force_fresh moves to archived/ first: start the new run in another run_dir (init_from"
                " stays where it is), or copy the checkpoint out of the run dir and point train.init_from at the copy"
            )

    def _init_from(self) -> Path:
        """train.init_from; a relative path is taken from the repository root, like the data paths."""
        path = Path(self.recipe.train.init_from)
        return path if path.is_absolute() else REPO_ROOT / path

    def _open_trackers(self, history_offset: int) -> list[Tracker]:
        """MLflow and W&B runs (monitor.trackers), reopened where this run dir has them: rank 0 only."""
        r = self.recipe
        provenance = {}
        with contextlib.suppress(OSError, ValueError, TypeError):  # no job dir, or none of ours: no provenance tags
            provenance = dict(json.loads((self.job_dir / "provenance.json").read_text()))
            provenance.pop("files", None)  # the scripts' sha256, for re-rendering: not what a run is searched by
        run = TrackedRun(r.name, self.run_dir, r.to_dict(), provenance, self.start_step + history_offset)
        return open_trackers(r.monitor.trackers, run, r.monitor.mlflow_experiment, r.monitor.wandb_project)

    def _previous_phase(self) -> tuple[Path, int] | None:
        """(the metrics.jsonl of the run train.init_from's checkpoint came from, that checkpoint's step): this run
        continues that one as its next phase (monitor.Metrics). None without init_from."""
        if not self.recipe.train.init_from:
            return None
        ckpt = self._init_from()
        step = STEP_DIR.match(ckpt.name)
        if ckpt.parent.name != "checkpoints" or step is None:
            return None  # not a run dir's checkpoint: no history to continue
        return ckpt.parent.parent / "metrics.jsonl", int(step.group(1))

    def _agree(self, stop_seen: bool, due: bool) -> tuple[bool, bool]:
        """Element-wise max over ranks of two flags, with the checkpoint writer's health: a rank whose write failed
        stops every rank here, together (one all-reduce of the same shape at every call: no new XLA graph). The
        failure travels as 2 x (rank + 1) + (1 if the storage's): the other ranks stop with the same kind of error.
        Compile mode writes nothing and its collectives may return placeholders (graph extraction): flags only."""
        ckpt = self.checkpointer
        failed = 2 * (self.dims.rank + 1) + ckpt.failed_on_storage() if ckpt.failed() else 0
        stop, due, failure = self.dims.max_over_ranks([stop_seen, due, failed], self.backend.device)
        if failure and not self.compile_only:
            ckpt.give_up(failure // 2 - 1, storage=bool(failure % 2))
        return bool(stop), bool(due)

    def _finish_saves(self) -> None:
        """Wait for the save in flight on every rank, the ranks agreeing as they wait: rank 0, which waits for the
        others' files, learns of a rank whose write failed even if that rank could not say so on disk."""
        if self.compile_only:  # nothing is written; no loop on values graph extraction may not compute
            return
        while self._agree(False, self.checkpointer.busy())[1]:
            time.sleep(0.05)
        self.checkpointer.wait()

    def _release(self) -> None:
        """The lock goes last: a background save still finalizing or pruning must finish under it. A failed save
        is logged here (the run already stops on another error, or reported this one)."""
        checkpointer = getattr(self, "checkpointer", None)
        if checkpointer is not None:
            try:
                checkpointer.wait()
            except (RuntimeError, CheckpointWriteError) as err:
                self.log(f"[trnrecipes] {err}")
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def close(self) -> None:
        self._release()
        self.dims.close()


def cpu_peak_tflops(r: Recipe, workers_per_node: int) -> float:
    """The fp32 peak a CPU run's workers can reach on this host: the catalog's per-core figure (AVX2: 2 FMA units x
    8 lanes x 2 FLOPs x ~3 GHz) for each core their threads use (a lone worker's torch threads take every core;
    torchrun gives each of several workers one), doubled where the CPU has AVX-512. A worker's MFU against one
    catalog worker's peak read 109-162% on an AVX-512 host."""
    inst = get_instance(r.cluster.instance)
    per_core = inst.peak_bf16_tflops / inst.workers_per_node
    cores = min(os.cpu_count() or 1, workers_per_node * torch.get_num_threads())
    return per_core * (2 if _avx512() else 1) * cores * r.cluster.nodes


@functools.cache
def _avx512() -> bool:
    try:
        return " avx512f " in Path("/proc/cpuinfo").read_text().replace("\n", " ")
    except OSError:
        return False


class _catch_stop_signals:
    """SIGTERM (scancel, torchrun forwarding a shutdown) and SIGUSR1 (Slurm's pre-timeout signal sent to the
    steps): finish the step, save, exit. Outside the main thread (tests) nothing is installed."""

    def __init__(self):
        self.caught: str | None = None
        self._old = {}
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            self._old[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, _frame) -> None:
        self.caught = signal.Signals(signum).name

    def restore(self) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


def _crash_once(value: str | None) -> tuple[Path, int, int] | None:
    """TRNRECIPES_CRASH_ONCE=<path>:<step>:<rank> (test-only; the module docstring says what it does)."""
    if not value:
        return None
    try:
        path, step, rank = value.rsplit(":", 2)
        crash = Path(path), int(step), int(rank)
    except ValueError:
        crash = None
    if crash is None or not path or crash[1] < 1 or crash[2] < 0:
        raise RecipeError(
            f"TRNRECIPES_CRASH_ONCE={shown(value)}: expected <path>:<step>:<rank>, a file, an optimizer step >= 1 and"
            " a global rank >= 0 (e.g. /tmp/crashed:5:0)"
        )
    return crash


def train(recipe: Recipe, compile_only: bool = False, job_dir: Path | None = None) -> RunResult:
    trainer = Trainer(recipe, compile_only, job_dir=job_dir)
    try:
        result = trainer.run()
    except BaseException:
        # No closing barrier: the other ranks may not stop with this one, and this rank's exit ends the job
        # (torchrun) where a barrier would wait for them.
        trainer._release()
        raise
    trainer.close()
    return result
