"""Writing training checkpoints: what each rank contributes, and the background writer (which prunes to keep-last-K
after each save, trnrecipes.train.run_dir.prune). Reading them back: trnrecipes.checkpoint.load.

Every rank writes its own files into checkpoints/.step_N.tmp/ and then a `.rank-R.ok` marker; rank 0 waits for all
markers, adds recipe, tokenizer, manifest and `done`, and renames the directory to step_N (checkpoint/format.py).
Writing happens in a background thread: the step loop only pays for copying tensors to host memory. No collective
is used by the writer, so it never races the training step's collectives.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from trnrecipes.checkpoint.format import (
    SHARDS,
    CheckpointError,
    data_file,
    finalize,
    hash_and_sync,
    rng_file,
    shard_file,
    stage_shards_file,
    verify,
    write_common,
)
from trnrecipes.fsdp import tp_local
from trnrecipes.recipe import Recipe
from trnrecipes.stages import pipeline_stages
from trnrecipes.train.parallel_dims import local_tensor
from trnrecipes.train.run_dir import prune, step_dirs

RANK_WAIT_S = 3600.0  # rank 0 waits this long for the other ranks' files before giving up on a checkpoint


def latest_checkpoint(root: Path, log=print) -> tuple[int, Path] | None:
    """The newest step_N that verifies, for readers (eval, convert): unusable ones are reported and left alone.
    The trainer settles its run dir with run_dir.settle_checkpoints instead."""
    for step, path in step_dirs(root):
        try:
            verify(path)
        except CheckpointError as err:
            log(f"[trnrecipes] checkpoint {path.name} is unusable, trying the one before: {err}")
            continue
        return step, path
    return None


class Checkpointer:
    def __init__(
        self,
        root: Path,
        recipe: Recipe,
        tokenizer_dir: Path | None,
        rank: int,
        world: int,
        keep_last: int,
        async_save: bool,
        log=print,
        newest_valid: int | None = None,
    ):
        """newest_valid: the step of the checkpoint this run resumed from (verified), if any; pruning counts only
        checkpoints at or below a step known to be valid (run_dir.prune)."""
        self.root, self.recipe, self.tokenizer_dir = root, recipe, tokenizer_dir
        self.newest_valid = newest_valid
        self.rank, self.world, self.keep_last, self.async_save, self.log = rank, world, keep_last, async_save, log
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.saved: list[Path] = []

    def save(self, step: int, files: dict[str, object]) -> None:
        """Hand this rank's files (name -> {tensor name: CPU tensor} or a JSON-able dict) to the writer."""
        self.wait()  # one save in flight at a time: the next waits for the previous
        if self.async_save:
            self._thread = threading.Thread(target=self._write_guarded, args=(step, files), name=f"ckpt-{step}")
            self._thread.start()
        else:
            self._write(step, files)

    def busy(self) -> bool:
        """Whether a background save is still being written."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"writing a checkpoint failed: {error}") from error

    def _write_guarded(self, step: int, files: dict[str, object]) -> None:
        try:
            # Lowest CPU priority for this thread only (Linux threads have their own nice value): on a busy host
            # the writer takes idle cycles instead of slowing the training step it runs beside.
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
        try:
            self._write(step, files)
        except BaseException as err:
            self._error = err

    def _write(self, step: int, files: dict[str, object]) -> None:
        tmp = self.root / f".step_{step}.tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        digests = write_files(tmp, files)
        # The marker carries this rank's digests: rank 0 never reads another rank's shards back. Renamed into
        # place, so rank 0 (which polls for it) never reads it half-written.
        marker = tmp / f".rank-{self.rank}.ok"
        marker.with_suffix(".tmp").write_text(json.dumps(digests))
        os.replace(marker.with_suffix(".tmp"), marker)
        if self.rank != 0:
            return
        deadline = time.monotonic() + RANK_WAIT_S
        markers = [tmp / f".rank-{r}.ok" for r in range(self.world)]
        while not all(m.exists() for m in markers):
            if time.monotonic() > deadline:
                raise CheckpointError(f"{tmp}: not every rank wrote its files within {RANK_WAIT_S:.0f} s")
            time.sleep(0.02)
        for m in markers:
            digests.update(json.loads(m.read_text()))
            m.unlink()
        out = self.root / f"step_{step}"
        if out.exists():  # the same step saved twice (a stop request on a checkpoint step): keep the first
            shutil.rmtree(tmp)
            return
        write_common(tmp, self.recipe, self.tokenizer_dir)
        finalize(tmp, out, step, digests)
        self.saved.append(out)
        self.log(f"[trnrecipes] saved checkpoint {out}")
        self.newest_valid = max(step, self.newest_valid or 0)
        try:  # the checkpoint is saved; a failed prune costs disk space, not the run
            prune(self.root, self.keep_last, self.newest_valid, self.log)
        except (OSError, CheckpointError) as err:
            self.log(f"[trnrecipes] warning: pruning old checkpoints failed: {err}")


def write_files(directory: Path, files: dict[str, object]) -> dict[str, str]:
    """A rank's snapshot() files in `directory` (tensors as safetensors, the rest as JSON), each fsync'd; returns
    their sha256 digests by name."""
    digests = {}
    for name, content in files.items():
        if name.endswith(".safetensors"):
            save_file(content, directory / name)
        else:
            (directory / name).write_text(json.dumps(content, indent=1) + "\n")
        digests[name] = hash_and_sync(directory / name)
    return digests


def rng_state(sr_generator: torch.Generator | None) -> dict[str, torch.Tensor]:
    state = {"torch_cpu": torch.get_rng_state()}
    if sr_generator is not None:
        state["stochastic_rounding"] = sr_generator.get_state()
    return state


# ---- what goes in (layout-agnostic: each tensor's place in its full tensor is saved, checkpoint/load.py re-slices)


def shard_dims(model: torch.nn.Module, shard_dim: Callable[[torch.Tensor], int | None]) -> dict[str, int | None]:
    """shard_dim (the backend's) of every state_dict entry, read from the Parameters: state_dict() detaches, and a
    detached tensor has lost neuronx-distributed's tensor_model_parallel / partition_dim attributes."""
    params = dict(model.named_parameters())
    return {k: shard_dim(params.get(k, v)) for k, v in model.state_dict().items()}


class HostBuffers:
    """Host copies of device state for the writer. A copy is needed (on CPU the next step updates the very tensors
    in place); reusing the same buffers from save to save avoids faulting in fresh pages each time, which is most
    of a large copy's cost. The caller must not refill them while a writer still reads them (Checkpointer.wait)."""

    def __init__(self):
        self.buffers: dict[str, torch.Tensor] = {}

    def copy(self, key: str, t: torch.Tensor) -> torch.Tensor:
        local = local_tensor(t).detach()
        buf = self.buffers.get(key)
        if buf is None or buf.shape != local.shape or buf.dtype != local.dtype:
            buf = self.buffers[key] = torch.empty(local.shape, dtype=local.dtype, device="cpu")
        return buf.copy_(local)


def snapshot(
    model,
    optimizer,
    dims,
    step: int,
    position,
    recipe: Recipe,
    host: HostBuffers,
    *,
    num_docs: int,
    shard_dim: Callable[[torch.Tensor], int | None],
) -> dict[str, object]:
    """This rank's files for checkpoint `step`: weights from DP rank 0 of each TP group of each pipeline stage (one
    file per stage x TP rank; under FSDP gathered over DP first); moments likewise, or under ZeRO-1 and FSDP from
    every rank (its rows); shard dims from the first rank of each stage; the data position from the first stage's
    TP rank 0 of each DP group (every stage of a replica reads the same stream); RNG state from every rank."""
    _host = host.copy
    files: dict[str, object] = {}
    optim_dp = dims.dp if dims.shards_moments else 1
    stage = {"pp_rank": dims.pp_rank, "pp": dims.pp}
    if dims.dp_rank == 0 or dims.fsdp:
        weights = {}
        for k, v in model.state_dict().items():
            # FSDP: a gather over DP, one tensor at a time, that every DP rank takes part in; DP rank 0 keeps it.
            t = tp_local(v) if dims.fsdp else v
            if dims.dp_rank == 0:
                weights[k] = _host(k, t)
        if dims.dp_rank == 0:
            files[shard_file("model", dims.tp_rank, dims.tp, **stage)] = weights
    if dims.dp_rank == 0 or dims.shards_moments:
        moments = {}
        names = {id(p): name for name, p in model.named_parameters()}  # the optimizer holds the trained ones only
        for p, m, v in zip(optimizer.params, optimizer.exp_avg, optimizer.exp_avg_sq, strict=True):
            name = names[id(p)]
            moments[f"exp_avg.{name}"] = _host(f"exp_avg.{name}", m)
            moments[f"exp_avg_sq.{name}"] = _host(f"exp_avg_sq.{name}", v)
        dp_rank = dims.dp_rank if dims.shards_moments else 0
        files[shard_file("optim", dims.tp_rank, dims.tp, dp_rank, optim_dp, **stage)] = moments
    stage_dims = {"dims": shard_dims(model, shard_dim)}
    if dims.rank == 0:
        files[SHARDS] = {"tp": dims.tp, "pp": dims.pp, "optim_dp": optim_dp, **(stage_dims if dims.pp == 1 else {})}
        files["state.json"] = {
            "step": step,
            "optimizer_steps": optimizer.steps(),
            "dp": dims.dp,
            "tp": dims.tp,
            "pp": dims.pp,
            "world": dims.world,
            "zero1": dims.zero1,
            "fsdp": dims.fsdp,
            "stage_layers": [len(s.layers) for s in pipeline_stages(recipe)],  # the split, in model order
            "consumed_samples": step * recipe.batch.global_batch,
            "num_docs": num_docs,  # the corpus the data positions index (resume refuses another)
        }
    if dims.pp > 1 and dims.dp_rank == 0 and dims.tp_rank == 0:
        files[stage_shards_file(dims.pp_rank, dims.pp)] = stage_dims
    if dims.tp_rank == 0 and dims.pp_rank == 0 and position is not None:
        files[data_file(dims.dp_rank)] = position.to_dict()
    files[rng_file(dims.rank)] = rng_state(optimizer.generator)
    return files
