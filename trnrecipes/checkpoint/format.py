"""The checkpoint format: directories written so that work is never lost and a half-written one is never mistaken
for whole.

    step_N/
      model.safetensors                 weights, our names (TP > 1: model-tp00-of-08.safetensors ..., one per rank;
                                        PP > 1: model-pp00-of-04-tp00-of-08.safetensors ..., a stage's tensors each)
      shards.json                       TP and PP sizes, how many DP slices the optimizer state is in (optim_dp),
                                        and per parameter the dim its TP shards split (or null); under PP the
                                        per-parameter dims are in each stage's shards-pp00-of-04.json
      optim-tp00-of-01.safetensors      AdamW moments per parameter (training checkpoints); under ZeRO-1 one file per
                                        TP x DP rank, optim-tp00-of-08-dp0000-of-0004.safetensors, each a dim-0 slice
                                        (under PP, per stage too: optim-pp01-of-04-tp00-of-08...)
      state.json                        step, layout; data-dpNNNN.json per DP rank (where its data stream stands)
      recipe.yaml, tokenizer/           the resolved recipe and the tokenizer files
      manifest.json                     sha256 of every file above
      done                              written last, once everything above is fsync'd
Files are written into a temp dir that is renamed to step_N at the end: step_N exists whole or not at all. Loading
verifies every checksum and reads tensors with safetensors and the rest as JSON/YAML: nothing is ever unpickled.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from trnrecipes.config.recipe import recipe_from_dict
from trnrecipes.config.saved_recipe import read_saved_recipe
from trnrecipes.config.sections import Recipe, RecipeError
from trnrecipes.files.durable import fsync_path, make_readable
from trnrecipes.files.run_files import CHECKPOINTS, DONE, MANIFEST, STEP_DIR
from trnrecipes.parallel.kv_replication import KVReplication, block_of, from_description
from trnrecipes.parallel.sharding import Region, chunk_range, shard_region
from trnrecipes.schema import clipped, shown

FORMAT = 2
WEIGHTS = "model.safetensors"
SHARDS = "shards.json"


class CheckpointError(RecipeError):
    """A checkpoint that is missing, incomplete or corrupt; the message names the file."""


class CheckpointWriteError(CheckpointError):
    """This rank cannot write its checkpoint because of the storage (read-only, no permission, full disk or quota, a
    file size limit; STORAGE_ERRNOS): the run stops and the checkpoints already complete are left as they were. A
    RecipeError: resubmitting unchanged would fail the same way."""


# The OSErrors that say the storage refuses writes (trnrecipes/files/storage_errors.py's), with what would let a
# training run's next attempt succeed. Others (EIO, ESTALE, ...) may pass with time and stay plain errors.
STORAGE_ERRNOS = {
    errno.EROFS: "Remount it writable or train into another run_dir, and resubmit",
    errno.EACCES: "Fix its permissions or train into another run_dir, and resubmit",
    errno.EPERM: "Fix its permissions or train into another run_dir, and resubmit",
    errno.ENOSPC: "Free space and resubmit",
    errno.EDQUOT: "Free space (or raise the quota) and resubmit",
    errno.EFBIG: "Raise the file size limit (ulimit -f) and resubmit",
}


class CheckpointReadError(CheckpointError):
    """An I/O error while reading a checkpoint (EIO, ESTALE, ...): it says nothing about the checkpoint itself, so
    nothing may be concluded from it (a valid checkpoint must not be set aside over a flaky read), and a requeue
    may read it fine."""

    may_pass = True


def shard_file(
    prefix: str, tp_rank: int, tp: int, dp_rank: int = 0, dp: int = 1, *, pp_rank: int = 0, pp: int = 1
) -> str:
    """The file of pipeline stage `pp_rank`'s TP rank `tp_rank` (and, for ZeRO-1 optimizer state, DP rank `dp_rank`)
    of `prefix` ("model" or "optim"); unsharded weights are model.safetensors. Every tensor file name is made here."""
    if prefix == "model" and tp == 1 and pp == 1:
        return WEIGHTS
    stage = f"-pp{pp_rank:02d}-of-{pp:02d}" if pp > 1 else ""
    if dp == 1:
        return f"{prefix}{stage}-tp{tp_rank:02d}-of-{tp:02d}.safetensors"
    return f"{prefix}{stage}-tp{tp_rank:02d}-of-{tp:02d}-dp{dp_rank:04d}-of-{dp:04d}.safetensors"


def stage_shards_file(pp_rank: int, pp: int) -> str:
    """Under PP, where a stage's per-parameter shard dims are (shards.json holds them itself at PP 1)."""
    return f"shards-pp{pp_rank:02d}-of-{pp:02d}.json"


