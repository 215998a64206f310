"""`trnrecipes predict` and `trnrecipes embed`: a classification-family checkpoint (BERT) run over a file on CPU, fp32.

predict: class probabilities for every row, and accuracy where the file has labels.
embed: the pooled embedding (`model.encode`) of every row into one Arrow file. Rows go in fixed chunks, each
written whole to OUT.parts/ (temp file, then rename) with the sha256 of its rows' text, beside a record of what
made them (row count, checkpoint, settings): a run killed halfway through millions of rows resumes at the first
missing chunk, a chunk whose rows' text has changed since is computed again, and one started with another row
count, checkpoint or settings (or an input whose text matches no chunk done) is refused rather than mixing results.
The last chunk done, they are joined into OUT and OUT.parts/ is removed. OUT.parts/ is embed's only if it made it
(created whole with embed.json in it) and holds nothing else of anyone's: any other is refused, never removed.

Every batch has one shape, [batch_size, seq_len]: the last is filled up with copies of its last row, whose outputs
are dropped, so a compiler (XLA, Neuron) would build one graph. Nothing here imports the training stack (backends,
Neuron, torch_xla, train/): inference needs only torch.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import re
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from trnrecipes import REPO_ROOT
from trnrecipes.checkpoint import MANIFEST, consolidate, read_model_checkpoint_recipe
from trnrecipes.checkpoint.format import checkpoint_recipe, newest_of_run_dir
from trnrecipes.config.families import FAMILIES, family_spec
from trnrecipes.config.sections import Recipe, RecipeError
from trnrecipes.convert import checkpoint_source
from trnrecipes.data import OUTPUT_IN_PLACE, DataError, listed
from trnrecipes.data.arrow import class_id, parse_record, read_arrow, read_row_lines, read_table
from trnrecipes.data.classify import attention_mask, encode_texts, read_labels
from trnrecipes.data.inputs import JSON_LINES, TEXT_FILE_SUFFIXES, input_stem, kind_named
from trnrecipes.data.tokenizer import TextTokenizer, load_tokenizer

TOKENIZE_ROWS = 4096  # rows tokenized at once by predict (the Rust tokenizer batches them over threads)
EMBED_FORMAT = 2  # OUT.parts/embed.json's format; 2: each chunk carries the sha256 of its rows' text
EMBED_JOB = "embed.json"
LOCK = ".lock"
CHUNK = re.compile(r"chunk_\d{6,}\.arrow")
TEMP = re.compile(r"\.(embed\.json|chunk_\d{6,}\.arrow)\.\d+-[0-9a-f]{8}\.tmp")  # _atomic's, of a killed run
ROWS_SHA256 = "trnrecipes.rows_sha256"  # a chunk's schema metadata: the sha256 of the text of its rows
TEXT_CHANGED = "text changed"  # _chunk_problem's answer for a chunk embedded from rows whose text has changed since


@dataclass
class Classifier:
    model: torch.nn.Module
    tokenizer: TextTokenizer
    recipe: Recipe
    checkpoint: dict  # checkpoint_source(): path, step, manifest_sha256
    seq_len: int
    pad_id: int

    def batches(self, texts: pa.Array, batch_size: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """(real rows, tokens, attention mask) per batch of `texts`, each batch exactly [batch_size, seq_len]."""
        tokens = encode_texts(self.tokenizer, texts.to_pylist(), self.seq_len, self.pad_id)
        for start in range(0, len(tokens), batch_size):
            batch = tokens[start : start + batch_size]
            rows = len(batch)
            if rows < batch_size:
                batch = np.concatenate([batch, np.repeat(batch[-1:], batch_size - rows, axis=0)])
            batch = torch.from_numpy(batch)
            yield rows, batch, attention_mask(batch, self.pad_id)


def open_checkpoint(ckpt: Path, log=print) -> tuple[Path, Recipe, TextTokenizer]:
    """(checkpoint, recipe, tokenizer) of a checkpoint dir, or of a run dir's newest complete checkpoint, verified;
    RecipeError for anything but a classification-family checkpoint. Its weights are read by load_classifier."""
    path, recipe = _verified_checkpoint(Path(ckpt), log)
    family = recipe.model.family
    if family_spec(family).objective != "classification":
        usable = [name for name, spec in FAMILIES.items() if spec.objective == "classification"]
        raise RecipeError(
            f"{path} holds a {family} model (objective {family_spec(family).objective!r}); predict and embed need a"
            f" classification family ({', '.join(usable)}); evaluate language models with `trnrecipes eval run`"
        )
    pad_id = recipe.model.pad_token_id
    if pad_id is None:
        raise RecipeError(f"{path}: model.pad_token_id is null; batches are padded to batch.seq_len with it")
    tokenizer_dir = path / "tokenizer"
    if not tokenizer_dir.is_dir():  # checkpoints without one: the recipe's, relative to the checkout (as to_hf)
        tokenizer_dir = REPO_ROOT / recipe.data.tokenizer
        log(f"[trnrecipes] {path} holds no tokenizer: using its recipe's data.tokenizer {tokenizer_dir}")
    tokenizer = load_tokenizer(tokenizer_dir)
    if tokenizer.vocab_size > recipe.model.vocab_size:
        raise RecipeError(
            f"tokenizer {tokenizer_dir} has {tokenizer.vocab_size} ids but the model of {path} only"
            f" {recipe.model.vocab_size} (model.vocab_size): not the tokenizer it was trained with"
        )
    return path, recipe, tokenizer


def load_classifier(path: Path, recipe: Recipe, tokenizer: TextTokenizer) -> Classifier:
    """The model of an opened checkpoint in fp32, in eval mode."""
    from trnrecipes.models import build_model

    model = build_model(recipe.model, "cpu")
    model.load_state_dict(consolidate(path), strict=True)
    model = model.float().eval()
    pad_id = recipe.model.pad_token_id
    return Classifier(model, tokenizer, recipe, checkpoint_source(path), recipe.batch.seq_len, pad_id)


def _verified_checkpoint(path: Path, log) -> tuple[Path, Recipe]:
    """(checkpoint, its recipe): `path` itself, or for a run dir its newest step_N that verifies (as eval picks)."""
    if not path.is_dir():
        raise RecipeError(f"--ckpt {path} is not a directory (a trnrecipes checkpoint, or a run dir)")
    root = path / "checkpoints"
    if not root.is_dir():
        if not (path / MANIFEST).is_file():
            raise RecipeError(
                f"--ckpt {path} is neither a checkpoint (no {MANIFEST}) nor a run dir with checkpoints (no"
                " checkpoints/); an HF model directory needs `trnrecipes convert from-hf` first"
            )
        return path, read_model_checkpoint_recipe(path)
    newest = newest_of_run_dir(path, log)  # the newest that verifies, as eval picks
    log(f"[trnrecipes] using {newest}, the newest complete checkpoint")
    return newest, checkpoint_recipe(newest)  # verified by newest_of_run_dir


def read_rows(path: Path, text_field: str) -> pa.Array:
    """The text of every row of an Arrow (memory-mapped), jsonl[.gz] or txt file, in file order. One numbering for
    every input: a row is an Arrow row or a non-blank line, counted from 0; it is the output's "row", and every
    message names a position as "row N" (with the file's line, from 1, where it has lines). No row is skipped (a
    null text or undecodable UTF-8 fails), so row i of the output is row i of the input."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"input {path} does not exist" if not path.exists() else f"input {path} is not a file")
    if path.name.lower().endswith(".arrow"):
        texts = read_arrow(path, text_field)
    elif path.name.lower().endswith(JSON_LINES):
        rows = read_row_lines(path)
        texts = pa.array((parse_record(line, where, text_field)[text_field] for where, line in rows), pa.large_string())
    elif path.name.lower().endswith(TEXT_FILE_SUFFIXES):
        texts = pa.array((line for _, line in read_row_lines(path)), pa.large_string())
    else:
        raise DataError(
            f"input {path}: unknown type; expected .arrow, .jsonl or .json (also .gz, .zst) or .txt, .md, .rst (a row"
            " a line)"
        )
    if len(texts) == 0:
        raise DataError(f"input {path} has no rows")
    return texts


