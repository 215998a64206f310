"""`data to-arrow` and `data preprocess` by way of OUT.parts/ (work_dir.py): every unit of the inputs converted into a
part (parts.py, by worker processes: parallel.py), then the parts joined in input order into the output, written
under a temp name in OUT.parts/ and renamed into place. A rerun of a killed conversion reuses the parts done.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa

from trnrecipes.data import OUTPUT_IN_PLACE, DataError, listed
from trnrecipes.data.arrow import ConversionStats, NoDocuments, check_labelled, checked_batch_rows, no_documents
from trnrecipes.data.bad_records import BadRecords, rejects_of
from trnrecipes.data.batch_bytes import Mapped
from trnrecipes.data.corpus_writer import CorpusWriter, corpus_schema, shard_dir_output
from trnrecipes.data.inputs import JOB, InputFile
from trnrecipes.data.megatron_files import join, replace_pair
from trnrecipes.data.parallel import Progress, outcomes_in_order
from trnrecipes.data.parts import Task, input_stats, part_name, plan_units, remember_tokenizer
from trnrecipes.data.work_dir import (
    FORMAT,
    atomic_file,
    opened_work_dir,
    parts_path,
    remove_work_dir,
    temp_path,
)
from trnrecipes.files.durable import boot_id, durable_replace, fsync_path, make_readable


def to_arrow_in_parts(
    files: list[InputFile],
    out: Path,
    *,
    text_field: str = "text",
    label_field: str | None = None,
    on_bad_record: str = "error",
    max_bad_records: int | None = None,
    batch_rows: int | None = None,
    shard_bytes: int | None = None,
    workers: int = 1,
    progress: bool = True,
    log=print,
) -> ConversionStats:
    """arrow.to_arrow's output (the same bytes), converted by `workers` processes by way of OUT.parts/."""
    check_labelled(files, text_field, label_field)
    rows_per_batch = checked_batch_rows(batch_rows)
    schema = corpus_schema(text_field, label_field)
    stats = ConversionStats()
    bad = BadRecords(on_bad_record, max_bad_records, rejects_of(out))
    settings = {"text_field": text_field, "label_field": label_field}
    with _parts(files, out, "to-arrow", settings, {}, bad, workers, progress, log) as (work, outcomes):
        output = _file_output(Path(out), work) if shard_bytes is None else shard_dir_output(Path(out), work)
        with output as tmp, CorpusWriter(tmp, schema, rows_per_batch, shard_bytes) as writer:
            for outcome in outcomes:
                _count(stats, outcome)
                part = str(work / f"{part_name(outcome['unit'])}.arrow")
                whole = pa.memory_map(part).read_buffer()  # the batches' buffers lie in it: their texts are copied
                for batch in pa.ipc.open_stream(whole):  # from the file to the output by the kernel
                    writer.write(batch, Mapped(part, whole.address, whole.size))
            stats.rejected = bad.count
            if stats.documents == 0:
                raise no_documents(files, stats, bad)
    return stats


def preprocess_in_parts(
    files: list[InputFile],
    tokenizer,
    out_prefix: Path,
    *,
    text_field: str = "text",
    dtype: str = "auto",
    on_bad_record: str = "error",
    max_bad_records: int | None = None,
    workers: int = 1,
    progress: bool = True,
    log=print,
) -> tuple[ConversionStats, int]:
    """indexed.preprocess's output (the same bytes), tokenized by `workers` processes by way of PREFIX.parts/ and
    joined with megatron_files.join; the result is opened with megatron-core's reader before it is put in place."""
    from trnrecipes.data.indexed import _megatron, token_dtype
    from trnrecipes.data.tokenized_with import TOKENIZED_WITH, tokenizer_fingerprint, write_tokenized_with

    indexed_dataset = _megatron()  # what training reads them with (a login node's install has none: said here)
    np_dtype = np.dtype(token_dtype(tokenizer.vocab_size, dtype))
    stats, tokens, top = ConversionStats(), 0, -1
    bad = BadRecords(on_bad_record, max_bad_records, rejects_of(out_prefix))
    # eos_id: from tokenizer_config.json, which the fingerprint does not cover (Llama 3's base and instruct tokenizers
    # share a tokenizer.json and end documents with other tokens): parts made with two would mix two EOS ids
    settings = {
        "text_field": text_field,
        "tokenizer": tokenizer_fingerprint(tokenizer.path),
        "dtype": np_dtype.name,
        "eos_id": tokenizer.eos_id,
    }
    worker = {"tokenizer": str(tokenizer.path), "dtype": np_dtype.name}
    remember_tokenizer(tokenizer)
    with _parts(files, out_prefix, "preprocess", settings, worker, bad, workers, progress, log) as (work, outcomes):
        tmp = temp_path(work / Path(out_prefix).name)
        try:
            prefixes = []
            for outcome in outcomes:
                _count(stats, outcome)
                prefixes.append(work / part_name(outcome["unit"]))
                tokens += outcome["tokens"]
                top = max(top, outcome["top"])
            stats.rejected = bad.count
            if stats.documents == 0:
                raise no_documents(files, stats, bad)
            join(prefixes, tmp, np_dtype)
            if len(indexed_dataset.IndexedDataset(str(tmp))) != stats.documents:  # a kept part damaged by hand?
                raise DataError(
                    f"the parts in {work} join into a .bin/.idx megatron-core does not read {stats.documents:,}"
                    f" documents back from: a part is damaged; remove {work} and run the same command again"
                )
            write_tokenized_with(tmp, tokenizer.path, max_token_id=top)
            for suffix in (TOKENIZED_WITH, ".bin", ".idx"):
                make_readable(Path(f"{tmp}{suffix}"))
            replace_pair(tmp, out_prefix, (TOKENIZED_WITH,))
            OUTPUT_IN_PLACE.set()  # what is left is clearing up (cli._stops_raise)
        finally:
            for suffix in (".bin", ".idx", TOKENIZED_WITH):
                Path(f"{tmp}{suffix}").unlink(missing_ok=True)
    return stats, tokens


