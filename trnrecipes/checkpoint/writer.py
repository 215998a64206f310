"""Writing training checkpoints: what each rank contributes, and the background writer (which prunes to keep-last-K
after each save: prune). Reading them back: trnrecipes.train.restore.

Every rank writes its own files into checkpoints/.step_N.tmp/ and then a `.rank-R.ok` marker; rank 0 waits for all
markers, adds recipe, tokenizer, manifest and `done`, and renames the directory to step_N (checkpoint/format.py).
Writing happens in a background thread: the step loop only pays for copying tensors to host memory. No collective
is used by the writer, so it never races the training step's collectives.

When the storage refuses a write (read-only, permissions, full disk or quota, a file size limit), the rank raises
CheckpointWriteError naming the file, the OS error and the newest complete checkpoint, which a failed save never
touches. A rank other than 0 also leaves a `.rank-R.failed` marker holding its message, so that rank 0 stops
waiting for it; an async writer's error is held until the loop asks (failed(), checked every step and agreed over
ranks, then give_up()). The half-written .step_N.tmp is deleted when the next run starts (run_dir.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from trnrecipes.checkpoint.format import (
    DONE,
    SHARDS,
    STORAGE_ERRNOS,
    CheckpointError,
    CheckpointWriteError,
    data_file,
    finalize,
    hash_and_sync,
    shard_file,
    stage_shards_file,
    step_dirs,
    write_common,
)
from trnrecipes.config.sections import Recipe
from trnrecipes.config.stages import pipeline_stages
from trnrecipes.data.order import DATA_ORDER
from trnrecipes.files.durable import make_readable
from trnrecipes.files.storage_errors import storage_errno
from trnrecipes.parallel.dims import local_tensor
from trnrecipes.parallel.expert import expert_layouts, gather_experts, gather_replica_rows
from trnrecipes.parallel.fsdp import tp_local
from trnrecipes.parallel.kv_replication import describe, tp_block
from trnrecipes.parallel.kv_replication import layouts as kv_layouts
from trnrecipes.parallel.sharding import chunk_range

RANK_WAIT_S = 3600.0  # rank 0 waits this long for the other ranks' files before giving up on a checkpoint


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
        checkpoints at or below a step known to be valid (prune)."""
        self.root, self.recipe, self.tokenizer_dir = root, recipe, tokenizer_dir
        self.newest_valid = newest_valid
        self.rank, self.world, self.keep_last, self.async_save, self.log = rank, world, keep_last, async_save, log
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._given_up_on: int | None = None  # a rank whose write failed: rank 0 stops waiting for its files
        self._given_up_storage = True  # ... because of the storage (else an error a requeue may pass)
        self._give_up = threading.Event()
        self.saved: list[Path] = []

    def save(self, step: int, files: dict[str, object]) -> None:
        """Hand this rank's files (name -> {tensor name: CPU tensor} or a JSON-able dict) to the writer. Written in
        the background (async_save) or here, raising on failure. A background save that failed is not raised here
        (one rank raising alone would leave the others in a collective): failed() reports it, and no new save
        starts after it."""
        self.join()  # one save in flight at a time: the next waits for the previous
        if self._error is not None:
            return
        if self.async_save:
            self._thread = threading.Thread(target=self._write_guarded, args=(step, files), name=f"ckpt-{step}")
            self._thread.start()
        else:
            self._write(step, files)

    def busy(self) -> bool:
        """Whether a background save is still being written."""
        return self._thread is not None and self._thread.is_alive()

    def failed(self) -> bool:
        """Whether a background save failed (cheap: the training loop asks every step)."""
        return self._error is not None

    def failed_on_storage(self) -> bool:
        """Whether that failure is the storage's (read-only, full, quota): a requeue would fail the same way."""
        return isinstance(self._error, CheckpointWriteError)

    def join(self) -> None:
        """Wait for the background save; its error, if any, stays for failed() / raise_if_failed()."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def raise_if_failed(self) -> None:
        if self._error is None:
            return
        error, self._error = self._error, None
        if isinstance(error, CheckpointWriteError):
            raise error
        raise RuntimeError(f"writing a checkpoint failed: {error}") from error

    def wait(self) -> None:
        self.join()
        self.raise_if_failed()

    def give_up(self, rank: int, storage: bool) -> None:
        """Rank `rank`'s write failed (the ranks agreed on it): rank 0 stops waiting for its files. Raises this
        rank's own error if it has one, else one naming `rank`: a CheckpointWriteError (bad input: not requeued)
        only when that rank's failure was the storage's, else a RuntimeError (an I/O hiccup a requeue may pass)."""
        self._given_up_on, self._given_up_storage = rank, storage
        self._give_up.set()
        self.wait()
        message = f"rank {rank} cannot write its checkpoint files (its own error says why); stopping with it"
        raise CheckpointWriteError(message) if storage else RuntimeError(message)

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
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            digests = write_files(tmp, files)
            # The marker carries this rank's digests: rank 0 never reads another rank's shards back. Renamed into
            # place, so rank 0 (which polls for it) never reads it half-written.
            marker = tmp / f".rank-{self.rank}.ok"
            marker.with_suffix(".tmp").write_text(json.dumps(digests))
            os.replace(marker.with_suffix(".tmp"), marker)
            if self.rank == 0:
                self._finish(step, tmp, digests)
        except BaseException as err:
            code = storage_errno(err)
            if code is None:
                self._report_failure(tmp, False, f"{type(err).__name__}: {err}")
                raise
            error = self._write_error(step, err.filename or tmp, f"[Errno {code}] {os.strerror(code)}", code)
            self._report_failure(tmp, True, str(error))
            raise error from err

    def _finish(self, step: int, tmp: Path, digests: dict[str, str]) -> None:
        """Rank 0: every rank's digests, then the common files, the manifest and the rename to step_N; pruning."""
        digests.update(self._gather_markers(step, tmp))
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

    def _gather_markers(self, step: int, tmp: Path) -> dict[str, str]:
        """Rank 0: the digests in every rank's .rank-R.ok marker. A rank's .rank-R.failed marker, or give_up(),
        ends the wait at once with that rank's error; RANK_WAIT_S is for ranks that vanish without either."""
        deadline = time.monotonic() + RANK_WAIT_S
        digests: dict[str, str] = {}
        for r in range(self.world):
            ok, failed = tmp / f".rank-{r}.ok", tmp / f".rank-{r}.failed"
            while not ok.exists():
                if failed.exists():
                    raise self._failed_rank_error(r, failed, step)
                if self._give_up.is_set():
                    why = "its write failed (its own error says why)"
                    if not self._given_up_storage:
                        raise RuntimeError(f"rank {self._given_up_on} could not write checkpoint step_{step}: {why}")
                    raise self._write_error(step, tmp, why, rank=self._given_up_on)
                if time.monotonic() > deadline:
                    raise CheckpointError(f"{tmp}: not every rank wrote its files within {RANK_WAIT_S:.0f} s")
                self._give_up.wait(0.02)
            digests.update(json.loads(ok.read_text()))
            ok.unlink()
        return digests

    def _write_error(
        self, step: int, where: object, why: str, code: int | None = None, rank: int | None = None
    ) -> CheckpointWriteError:
        rank = self.rank if rank is None else rank
        who = f"rank {rank} " if self.world > 1 else ""
        hint = STORAGE_ERRNOS.get(code, "Fix the storage and resubmit")
        return CheckpointWriteError(
            f"{who}cannot write checkpoint step_{step} to {where}: {why}; {self._intact(step)}. {hint}"
        )

    def _intact(self, step: int) -> str:
        """The newest complete checkpoint before `step`: a failed save writes only in its .step_N.tmp and prunes
        nothing, so that one is as it was."""
        try:
            done = [s for s, path in step_dirs(self.root) if s < step and (path / DONE).exists()]
        except (OSError, CheckpointError):
            done = []
        newest = done[0] if done else self.newest_valid
        if newest is None:
            return f"there is no earlier complete checkpoint in {self.root}"
        return f"the newest complete checkpoint, step_{newest}, is intact"

    def _report_failure(self, tmp: Path, storage: bool, message: str) -> None:
        """Best effort, ranks other than 0: a .rank-R.failed marker with this rank's message, so that rank 0 stops
        waiting for its files. Where even that cannot be written, this rank's exit ends the job (torchrun)."""
        if self.rank == 0:
            return
        marker = tmp / f".rank-{self.rank}.failed"
        part = marker.with_name(marker.name + ".part")
        try:
            part.write_text(json.dumps({"storage": storage, "message": message}))
            os.replace(part, marker)
        except OSError:
            with contextlib.suppress(OSError):
                marker.touch()  # no room for the message: rank 0 still learns which rank failed

    def _failed_rank_error(self, rank: int, marker: Path, step: int) -> Exception:
        try:
            note = json.loads(marker.read_text())
        except (OSError, ValueError):
            note = None
        note = note if isinstance(note, dict) else {}
        message = note.get("message")
        if not isinstance(message, str) or not message:
            return self._write_error(step, marker.parent, f"its write failed (its {marker.name} is empty)", rank=rank)
        if note.get("storage") is False:
            return RuntimeError(f"{marker.parent}: rank {rank} failed writing checkpoint step_{step}: {message}")
        return CheckpointWriteError(message)