def read_row_labels(path: Path, label_field: str, num_labels: int, required: bool) -> np.ndarray | None:
    """The class id of every row (Arrow column or jsonl field), or None where the file has none and none was
    asked for by name."""
    path = Path(path)
    if path.name.lower().endswith(".arrow"):
        names = read_table(path).schema.names
        if label_field in names:
            return read_labels(path, label_field, num_labels)
        found = f"its columns: {listed(names)}"
    elif path.name.lower().endswith(JSON_LINES):
        labels = _jsonl_labels(path, label_field, num_labels)
        if labels is not None:
            return labels
        found = "no row has it"
    else:
        found = "a text file has one column"
    if required:
        raise DataError(f"{path} has no label {label_field!r} ({found})")
    return None


def _jsonl_labels(path: Path, field: str, num_labels: int) -> np.ndarray | None:
    """Each row's `field` (the rows read_rows reads), a class id by to-arrow's rule (class_id); None where no row
    has one."""
    labels: list[int | None] = []
    unlabelled = None  # the first row without one
    for where, line in read_row_lines(path):
        value = parse_record(line, where).get(field)
        if value is None:
            unlabelled = unlabelled or where
        labels.append(None if value is None else class_id(value, where, field, num_labels))
    if all(v is None for v in labels):
        return None
    if unlabelled:
        raise DataError(f"{unlabelled}: no {field!r} (other rows have one)")
    return np.array(labels, dtype=np.int64)