def data_file(dp_rank: int) -> str:
    return f"data-dp{dp_rank:04d}.json"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    try:
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except OSError as err:
        raise CheckpointReadError(f"{path}: cannot be read ({err.strerror or err})") from None
    return digest.hexdigest()


def hash_and_sync(path: Path) -> str:
    """sha256 of a file just written (read back while it is still in the page cache), after an fsync: its
    manifest entry. Each rank calls this on its own files, so no one reads the whole checkpoint back."""
    fsync_path(path)
    return _sha256(path)


def write_common(tmp: Path, recipe: Recipe, tokenizer_dir: Path | None) -> None:
    (tmp / "recipe.yaml").write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))
    if tokenizer_dir is not None and not (tmp / "tokenizer").exists():
        shutil.copytree(tokenizer_dir, tmp / "tokenizer")


def finalize(tmp: Path, out: Path, step: int, digests: dict[str, str] | None = None) -> Path:
    """Manifest of every file in `tmp`, the done marker, then one rename to `out`, each made durable in turn.

    digests: files (relative names) already fsync'd and hashed by whoever wrote them (hash_and_sync; in training,
    each rank its own shards); only the others (recipe, tokenizer, ...) are read here.
    """
    known = digests or {}
    paths = sorted(tmp.rglob("*"))
    files = {str(p.relative_to(tmp)): p for p in paths if p.is_file()}
    if missing := sorted(set(known) - set(files)):
        raise CheckpointError(f"{tmp}: {missing[0]} was reported written but is not there ({len(missing)} missing)")
    entries = {name: known[name] if name in known else hash_and_sync(p) for name, p in files.items()}
    manifest = tmp / MANIFEST
    manifest.write_text(json.dumps({"format": FORMAT, "step": step, "files": entries}, indent=2) + "\n")
    fsync_path(manifest)
    for d in [tmp, *(p for p in paths if p.is_dir())]:
        fsync_path(d)
    # Only now, with everything it vouches for on disk, the done marker; then the rename that publishes step_N.
    (tmp / DONE).write_text("")
    fsync_path(tmp / DONE)
    fsync_path(tmp)
    os.replace(tmp, out)
    fsync_path(out.parent)
    return out