def write_files(directory: Path, files: dict[str, object]) -> dict[str, str]:
    """A rank's snapshot() files in `directory` (tensors as safetensors, the rest as JSON), each fsync'd; returns
    their sha256 digests by name."""
    digests = {}
    for name, content in files.items():
        if name.endswith(".safetensors"):
            _save_tensors(content, directory / name)
        else:
            (directory / name).write_text(json.dumps(content, indent=1) + "\n")
        digests[name] = hash_and_sync(directory / name)
    return digests


def _save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    try:
        save_file(tensors, path)
        make_readable(path)  # safetensors writes 0600: a team's shared storage would keep the weights from the others
    except SafetensorError as err:  # its Rust writer's OSError, only as text: "... (os error 28)"
        if not (found := re.search(r"\(os error (\d+)\)", str(err))):
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), str(path)) from err


PRUNING = re.compile(r"^\.prune-step_\d+$")  # a step dir renamed for deletion: gone from view in one rename


def prune(root: Path, keep_last: int, newest_valid: int, log=print) -> None:
    """Keep the newest `keep_last` complete checkpoints up to `newest_valid` (a step known to verify: the one
    resumed from or one this run wrote), delete the older ones. Nothing newer than newest_valid is touched: only
    checkpoints at or below a valid one can be counted, so the newest valid checkpoint is never deleted."""
    candidates = [(s, p) for s, p in step_dirs(root) if s <= newest_valid and (p / DONE).exists()]
    for _, path in candidates[keep_last:]:
        doomed = root / f".prune-{path.name}"
        os.replace(path, doomed)  # one rename: a half-deleted dir is never seen as step_N
        shutil.rmtree(doomed)
        log(f"[trnrecipes] pruned checkpoint {path.name} (checkpoint.keep_last {keep_last})")


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
    """This rank's files for checkpoint `step`: weights from shard rank 0 (DP rank 0, CP rank 0) of each TP group of
    each pipeline stage (one file per stage x TP rank; under FSDP gathered over the shard group first); moments
    likewise, or under ZeRO-1 and FSDP from every rank of the shard group (its rows: dp x cp files, the count recorded
    as optim_dp, so that any other layout re-chunks them); shard dims from the first rank of each stage; the data
    position from the first stage's TP rank 0 and CP rank 0 of each DP group (every stage and CP rank of a replica
    reads the same stream). No RNG state: stochastic rounding's noise is a hash of the step
    (trnrecipes/optim/rounding.py) and dropout is seeded per step (train/step_rng.py). Under context parallelism
    without ZeRO-1 or FSDP, CP rank 0 of each replica writes: the other CP ranks hold the same weights, moments and
    data position (their collectives here run among ranks of one CP rank, so skipping them together is safe)."""
    _host = host.copy
    files: dict[str, object] = {}
    if dims.cp_rank and not dims.shards_moments:
        return files
    optim_dp = dims.shard_n if dims.shards_moments else 1
    first = dims.shard_rank == 0  # the rank that writes what is whole (without sharding here, cp_rank is 0)
    stage = {"pp_rank": dims.pp_rank, "pp": dims.pp}
    # Expert parallelism: the first EP group's ranks gather whole experts (its DP rank 0 keeps them; under ZeRO-1
    # and FSDP every group gathers its moments, each rank keeping its file's rows), so the files hold the
    # [num_experts, ...] tensors EP 1 has and resume at any ep.
    experts = expert_layouts(model)
    whole = lambda key, t: gather_experts(t, experts[key], dims.ep_group) if key in experts else t  # noqa: E731
    gathers = bool(experts) and dims.dp_rank < dims.ep
    if first or dims.fsdp or gathers:
        weights = {}
        for k, v in model.state_dict().items():
            # FSDP: a gather over the shard group, one tensor at a time, that all its ranks join; shard rank 0 keeps it
            t = whole(k, tp_local(v) if dims.fsdp else v)
            if first:
                weights[k] = _host(k, t)
        if first:
            files[shard_file("model", dims.tp_rank, dims.tp, **stage)] = weights
    if first or dims.shards_moments or gathers:
        moments = {}
        names = {id(p): name for name, p in model.named_parameters()}  # the optimizer holds the trained ones only
        for p, m, v in zip(optimizer.params, optimizer.exp_avg, optimizer.exp_avg_sq, strict=True):
            name = names[id(p)]
            if name in experts and dims.fsdp:  # FSDP: the rank's experts whole from the ranks holding them too
                m, v = gather_replica_rows(m, dims), gather_replica_rows(v, dims)
            m, v = whole(name, m), whole(name, v)
            if name in experts and dims.shards_moments:  # ZeRO-1's files: this shard rank's rows of whole experts
                start, stop = chunk_range(m.shape[0], dims.shard_n, dims.shard_rank)
                m, v = m[start:stop], v[start:stop]
            moments[f"exp_avg.{name}"] = _host(f"exp_avg.{name}", m)
            moments[f"exp_avg_sq.{name}"] = _host(f"exp_avg_sq.{name}", v)
        index = dims.shard_rank if dims.shards_moments else 0
        if first or dims.shards_moments:
            files[shard_file("optim", dims.tp_rank, dims.tp, index, optim_dp, **stage)] = moments
    # TP wider than the KV heads: each rank saved its own rows; readers map them back (kv_replication.py)
    replicated, blocks = describe(kv_layouts(model)), tp_block(model)
    stage_dims = {
        "dims": shard_dims(model, shard_dim),
        **({"kv_replication": replicated} if replicated else {}),
        **({"tp_blocks": blocks} if blocks else {}),  # NxD's tiled KV copies: which o_proj block each rank wrote
    }
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
            "data_order": DATA_ORDER,  # how documents were ordered: a position from another order means nothing
        }
    if dims.pp > 1 and first and dims.tp_rank == 0:
        files[stage_shards_file(dims.pp_rank, dims.pp)] = stage_dims
    if dims.tp_rank == 0 and dims.pp_rank == 0 and dims.cp_rank == 0 and position is not None:
        files[data_file(dims.dp_rank)] = position.to_dict()
    return files