def _progress(total: int, initial: int = 0):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit=" rows", mininterval=1.0, disable=None)


def _check_positive(**values: int | None) -> None:
    for name, value in values.items():
        if value is not None and value < 1:
            raise RecipeError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")


def predictions_path(inputs: Path) -> Path:
    """Default predict output: `<stem>.predictions.jsonl` beside the input."""
    return inputs.with_name(f"{input_stem(inputs.name)}.predictions.jsonl")  # big.jsonl.zst: big.predictions.jsonl


def check_output_kind(out: Path, writes: str) -> None:
    """RecipeError where an output's name says another kind than it holds (`writes`: "jsonl" or "arrow"): predict's
    plain JSON lines named .gz, embed's Arrow named .jsonl, which a later read takes by its name and fails on."""
    name = Path(out).name
    if kind_named(name, writes):
        what = "plain JSON lines" if writes == "jsonl" else "an Arrow stream"
        example = Path(out).with_name(f"{input_stem(name)}.{writes}")
        raise RecipeError(f"--out {out}: writes {what}, but the name says another kind; name it .{writes} (e.g."
                          f" {example})")  # fmt: skip


def summary_path(out: Path) -> Path:
    """predict's summary beside its output: `<out stem>.summary.json`."""
    return out.with_name(f"{out.stem}.summary.json")


def parts_path(out: Path) -> Path:
    """embed's work in progress: OUT.parts/ beside OUT."""
    return out.with_name(out.name + ".parts")


def _keep_others(out: Path, checkpoint: dict, inputs: Path, log) -> None:
    """Predictions already at `out` of another checkpoint or input (its summary says) are moved to
    `<out stem>.earlier/<time>/`, not replaced: eval.sbatch writes RUN_DIR/eval/predictions.jsonl for each newest
    checkpoint, and a second `predict` on the same input would take the first one's name. The same checkpoint on
    the same input is a rerun: replaced."""
    summary = summary_path(out)
    try:
        earlier = json.loads(summary.read_text())
    except (OSError, ValueError):
        earlier = None
    if not isinstance(earlier, dict) or not out.exists():
        return
    same_input = earlier.get("input") in (str(inputs), os.path.abspath(inputs))
    if earlier.get("checkpoint") == checkpoint and same_input:
        return
    aside = out.with_name(f"{out.stem}.earlier") / time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    while aside.exists():
        aside = aside.with_name(aside.name + "+")
    aside.mkdir(parents=True)
    for path in (out, summary):
        os.replace(path, aside / path.name)
    was = earlier.get("checkpoint")
    log(
        f"[trnrecipes] {out} held predictions of {was.get('path') if isinstance(was, dict) else was} on"
        f" {earlier.get('input')}: moved with its summary to {aside}"
    )