def write_model_checkpoint(
    out: Path, state_dict: dict[str, torch.Tensor], recipe: Recipe, tokenizer_dir: Path | None = None, step: int = 0
) -> Path:
    """A weights-only checkpoint (convert from-hf), same format as training's with TP 1."""
    out = Path(out)
    if out.exists():
        raise CheckpointError(f"{out} already exists; choose a new --out (checkpoints are never overwritten)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        make_readable(tmp)  # mkdtemp's 0700 and safetensors' 0600: the modes a plain mkdir and open give
        save_file({k: v.detach().contiguous().cpu() for k, v in state_dict.items()}, tmp / WEIGHTS)
        make_readable(tmp / WEIGHTS)
        (tmp / SHARDS).write_text(json.dumps({"tp": 1, "dims": {k: None for k in state_dict}}) + "\n")
        write_common(tmp, recipe, tokenizer_dir)
        return finalize(tmp, out, step)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _listed_name(path: Path, name: object) -> str:
    """A manifest entry must name a file inside the checkpoint: a relative path of plain components (tokenizer
    files sit in tokenizer/), nothing absolute, no '..', nothing a reader could be steered out of the dir with."""
    parts = name.split("/") if isinstance(name, str) else []
    plain = all(p not in ("", ".", "..") and "\\" not in p and p.isprintable() for p in parts)
    if not parts or not plain or name in (MANIFEST, DONE):
        raise CheckpointError(f"{path}/{MANIFEST}: entry {shown(name)} is not a plain file name inside the dir")
    return name


def _read_by_loaders(name: str) -> bool:
    """Whether some reader opens this file: the tokenizer dir is copied whole; at the top, tensors, JSON and YAML
    (data-dp*.json are found by pattern). Anything else (notes, NFS .nfs* files) never is."""
    return name.startswith("tokenizer/") or name.endswith((".safetensors", ".json", ".yaml"))


def _files_on_disk(path: Path) -> set[str]:
    """Every file under the checkpoint dir (relative names). A symlink anywhere inside is refused: a checkpoint
    holds its own bytes, and a link could make a reader (or a pruner) act on another run's files."""
    found = set()
    for dirpath, dirnames, filenames in os.walk(path):
        here = Path(dirpath)
        for name in dirnames + filenames:
            if (here / name).is_symlink():
                raise CheckpointError(f"{here / name}: a symlink inside a checkpoint (refused; copy the file in)")
        found.update(str((here / f).relative_to(path)) for f in filenames)
    return found


def verify(path: Path) -> dict:
    """The manifest of a complete, uncorrupted checkpoint, else CheckpointError saying what is wrong.

    Complete means: the done marker, a manifest listing every file in the dir (nothing unlisted is ever read), each
    listed file present with its sha256, and the weights that shards.json promises."""
    path = Path(path)
    if not path.is_dir():  # a mistyped --ckpt or train.init_from, or one its run pruned since
        raise CheckpointError(f"{path}: does not exist" if not path.exists() else f"{path}: not a directory")
    if not (path / DONE).exists():
        raise CheckpointError(f"{path}: no '{DONE}' marker: not a complete trnrecipes checkpoint")
    manifest = read_json(path / MANIFEST)
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or manifest.get("format") != FORMAT or SHARDS not in files:
        raise CheckpointError(f"{path}/{MANIFEST}: not a format-{FORMAT} manifest listing {SHARDS}")
    listed = {_listed_name(path, name) for name in files}
    on_disk = _files_on_disk(path) - {MANIFEST, DONE}
    if unlisted := sorted(n for n in on_disk - listed if _read_by_loaders(n)):
        raise CheckpointError(
            f"{path}: {unlisted[0]} is not in the manifest ({len(unlisted)} unlisted file(s)):"
            " it would be read unchecked"
        )
    for name, digest in files.items():
        file = path / name
        if name not in on_disk:
            raise CheckpointError(f"{file}: listed in the manifest but missing")
        if _sha256(file) != digest:
            raise CheckpointError(f"{file}: checksum mismatch (truncated or corrupted)")
    shards = read_shards(path)
    tp, pp = shards.tp, shards.pp
    expected = [shard_file("model", t, tp, pp_rank=p, pp=pp) for p in range(pp) for t in range(tp)]
    expected += [stage_shards_file(p, pp) for p in range(pp)] if pp > 1 else []  # read_shards trusts them
    if missing := [f for f in expected if f not in files]:
        layout = f"PP {pp} x TP {tp}" if pp > 1 else f"TP {tp}"
        what = "shard dims" if missing[0].endswith(".json") else "weights"
        raise CheckpointError(f"{path}: {missing[0]} ({what}, {layout}) is not in the manifest")
    return manifest


def verify_training(path: Path) -> dict:
    """verify(), plus what resuming training reads: state.json's entries and every TP rank's optimizer file (a
    weights-only checkpoint, e.g. from convert from-hf, is for train.init_from, not for resuming)."""
    manifest = verify(path)
    state = read_json(Path(path) / "state.json")
    for key in ("step", "optimizer_steps", "dp", "tp", "world"):
        if not isinstance(state.get(key), int) or isinstance(state.get(key), bool):
            raise CheckpointError(f"{path}/state.json: no whole-number {key!r}: not a training checkpoint")
    shards = read_shards(path)
    tp, dp, pp = shards.tp, shards.optim_dp, shards.pp
    optim_files = [
        shard_file("optim", t, tp, d, dp, pp_rank=p, pp=pp) for p in range(pp) for t in range(tp) for d in range(dp)
    ]
    if missing := [f for f in optim_files if f not in manifest["files"]]:
        raise CheckpointError(
            f"{path}: {missing[0]} (optimizer state) is not in the manifest: not a training checkpoint"
        )
    return manifest


@dataclass(frozen=True)
class Shards:
    """How a checkpoint's tensors are split (shards.json, and each stage's file under PP)."""

    tp: int
    pp: int
    optim_dp: int  # DP slices of each TP rank's optimizer state (ZeRO-1), 1 without it
    dims: dict[str, int | None]  # tensor name -> the dim its TP shards split, or None
    stage: dict[str, int]  # tensor name -> the pipeline stage whose files hold it (0 without PP)
    # tensor name -> how its rows replicate KV heads over TP (trnrecipes/parallel/kv_replication.py); most have none
    kv: dict[str, KVReplication] = field(default_factory=dict)
    # tensor name -> the block of its split dim each TP rank's file holds, where not the rank's own (NxD's tiled KV
    # copies move the output projection's column blocks with the query heads)
    blocks: dict[str, list[int]] = field(default_factory=dict)

    def block(self, name: str, tp_rank: int) -> int:
        return block_of(self.blocks, name, tp_rank)


def _whole(path: Path, key: str, value: object, top: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= top:
        raise CheckpointError(f"{path}: {key!r} must be a whole number from 1 to {top}, got {shown(value)}")
    return value


def read_shards(path: Path) -> Shards:
    """shards.json (and under PP every stage's shards file), checked: a tensor in two stages is an error."""
    top = read_json(path / SHARDS)
    tp = _whole(path / SHARDS, "tp", top.get("tp"), 4096)
    pp = _whole(path / SHARDS, "pp", top.get("pp", 1), 4096)
    dp = _whole(path / SHARDS, "optim_dp", top.get("optim_dp", 1), 1 << 20)
    files = [SHARDS] if pp == 1 else [stage_shards_file(p, pp) for p in range(pp)]
    dims: dict[str, int | None] = {}
    stage: dict[str, int] = {}
    kv: dict[str, KVReplication] = {}
    blocks: dict[str, list[int]] = {}
    for p, name in enumerate(files):
        part = top if pp == 1 else read_json(path / name)
        part_dims = part.get("dims")
        if not isinstance(part_dims, dict):
            raise CheckpointError(f"{path / name}: 'dims' must map tensor names to a dim or null")
        for key, dim in part_dims.items():
            if key in stage:
                raise CheckpointError(
                    f"{path}: {key} is in pipeline stage {stage[key]}'s files and in stage {p}'s: stages must not"
                    " share a tensor"
                )
            dims[key], stage[key] = dim, p
        for key, value in (part.get("kv_replication") or {}).items():
            try:
                kv[key] = from_description(value)
            except (TypeError, ValueError) as err:
                raise CheckpointError(f"{path / name}: kv_replication of {key}: {clipped(err)}") from None
            if kv[key].tp != tp or dims.get(key) != 0:
                raise CheckpointError(
                    f"{path / name}: kv_replication of {key} is for TP {kv[key].tp} split on dim 0, but the"
                    f" checkpoint has TP {tp} and dim {shown(dims.get(key))}"
                )
        for key, order in (part.get("tp_blocks") or {}).items():
            if not isinstance(order, list) or sorted(order) != list(range(tp)) or dims.get(key) is None:
                raise CheckpointError(
                    f"{path / name}: tp_blocks of {key} must order the {tp} blocks of a split tensor,"
                    f" got {shown(order)}"
                )
            blocks[key] = order
    return Shards(tp, pp, dp, dims, stage, kv, blocks)


class ShardReader:
    """Any rectangle of a checkpoint's tensors, read from the files that hold it with safetensors get_slice: a rank
    reads the bytes of its own shard, whatever TP / ZeRO-1 layout saved the checkpoint and whatever layout reads it.

    prefix "model": weights (split over the saved TP ranks); "optim": AdamW moments named exp_avg.<param> and
    exp_avg_sq.<param> (split over TP, and over DP under ZeRO-1)."""

    def __init__(self, path: Path, prefix: str):
        self.path, self.prefix = Path(path), prefix
        self.shards = read_shards(self.path)
        self.tp, self.pp, self.dims = self.shards.tp, self.shards.pp, self.shards.dims
        self.dp = self.shards.optim_dp if prefix == "optim" else 1
        self._handles: dict[str, object] = {}
        self._names: set[str] | None = None

    def _handle(self, name: str):
        if name not in self._handles:
            file = self.path / name
            try:
                self._handles[name] = safe_open(str(file), framework="pt")
            except FileNotFoundError:
                raise CheckpointError(f"{file}: missing") from None
            except Exception as err:  # SafetensorError, OSError
                raise CheckpointError(f"{file}: not a readable safetensors file ({clipped(err)})") from None
        return self._handles[name]

    def _file(self, param: str, tp_rank: int, dp_rank: int) -> str:
        return shard_file(
            self.prefix, tp_rank, self.tp, dp_rank, self.dp, pp_rank=self.shards.stage.get(param, 0), pp=self.pp
        )

    def names(self) -> set[str]:
        """The tensor names in the checkpoint: every file of a stage holds the same names; stages hold different
        ones (a name in two stages' files is an error)."""
        if self._names is None:
            names: set[str] = set()
            for p in range(self.pp):
                file = shard_file(self.prefix, 0, self.tp, 0, self.dp, pp_rank=p, pp=self.pp)
                held = set(self._handle(file).keys())
                if twice := sorted(names & held):
                    raise CheckpointError(f"{self.path / file}: {twice[0]} is in another pipeline stage's file too")
                names |= held
            self._names = names
        return self._names

    def read_into(self, key: str, dest: torch.Tensor, full_shape: tuple[int, ...], start: tuple[int, ...]) -> None:
        """Fill `dest` with the part of tensor `key` (full shape `full_shape`) that begins at `start`."""
        param = key.split(".", 1)[1] if self.prefix == "optim" else key
        dim = self.dims.get(param)
        if dim is not None and (not isinstance(dim, int) or isinstance(dim, bool) or not 0 <= dim < len(full_shape)):
            raise CheckpointError(
                f"{self.path / SHARDS}: {param} has shard dim {shown(dim)}, not a dim of {full_shape}"
            )
        want = Region(tuple(start), tuple(dest.shape))
        if param in self.shards.kv:
            covered = self._read_replicated(key, param, self.shards.kv[param], dest, want, full_shape)
            if covered != want.numel:
                raise CheckpointError(f"{self.path}: the saved rows of {key} do not cover {want} of {list(full_shape)}")
            return
        covered = 0
        for t in range(self.tp) if dim is not None else [0]:  # a replicated tensor: every TP rank saved it whole
            for d in range(self.dp):
                held = shard_region(full_shape, dim, self.tp, self.shards.block(param, t), self.dp, d)
                part = want.intersect(held)
                if part is None:
                    continue
                file = self._file(param, t, d)
                try:
                    piece = self._handle(file).get_slice(key)
                    shape = tuple(piece.get_shape())
                    if shape != held.size:
                        raise CheckpointError(
                            f"{self.path / file}: {key} is {list(shape)}, but a {list(full_shape)} tensor split this"
                            f" way holds {list(held.size)} there: its weights do not fit this recipe's model"
                        )
                    values = piece[part.slices_within(held)]
                except CheckpointError:
                    raise
                except Exception as err:  # a missing name (SafetensorError), a malformed file
                    raise CheckpointError(f"{self.path / file}: cannot read {key} ({clipped(err)})") from None
                with torch.no_grad():
                    dest[part.slices_within(want)].copy_(values)
                covered += part.numel
        if covered != want.numel:
            raise CheckpointError(f"{self.path}: the saved shards of {key} do not cover {want} of {list(full_shape)}")

    def _read_replicated(
        self, key: str, param: str, kv: KVReplication, dest: torch.Tensor, want: Region, full_shape: tuple[int, ...]
    ) -> int:
        """Fill `dest` (region `want` of the stored tensor) from files that hold each TP rank's rows of a
        KV-replicated tensor (kv_replication.py): its query-head rows and its group's k/v rows, under ZeRO-1 a DP
        slice of those; k/v taken from each group's first copy. Returns the elements filled."""
        rest = tuple(full_shape[1:])
        if full_shape[0] != kv.stored_rows:
            raise CheckpointError(
                f"{self.path / SHARDS}: {param} replicates {kv.kv_heads} KV heads of {kv.stored_group_rows} rows, not"
                f" the {full_shape[0]} rows of this recipe's tensor: its weights do not fit this recipe's model"
            )
        covered = 0
        for t in range(self.tp):
            for d in range(self.dp):
                held_start, held_stop = chunk_range(kv.local_rows, self.dp, d)
                pieces = kv.row_pieces(t, held_start, held_stop)
                if kv.holds_kv_copy(t):  # k/v rows come from the first copy
                    pieces = [p for p in pieces if p[1] % kv.stored_group_rows < kv.q_per_kv * kv.head_dim]
                file = self._file(param, t, d)
                for in_file, stored_row, n in pieces:
                    held = Region((stored_row, *[0] * len(rest)), (n, *rest))
                    part = want.intersect(held)
                    if part is None:
                        continue
                    rows = part.slices_within(held)
                    rows = (slice(in_file + rows[0].start, in_file + rows[0].stop), *rows[1:])
                    try:
                        piece = self._handle(file).get_slice(key)
                        if tuple(piece.get_shape()) != (held_stop - held_start, *rest):
                            raise CheckpointError(
                                f"{self.path / file}: {key} is {list(piece.get_shape())}, but TP rank {t} holds"
                                f" {held_stop - held_start} of its rows: its weights do not fit this recipe's model"
                            )
                        values = piece[rows]
                    except CheckpointError:
                        raise
                    except Exception as err:
                        raise CheckpointError(f"{self.path / file}: cannot read {key} ({clipped(err)})") from None
                    with torch.no_grad():
                        dest[part.slices_within(want)].copy_(values)
                    covered += part.numel
        return covered


def load_tensors(file: Path) -> dict[str, torch.Tensor]:
    """A safetensors file, or CheckpointError naming it: a file that matches its hash can still be malformed
    (written that way, or a manifest rewritten to match)."""
    try:
        return load_file(file)
    except FileNotFoundError:
        raise CheckpointError(f"{file}: missing") from None
    except Exception as err:  # safetensors raises its own SafetensorError, plus OSError/ValueError
        raise CheckpointError(f"{file}: not a readable safetensors file ({clipped(err)})") from None


def read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except OSError as err:
        raise CheckpointReadError(f"{path}: cannot be read ({err.strerror or err})") from None
    except (ValueError, RecursionError) as err:
        raise CheckpointError(f"{path}: not valid JSON ({clipped(err)})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return value


def saved_recipe(path: Path) -> dict:
    """The resolved recipe a checkpoint was written with, as the plain mapping in its recipe.yaml
    (config/saved_recipe.py: torch-free, for render time too)."""
    try:
        return read_saved_recipe(path)
    except RecipeError as err:
        raise CheckpointError(str(err)) from None


def consolidate(path: Path) -> dict[str, torch.Tensor]:
    """Full weights from the per-rank files (each pipeline stage's, each TP rank's: model-pp00-of-04-tp00-of-08...)
    or the single unsharded file, for one process that needs the whole model (eval, export): the union of the
    stages, each tensor's TP shards concatenated. Training ranks read their shard with ShardReader."""
    shards = read_shards(path)
    full: dict[str, torch.Tensor] = {}
    reader = ShardReader(path, "model")  # for tensors whose files hold each rank's rows of replicated KV heads
    for p in range(shards.pp):
        files = [shard_file("model", t, shards.tp, pp_rank=p, pp=shards.pp) for t in range(shards.tp)]
        parts = [load_tensors(path / file) for file in files]
        for name, tensor in parts[0].items():
            if name in full:
                raise CheckpointError(f"{path}: {name} is in more than one pipeline stage's weights")
            if (kv := shards.kv.get(name)) is not None:  # each TP rank's rows of a replicated-KV tensor
                full[name] = torch.empty((kv.stored_rows, *tensor.shape[1:]), dtype=tensor.dtype)
                reader.read_into(name, full[name], tuple(full[name].shape), (0,) * tensor.dim())
                continue
            dim = shards.dims.get(name)
            try:
                in_order = sorted(range(shards.tp), key=lambda t: shards.block(name, t))  # files by the block they hold
                full[name] = (
                    tensor if dim is None or shards.tp == 1 else torch.cat([parts[t][name] for t in in_order], dim=dim)
                )
            except (KeyError, RuntimeError, IndexError, TypeError) as err:
                raise CheckpointError(f"{path}: the TP shards of {name} do not fit together ({err})") from None
    if missing := sorted(set(shards.dims) - set(full)):
        where = f" (pipeline stage {shards.stage[missing[0]]})" if shards.pp > 1 else ""
        raise CheckpointError(f"{path}: no weights for {missing[0]}{where}, listed in its shards file")
    return full


def read_model_checkpoint_recipe(path: Path) -> Recipe:
    """The recipe of a checkpoint, after verifying the checkpoint (its tensors are read later, shard by shard)."""
    path = Path(path)
    verify(path)
    return checkpoint_recipe(path)


def checkpoint_recipe(path: Path) -> Recipe:
    """The recipe of a checkpoint already verified (latest_checkpoint's): its files are not hashed again."""
    return recipe_from_dict(saved_recipe(path), str(Path(path) / "recipe.yaml"), launching=False)


def read_model_checkpoint(path: Path) -> tuple[Recipe, dict[str, torch.Tensor], Path | None]:
    """(recipe, consolidated state dict, tokenizer dir or None), after verifying the checkpoint."""
    path = Path(path)
    recipe = read_model_checkpoint_recipe(path)
    tokenizer = path / "tokenizer"
    return recipe, consolidate(path), tokenizer if tokenizer.is_dir() else None


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, dir) of every step_N directory of this run dir, newest first. A symlinked step dir is refused: it
    would make pruning and cleanup act on another run's checkpoint."""
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        if not (m := STEP_DIR.match(p.name)):
            continue
        if p.is_symlink():
            raise CheckpointError(
                f"{p} is a symlink (to {shown(os.readlink(p))}): a run dir holds its own checkpoints. Remove the"
                " link; to start from another run's checkpoint copy it in, or use train.init_from"
            )
        if p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found, reverse=True)


def newest_of_run_dir(run_dir: Path, log=print) -> Path:
    """A run dir's newest checkpoint that verifies, for a reader given the run dir (eval, predict, embed, to-hf);
    RecipeError where it has none."""
    root = Path(run_dir) / CHECKPOINTS
    found = latest_checkpoint(root, log)
    if found is None:
        raise RecipeError(f"run dir {run_dir} has no complete checkpoint in {root}")
    return found[1]


def latest_checkpoint(root: Path, log=print) -> tuple[int, Path] | None:
    """The newest step_N that verifies, for readers (eval, convert): unusable ones are reported and left alone.
    The trainer settles its run dir with trnrecipes.train.run_dir.settle_checkpoints instead."""
    for _ in range(10):
        for step, path in step_dirs(root):
            try:
                verify(path)
            except CheckpointError as err:
                if not path.exists():  # pruned while read (a run still training): a newer one is saved; look again
                    break
                log(f"[trnrecipes] checkpoint {path.name} is unusable, trying the one before: {err}")
                continue
            return step, path
        else:
            return None
    return None