@contextlib.contextmanager
def _parts(
    files: list[InputFile],
    out: Path,
    command: str,
    settings: dict,
    worker: dict,
    bad: BadRecords,
    workers: int,
    progress: bool,
    log,
) -> Iterator[tuple[Path, Iterator[dict]]]:
    """(the work dir, every unit's outcome in input order, its bad records replayed through `bad`): the caller joins
    the parts into its output within the block. Then the rejects file is written (skip) or an old one removed, and
    the work dir too; on an error the work dir is kept where it holds parts done, for a rerun to resume."""
    work = parts_path(out)
    resumed = work.exists()
    now = input_stats(tuple(files))  # each file's [path, size, times]: the job's record, and each part's check
    job = {
        "format": FORMAT,
        "command": command,
        "inputs": [
            {"path": str(f.path.resolve()), "kind": f.kind, "split": f.split, "size": size, "mtime_ns": mtime}
            for f, (_, size, mtime, *_) in zip(files, now, strict=True)
        ],
        "settings": settings,
        "flags": {"on_bad_record": bad.policy, "max_bad_records": bad.limit},  # shape the output only: may change
        "units": plan_units(files),
    }
    with opened_work_dir(work, job, command) as saved:
        units = _units(saved, len(files), work)
        limit = 0 if bad.policy == "error" else bad.limit
        tasks = [
            Task(k, tuple(files[i] for i in unit), str(work / part_name(k)), settings["text_field"],
                 settings.get("label_field"), limit, **worker)
            for k, unit in enumerate(units)
        ]  # fmt: skip
        done, changed, rebooted = _reusable(tasks, [[now[i] for i in unit] for unit in units], work)
        if resumed:
            again = f"; converting again the parts of inputs changed since: {listed(changed, 3)}" if changed else ""
            if rebooted:
                parts = f"{rebooted} part{'s' * (rebooted > 1)}"
                again += (f"; converting again {parts} written before this machine restarted, or on another machine"
                          " (parts are not synced: a crash may have lost them)")  # fmt: skip
            log(f"[trnrecipes] resuming {work}: {len(done)} of {len(tasks)} parts already done{again}")
        sizes = [sum(now[i][1] for i in unit) for unit in units]
        bar = Progress(sum(sizes), sum(sizes[k] for k in done), progress).bar()
        rejects = temp_path(work / "rejects.jsonl")
        ordered = outcomes_in_order(tasks, done, workers, bar, work)
        try:
            with open(rejects, "w", encoding="utf-8") as sink, bar:
                bad.sink = sink if bad.policy == "skip" else None
                yield work, (_replayed(outcome, work, bad) for outcome in ordered)
            if bad.policy == "skip":
                make_readable(rejects)
                durable_replace(rejects, bad.rejects)
            elif bad.rejects.is_file():  # an earlier skip run's list described the output now replaced
                bad.rejects.unlink()
        except BaseException as err:
            ordered.close()  # stops the workers
            # Removed (by hand, meanwhile): what failed was a part's write, or the join's read. Its record is what
            # goes first or last in a removal; a dir half removed is no work dir to sync or remove files from either.
            if _removed(work / JOB) and isinstance(err, Exception):
                done = f"{out} is written, not {bad.rejects}" if OUTPUT_IN_PLACE.is_set() else f"{out} is as it was"
                raise DataError(
                    f"{work} was removed while the conversion wrote there (by hand, or a clean-up?): {done}; run the"
                    " command again"
                ) from err
            kept = _synced_parts(work)
            if kept and not isinstance(err, NoDocuments):  # a full disk, Ctrl-C, a limit raised: the parts resume
                how = "a rerun resumes from them once the error below is mended"  # the same command meets it again
                if isinstance(err, KeyboardInterrupt):  # Ctrl-C, SIGTERM
                    how = "the same command resumes"
                log(f"[trnrecipes] kept {work} with {kept} of {len(tasks)} parts done: {how}")
            else:  # nothing done, or the whole holds no documents, which a rerun meets again
                remove_work_dir(work, log)
            raise
        finally:
            rejects.unlink(missing_ok=True)
        remove_work_dir(work, log)  # under the lock: a conversion started now finds the output whole and no parts