def predict(
    ckpt: Path,
    inputs: Path,
    out: Path | None = None,
    *,
    batch_size: int = 32,
    text_field: str | None = None,
    label_field: str | None = None,
    threads: int | None = None,
    scored: bool = True,
    log=print,
) -> dict:
    """Writes `out` (one JSON line per row: row, label, probs) and `<out stem>.summary.json`; returns the summary.
    text_field / label_field default to the checkpoint recipe's data section; `scored` False reads no labels (a
    file whose label column is no class ids: star ratings, a regression target)."""
    _check_positive(batch_size=batch_size, threads=threads)
    if threads:
        torch.set_num_threads(threads)
    opened = open_checkpoint(ckpt, log)
    data, num_labels = opened[1].data, opened[1].model.num_labels
    texts = read_rows(inputs, text_field or data.text_field)
    labels = None
    if scored:
        try:
            labels = read_row_labels(inputs, label_field or data.label_field, num_labels, label_field is not None)
        except DataError as err:
            if label_field is not None:
                raise
            raise DataError(f"{err} (read for accuracy, the recipe's label: --no-labels predicts without)") from None
    clf = load_classifier(*opened)
    out = Path(out) if out else predictions_path(Path(inputs))
    _keep_others(out, clf.checkpoint, inputs, log)
    predicted = np.empty(len(texts), dtype=np.int64)
    block = batch_size * math.ceil(TOKENIZE_ROWS / batch_size)
    with _atomic(out, "w") as f, torch.inference_mode(), _progress(len(texts)) as bar:
        for block_start in range(0, len(texts), block):
            row = block_start
            for rows, tokens, mask in clf.batches(texts.slice(block_start, block), batch_size):
                probs = torch.softmax(clf.model(tokens, mask).float(), dim=-1)[:rows]
                predicted[row : row + rows] = probs.argmax(dim=-1).numpy()
                for i, p in enumerate(probs.tolist()):
                    f.write(json.dumps({"row": row + i, "label": int(predicted[row + i]), "probs": p}) + "\n")
                row += rows
                bar.update(rows)
    summary = {
        "rows": len(texts),
        "input": str(inputs),
        "predictions": str(out),
        "checkpoint": clf.checkpoint,
        "label_field": None if labels is None else label_field or data.label_field,
    } | _scores(predicted, labels, num_labels)
    with _atomic(summary_path(out), "w") as f:
        f.write(json.dumps(summary, indent=2) + "\n")
    OUTPUT_IN_PLACE.set()  # done: a stop now ends the command as done (cli._stops_raise)
    return summary | {"summary": str(summary_path(out))}


def _scores(predicted: np.ndarray, labels: np.ndarray | None, num_labels: int) -> dict:
    """Per-class counts; with labels, accuracy and the majority-class baseline (the most frequent true label's
    share: what always answering it would score)."""
    counts = np.bincount(predicted, minlength=num_labels)
    if labels is None:
        return {"classes": {str(c): {"predicted": int(counts[c])} for c in range(num_labels)}}
    truth = np.bincount(labels, minlength=num_labels)
    correct = np.bincount(labels[predicted == labels], minlength=num_labels)
    return {
        "accuracy": float((predicted == labels).mean()),
        "majority_class": int(truth.argmax()),
        "majority_class_accuracy": float(truth.max() / len(labels)),
        "classes": {
            str(c): {"true": int(truth[c]), "predicted": int(counts[c]), "correct": int(correct[c])}
            for c in range(num_labels)
        },
    }


def embed(
    ckpt: Path,
    inputs: Path,
    out: Path,
    *,
    batch_size: int = 64,
    chunk_rows: int = 4096,
    text_field: str | None = None,
    threads: int | None = None,
    log=print,
) -> dict:
    """Writes `out`: columns row (int64) and embedding (fixed_size_list<float32>[hidden]), one row per input row,
    by way of OUT.parts/ (resumable, see the module docstring). Returns the job record (also in out's metadata)."""
    _check_positive(batch_size=batch_size, chunk_rows=chunk_rows, threads=threads)
    if chunk_rows % batch_size:
        raise RecipeError(
            f"--chunk-rows {chunk_rows} must be a multiple of --batch-size {batch_size} (every batch one shape),"
            f" e.g. {batch_size * max(1, round(chunk_rows / batch_size))}"
        )
    if threads:
        torch.set_num_threads(threads)
    out = Path(out)
    parts = parts_path(out)
    if out.exists() and not parts.exists():
        raise RecipeError(f"{out} already exists; choose another --out, or remove it")
    if parts.exists() or parts.is_symlink():
        _check_ours(parts)  # before the checkpoint is read: refused in a second, not after loading the model
    opened = open_checkpoint(ckpt, log)
    text_field = text_field or opened[1].data.text_field
    texts = read_rows(inputs, text_field)
    clf = load_classifier(*opened)
    hidden = clf.recipe.model.hidden_size
    job = {
        "format": EMBED_FORMAT,
        "input": _fingerprint(Path(inputs), texts) | {"text_field": text_field},
        "checkpoint": clf.checkpoint,
        "settings": {"batch_size": batch_size, "chunk_rows": chunk_rows, "seq_len": clf.seq_len},
        "hidden_size": hidden,
    }
    rows = len(texts)
    spans = [(start, min(start + chunk_rows, rows)) for start in range(0, rows, chunk_rows)]
    _make_parts(parts, job)
    with _locked(parts):
        made_from = _start_or_resume(parts, job)["input"].get("path")
        elsewhere = made_from != job["input"]["path"]  # a copy of the input resumes; a wrong --in must not
        todo = _chunks_to_compute(
            parts, spans, texts, elsewhere, f"--in {inputs}; they were made from {made_from}", log
        )
        if len(todo) < len(spans):
            log(f"[trnrecipes] resuming {parts}: {len(spans) - len(todo)} of {len(spans)} chunks already done")
        done_rows = rows - sum(spans[k][1] - spans[k][0] for k in todo)
        with torch.inference_mode(), _progress(rows, done_rows) as bar:
            for k in todo:
                start, stop = spans[k]
                pieces = []
                for real, tokens, mask in clf.batches(texts.slice(start, stop - start), batch_size):
                    pieces.append(clf.model.encode(tokens, mask)[:real].float().numpy())
                digest = _rows_sha256(texts, start, stop)  # hashed as they are embedded: the input is read once
                _write_chunk(parts / _chunk_name(k), start, np.concatenate(pieces), hidden, digest)
                bar.update(stop - start)
        _join(parts, len(spans), out, job)
        OUTPUT_IN_PLACE.set()  # what is left is clearing up: a stop now ends the command as done (cli._stops_raise)
        _remove_parts(parts, log)  # under the lock: an embed started now finds OUT whole and no parts
    return job


def _foreign(parts: Path) -> list[str]:
    """The entries of `parts` that embed does not write: anything but its record, its lock, chunk files and the temp
    files of its writes (regular files all, no links)."""
    ours = (EMBED_JOB, LOCK)
    return sorted(
        e.name
        for e in os.scandir(parts)
        if not e.is_file(follow_symlinks=False)
        or not (e.name in ours or CHUNK.fullmatch(e.name) or TEMP.fullmatch(e.name))
    )


def _check_ours(parts: Path) -> None:
    """RecipeError unless `parts` is a work dir embed made: a directory (not a link) holding its record and nothing
    but embed's own files. Embed removes its work dir when done, so it must never adopt one it did not make."""
    if parts.is_symlink() or not parts.is_dir():
        raise RecipeError(f"{parts} exists and is not a directory embed made; move it away or choose another --out")
    if not (parts / EMBED_JOB).is_file():
        raise RecipeError(
            f"{parts} exists and was not made by `trnrecipes embed` (no {EMBED_JOB} in it): embed removes its work"
            " dir when done, so it uses none it did not make; move it away or choose another --out"
        )
    if foreign := _foreign(parts):
        raise RecipeError(
            f"{parts} holds files `trnrecipes embed` did not write ({listed(foreign, limit=5)}): embed removes that"
            " dir when done; move them out of it (its chunks then resume) or choose another --out"
        )


def _make_parts(parts: Path, job: dict) -> None:
    """OUT.parts/ created whole, the job's record already in it (a temp dir renamed into place), so that a dir
    without the record is never embed's; or, where one is already there, checked to be embed's."""
    if not parts.exists():
        parts.parent.mkdir(parents=True, exist_ok=True)
        staging = parts.with_name(f".{parts.name}.{os.getpid()}-{secrets.token_hex(4)}")
        staging.mkdir()  # not mkdtemp: its mode 0700 would stay on OUT.parts
        with _atomic(staging / EMBED_JOB, "w") as f:
            f.write(json.dumps(job, indent=2) + "\n")
        try:
            os.rename(staging, parts)  # fails if another embed made it first (its record in it: not empty)
            return
        except OSError:
            (staging / EMBED_JOB).unlink()
            staging.rmdir()
            if not parts.exists():
                raise
    _check_ours(parts)


def _remove_parts(parts: Path, log) -> None:
    """Removes embed's files from `parts`, then `parts` itself if nothing else is in it (a file put there while embed
    ran stays, and so does the dir)."""
    foreign = _foreign(parts)
    for name in sorted(set(os.listdir(parts)) - set(foreign)):
        (parts / name).unlink()
    if foreign:
        log(f"[trnrecipes] left {parts} in place: it holds files embed did not write ({listed(foreign, limit=5)})")
    else:
        parts.rmdir()