def _removed(path: Path) -> bool:
    """Whether `path` is gone (another OSError, a flaky file system's, says nothing of it)."""
    try:
        path.stat()
    except FileNotFoundError:
        return True
    except OSError:
        pass
    return False


def _synced_parts(work: Path) -> int:
    """The parts done, each put on disk and its record marked so (no boot): a conversion stopped on an error or by
    Ctrl-C resumes from them on any machine (a killed one, from those of this boot). A part that cannot be synced
    (its storage failed) is removed: it is converted again. One whose record cannot be rewritten (the disk is full:
    what stopped the conversion) keeps its record as it was, which a rerun on this machine trusts. Returns how many
    are kept."""
    kept = 0
    for path in sorted(work.glob("part_*.json")):
        try:
            outcome = json.loads(path.read_text())
            if outcome.get("boot") is not None:
                for name in outcome["files"]:
                    fsync_path(work / name)
        except (OSError, ValueError, KeyError, AttributeError, TypeError):
            for leftover in work.glob(f"{path.stem}.*"):
                with contextlib.suppress(OSError):  # a storage failing: the error told is the conversion's own
                    leftover.unlink()
            continue
        kept += 1
        if outcome.get("boot") is not None:
            with contextlib.suppress(OSError), atomic_file(path) as f:
                f.write(json.dumps(outcome | {"boot": None}) + "\n")
    return kept


def _units(saved: dict, n: int, work: Path) -> list[list[int]]:
    """The recorded units (a resumed job keeps the cut it began with), checked to cover the files in order."""
    units = saved.get("units")
    listed_ = isinstance(units, list) and all(isinstance(u, list) for u in units)
    if not listed_ or [i for unit in units for i in unit] != list(range(n)):
        raise DataError(f"{work}/job.json: its units do not cover the {n} input files; remove {work} to start over")
    return units


def _reusable(tasks: list[Task], inputs_now: list[list], work: Path) -> tuple[dict[int, dict], list[str], int]:
    """({unit: outcome} of the parts done whose inputs are unchanged (`inputs_now`: each task's input_stats), the
    input files changed since, how many parts were written in another boot than this machine's now, unsynced). Any
    other part's files are removed: it is converted again."""
    done, changed, rebooted, boot = {}, [], 0, boot_id()
    for task, now in zip(tasks, inputs_now, strict=True):
        try:
            outcome = json.loads(Path(f"{task.part}.json").read_text())
            files = outcome["files"]
            whole = all((work / name).is_file() and (work / name).stat().st_size == n for name, n in files.items())
        except (OSError, ValueError, KeyError, AttributeError, TypeError):
            whole, outcome = False, None
        if whole and outcome.get("boot") not in (None, boot):  # None: synced (no boot id where it was written)
            whole = False
            rebooted += 1
        if whole and outcome.get("inputs") == now:
            done[task.unit] = outcome
            continue
        if whole:
            was = {path: stat for path, *stat in outcome.get("inputs", [])}
            changed += [path for path, *stat in now if was.get(path) != stat]
        for leftover in work.glob(f"{part_name(task.unit)}.*"):
            leftover.unlink()
    return done, changed, rebooted


def _replayed(outcome: dict, work: Path, bad: BadRecords) -> dict:
    """`outcome`, once its bad records have gone through `bad` in order (which raises where the policy stops), and
    its error raised where it failed."""
    if outcome["rejects"]:
        path = work / outcome["rejects"]
        try:
            with open(path, encoding="utf-8") as f:
                for line in f:
                    r = json.loads(line)
                    bad.reject(r["file"], r["reason"], line=r.get("line"), row=r.get("row"))
        finally:
            if outcome["status"] != "done":
                path.unlink(missing_ok=True)
    if outcome["status"] == "error":
        raise DataError(outcome["error"])
    if outcome["status"] != "done":  # stopped: more bad records than the limit, which the replay refused above
        raise AssertionError(f"unit {outcome['unit']}: {outcome['status']}, yet its bad records were accepted")
    return outcome


def _count(stats: ConversionStats, outcome: dict) -> None:
    stats.documents += outcome["documents"]
    stats.skipped_empty += outcome["skipped_empty"]
    stats.labels.update({label: n for label, n in outcome["labels"]})


@contextlib.contextmanager
def _file_output(out: Path, work: Path) -> Iterator[Path]:
    """A temp file in the work dir, renamed onto `out` (on disk first) when the block ends without an error."""
    tmp = temp_path(work / out.name)
    try:
        yield tmp
        make_readable(tmp)
        durable_replace(tmp, out)
        OUTPUT_IN_PLACE.set()  # what is left is clearing up (cli._stops_raise)
    finally:
        tmp.unlink(missing_ok=True)