def _fingerprint(path: Path, texts: pa.Array) -> dict:
    """The job record's input: its row count, which fixes every chunk's rows (so it must match to resume), and its
    path and size, which only describe it (a copy of the file resumes). The text is checked chunk by chunk."""
    return {"path": str(path.resolve()), "size": path.stat().st_size, "rows": len(texts)}


def _rows_sha256(texts: pa.Array, start: int, stop: int) -> str:
    """sha256 of the text of rows [start, stop), read where it already is (the memory-mapped Arrow input, or the
    array read_rows built), no copy: the rows' byte lengths, then their bytes, so that no two lists of rows hash
    alike. The same for string and large_string, and for any chunking of the column."""
    lengths, data = hashlib.sha256(), hashlib.sha256()
    rows = texts.slice(start, stop - start)
    for piece in rows.chunks if isinstance(rows, pa.ChunkedArray) else [rows]:
        if len(piece) == 0:
            continue
        _, offsets_buffer, data_buffer = piece.buffers()
        width = np.int64 if pa.types.is_large_string(piece.type) else np.int32
        offsets = np.frombuffer(offsets_buffer, dtype=width)[piece.offset : piece.offset + len(piece) + 1]
        lengths.update(np.diff(offsets).astype("<i8").tobytes())
        if data_buffer is not None:  # all rows empty
            data.update(memoryview(data_buffer)[int(offsets[0]) : int(offsets[-1])])
    return hashlib.sha256(lengths.digest() + data.digest()).hexdigest()


def _differences(saved: dict, job: dict) -> list[str]:
    """What differs between the job that wrote OUT.parts and this one, in words."""
    diffs = []
    was, now = saved.get("input", {}), job["input"]
    # rows fix the chunks' rows; a changed text is no refusal: each chunk checks its own rows' (_chunks_to_compute)
    changed = [f"{key} {was.get(key)} -> {now[key]}" for key in ("rows", "text_field") if was.get(key) != now[key]]
    if changed:
        path = now["path"] if was.get("path") == now["path"] else f"{was.get('path')} -> {now['path']}"
        diffs.append(f"input {path}: {', '.join(changed)}")
    was, now = saved.get("checkpoint", {}), job["checkpoint"]
    if was.get("manifest_sha256") != now["manifest_sha256"]:
        diffs.append(
            f"checkpoint {was.get('path')} (step {was.get('step')}) -> {now['path']} (step {now['step']}):"
            f" other weights (manifest sha256 differs; --ckpt {was.get('path')} resumes)"
        )
    for key, value in job["settings"].items():
        if saved.get("settings", {}).get(key) != value:
            diffs.append(f"{key} {saved.get('settings', {}).get(key)} -> {value}")
    if saved.get("format") != job["format"]:
        diffs.append(f"format {saved.get('format')} -> {job['format']} (made by another version of trnrecipes)")
    if saved.get("hidden_size") != job["hidden_size"]:
        diffs.append(f"hidden_size {saved.get('hidden_size')} -> {job['hidden_size']}")
    return diffs


def _start_or_resume(parts: Path, job: dict) -> dict:
    """Check that the job OUT.parts records is this one (_make_parts wrote it in a new one); drop stale temp files.
    Returns the recorded job."""
    for stale in os.listdir(parts):  # a killed run's half-written chunk: under the lock, nobody is writing it
        if TEMP.fullmatch(stale):
            (parts / stale).unlink()
    record = parts / EMBED_JOB
    try:
        saved = json.loads(record.read_text())
    except (OSError, ValueError) as err:
        raise RecipeError(f"{record}: unreadable ({err}); remove {parts} to start over") from None
    if diffs := _differences(saved if isinstance(saved, dict) else {}, job):
        raise RecipeError(
            f"{parts} holds a partial embedding made with another input, checkpoint or settings: {'; '.join(diffs)}."
            f" Rerun with the same ones to resume, or remove {parts} (or choose another --out) to start over"
        )
    return saved


def _chunk_name(k: int) -> str:
    return f"chunk_{k:06d}.arrow"


def _chunks_to_compute(
    parts: Path, spans: list[tuple[int, int]], texts: pa.Array, elsewhere: bool, inputs: str, log
) -> list[int]:
    """The chunks to compute: those missing, damaged, or embedded from rows whose text has changed since (the last two
    removed, and said). Only the chunks there are hashed now. When the input is another file than the one they
    were made from (`elsewhere`) and none matches its rows' text, they are another input's: refused, nothing removed
    (a wrong --in must not throw away the partial work of the right one); an input edited in place is recomputed
    where it changed."""
    paths = [parts / _chunk_name(k) for k in range(len(spans))]
    problems = {
        k: _chunk_problem(path, *spans[k], _rows_sha256(texts, *spans[k]))
        for k, path in enumerate(paths)
        if path.exists()
    }
    changed = [k for k, problem in problems.items() if problem == TEXT_CHANGED]
    if elsewhere and changed and None not in problems.values():
        raise RecipeError(
            f"{parts} holds the embedding of other text: in all {len(changed)} chunk(s) done, the rows' text differs"
            f" from {inputs}. Rerun with that input to resume, or remove {parts} (or use another --out) to start over"
        )
    for k, problem in problems.items():
        if problem not in (None, TEXT_CHANGED):
            log(f"[trnrecipes] {paths[k]} {problem}: computing it again")
        if problem is not None:
            paths[k].unlink()
    if changed:
        ranges = listed([f"[{spans[k][0]}, {spans[k][1]})" for k in changed], limit=5)
        log(f"[trnrecipes] the text of rows {ranges} changed since embedded: computing {len(changed)} chunk(s) again")
    return [k for k in range(len(spans)) if problems.get(k, "missing") is not None]


def _chunk_problem(path: Path, start: int, stop: int, rows_sha256: str) -> str | None:
    """Why chunk file `path` is not the embedding of rows [start, stop) as their text is now; None if it is."""
    try:
        chunk = _read_stream(path)
        rows = chunk.column("row").to_numpy()
    except (pa.ArrowException, OSError, KeyError) as err:
        return f"unreadable ({err})"
    if not np.array_equal(rows, np.arange(start, stop)):
        return f"holds rows {rows[:1]}..{rows[-1:]} ({len(rows)}), not [{start}, {stop})"
    if (chunk.schema.metadata or {}).get(ROWS_SHA256.encode()) != rows_sha256.encode():
        return TEXT_CHANGED
    return None


def _read_stream(path: Path) -> pa.Table:
    return pa.ipc.open_stream(pa.memory_map(str(path))).read_all()


def _schema(hidden: int, metadata: dict | None = None) -> pa.Schema:
    return pa.schema([("row", pa.int64()), ("embedding", pa.list_(pa.float32(), hidden))], metadata=metadata)


def _write_chunk(path: Path, start: int, embeddings: np.ndarray, hidden: int, rows_sha256: str) -> None:
    """The chunk and the sha256 of its rows' text in one file, written whole (_atomic): never one without the other."""
    flat = pa.array(np.ascontiguousarray(embeddings, dtype=np.float32).reshape(-1))
    row = pa.array(np.arange(start, start + len(embeddings), dtype=np.int64))
    schema = _schema(hidden, {ROWS_SHA256: rows_sha256})
    table = pa.table([row, pa.FixedSizeListArray.from_arrays(flat, hidden)], schema=schema)
    with _atomic(path, "wb") as f, pa.ipc.new_stream(f, table.schema) as writer:
        writer.write_table(table)


def _join(parts: Path, chunks: int, out: Path, job: dict) -> None:
    """Every chunk, in row order, into `out` (atomically), the job recorded in the schema's metadata."""
    schema = _schema(job["hidden_size"], {"trnrecipes.embed": json.dumps(job)})
    with _atomic(out, "wb") as f, pa.ipc.new_stream(f, schema) as writer:
        for k in range(chunks):
            writer.write_table(_read_stream(parts / _chunk_name(k)).replace_schema_metadata(schema.metadata))


@contextlib.contextmanager
def _locked(parts: Path):
    """One embed at a time per OUT: a second would race the first over the same chunks."""
    with open(parts / LOCK, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RecipeError(f"another `trnrecipes embed` is writing {parts}; wait for it or stop it") from None
        yield


@contextlib.contextmanager
def _atomic(path: Path, mode: str):
    """An open temp file beside `path` that becomes `path` (synced, renamed) only if the block completes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        _publish(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _publish(tmp: Path, path: Path) -> None:  # a function of its own: tests slow it to kill a run between chunks
    os.replace(tmp, path)
