"""`data to-arrow` and `data preprocess` in worker processes (docs/data.md, "Workers, resume and shards"): the same
bytes and the same bad-record verdicts for any --workers, a conversion killed halfway resumed from its parts in
OUT.parts/ (which is never used nor removed unless a conversion made it), and a directory of shards
(--shard-bytes) that training, sbatch and plan read as one corpus."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import REPO
from test_data import take
from test_data_inputs import GPT2, docs, texts_of, write

from trnrecipes.cli import main
from trnrecipes.data import DataError, listed, parts
from trnrecipes.data.arrow import ArrowTexts, file_records, file_texts, to_arrow
from trnrecipes.data.bad_records import BadRecords
from trnrecipes.data.indexed import preprocess
from trnrecipes.data.inputs import InputFile
from trnrecipes.data.pack import PackedStream, StreamPosition, split_documents
from trnrecipes.data.sources import open_documents
from trnrecipes.data.tokenizer import load_tokenizer


@pytest.fixture
def a_unit_a_file(monkeypatch):
    """Every input file a unit of its own, as shards of 128 MB are (these are a few KB)."""
    monkeypatch.setattr(parts, "UNIT_BYTES", 1)


def cli(capsys, *argv: str | Path | int) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def corpus(root: Path, files: int = 4, each: int = 300) -> Path:
    for k in range(files):
        write(root / f"{k:02d}.jsonl", docs(*[f"shard {k} document {i} " + "word " * (i % 13) for i in range(each)]))
    return root


def batches_of(path: Path) -> list[int]:
    return [b.num_rows for b in pa.ipc.open_stream(pa.memory_map(str(path)))]


def files_of(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


def test_any_number_of_workers_writes_the_same_bytes(tmp_path, capsys, a_unit_a_file):
    src = corpus(tmp_path / "in")
    for w in (1, 2):
        out = tmp_path / f"w{w}.arrow"
        argv = ["--in", src, "--out", out, "--workers", w, "--batch-rows", 250]
        code, stdout, err = cli(capsys, "data", "to-arrow", *argv)
        assert (code, stdout) == (0, f"wrote {out}: 1200 documents\n"), err
        shards = tmp_path / f"shards{w}"
        argv = ["--shard-bytes", "20K", "--batch-rows", 100, "--workers", w]
        assert cli(capsys, "data", "to-arrow", "--in", src, "--out", shards, *argv)[0] == 0
    assert (tmp_path / "w1.arrow").read_bytes() == (tmp_path / "w2.arrow").read_bytes()
    assert batches_of(tmp_path / "w2.arrow") == [250] * 4 + [200]  # batches of the whole, not of each file
    to_arrow([src], tmp_path / "one.arrow", batch_rows=250, progress=False)  # one process, no parts
    assert (tmp_path / "one.arrow").read_bytes() == (tmp_path / "w2.arrow").read_bytes()
    assert files_of(tmp_path / "shards1") == files_of(tmp_path / "shards2")
    assert len(files_of(tmp_path / "shards2")) > 3
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "in",
        "one.arrow",
        "shards1",
        "shards2",
        "w1.arrow",
        "w2.arrow",
    ]


def test_preprocess_writes_the_same_bin_and_idx_for_any_number_of_workers(tmp_path, capsys, a_unit_a_file):
    src = corpus(tmp_path / "in", files=3, each=200)
    for w in (1, 2):
        argv = ["--in", src, "--tokenizer", GPT2, "--out", tmp_path / f"w{w}", "--workers", w]
        code, stdout, err = cli(capsys, "data", "preprocess", *argv)
        assert code == 0 and stdout.startswith(f"wrote {tmp_path / f'w{w}'}.bin/.idx: 600 documents"), err
    preprocess([src], load_tokenizer(GPT2), tmp_path / "one", progress=False)
    for suffix in (".bin", ".idx"):
        one = Path(f"{tmp_path / 'one'}{suffix}").read_bytes()
        assert Path(f"{tmp_path / 'w1'}{suffix}").read_bytes() == one == Path(f"{tmp_path / 'w2'}{suffix}").read_bytes()
    assert not list(tmp_path.glob("*.parts"))


def test_preprocess_resumes_only_with_the_same_eos_and_a_damaged_part_is_one_line(tmp_path, capsys, a_unit_a_file):
    """Two tokenizers with one tokenizer.json may end documents with other tokens (their tokenizer_config.json):
    parts of one are not resumed with the other, which would mix two EOS ids in one .bin. A kept part whose record
    no longer matches its files (damaged by hand) is one line saying to start over, not a traceback."""
    import json as json_
    import shutil

    src = corpus(tmp_path / "in", files=2, each=20)
    good = (src / "01.jsonl").read_bytes()
    write(src / "01.jsonl", good + b"{broken\n")
    argv = ["data", "preprocess", "--in", src, "--out", tmp_path / "o", "--workers", 1]
    assert cli(capsys, *argv, "--tokenizer", GPT2)[0] == 2  # the first part kept
    other = shutil.copytree(GPT2, tmp_path / "gpt2-other-eos")
    config = json_.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json_.dumps({**config, "eos_token": "!"}))
    code, _, err = cli(capsys, *argv, "--tokenizer", other)
    assert code == 2 and "other inputs or settings: eos_id 50256 -> 0" in err, err
    record = tmp_path / "o.parts/part_000000.json"
    record.write_text(json_.dumps({**json_.loads(record.read_text()), "documents": 21}))
    write(src / "01.jsonl", good)
    code, _, err = cli(capsys, *argv, "--tokenizer", GPT2)
    assert code == 2 and err.endswith(
        f"megatron-core does not read 41 documents back from: a part is damaged; remove {tmp_path / 'o.parts'} and"
        " run the same command again\n"
    ), err
    assert not Path(f"{tmp_path / 'o'}.bin").exists()


@pytest.mark.parametrize("killed_at", [0, 1, 2, 3])
def test_a_megatron_pair_replaced_midway_is_never_a_new_bin_beside_an_old_idx(tmp_path, monkeypatch, killed_at):
    """A time limit during the renames that put a new .bin/.idx and tokenizer record in place of old ones: whatever
    rename it stops at, no old .idx lies beside a new .bin, and no record names the tokenizer of other ids."""
    from trnrecipes.data import megatron_files

    old, new = tmp_path / "corpus", tmp_path / ".corpus.tmp"
    for prefix, which in ((old, "old"), (new, "new")):
        for suffix in (".bin", ".idx", ".tokenizer.json"):
            Path(f"{prefix}{suffix}").write_text(which)
    renames, rename_synced = [], megatron_files.rename_synced

    def killed(tmp, out) -> None:
        if len(renames) == killed_at:
            raise KeyboardInterrupt
        renames.append(out)
        rename_synced(tmp, out)

    monkeypatch.setattr(megatron_files, "rename_synced", killed)
    if killed_at < 3:
        with pytest.raises(KeyboardInterrupt):
            megatron_files.replace_pair(new, old, (".tokenizer.json",))
    else:
        megatron_files.replace_pair(new, old, (".tokenizer.json",))
    left = {s: Path(f"{old}{s}").read_text() for s in (".bin", ".idx", ".tokenizer.json") if Path(f"{old}{s}").exists()}
    assert left.get(".idx", left.get(".bin")) == left.get(".bin", left.get(".idx")), left  # never a mixed pair
    assert ".tokenizer.json" not in left or left == {".bin": "new", ".idx": "new", ".tokenizer.json": "new"}, left


def test_a_tokenizer_of_sparse_ids_gets_the_dtype_of_its_largest_id(tmp_path, capsys):
    """A vocabulary of 4 tokens whose EOS is id 70,000: uint16 would wrap it to 4,464 without a word."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2, "</s>": 70_000}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    assert load_tokenizer(tok_dir).vocab_size == 70_001
    src = write(tmp_path / "a.jsonl", docs("hello world"))
    code, _, err = cli(capsys, "data", "preprocess", "--in", src, "--tokenizer", tok_dir, "--out", tmp_path / "o",
                       "--dtype", "uint16")  # fmt: skip
    assert code == 2 and "does not fit in uint16" in err, err
    assert cli(capsys, "data", "preprocess", "--in", src, "--tokenizer", tok_dir, "--out", tmp_path / "o")[0] == 0
    assert np.fromfile(f"{tmp_path / 'o'}.bin", np.int32).tolist() == [1, 2, 70_000]
    code, _, err = cli(capsys, "data", "preprocess", "--in", src, "--tokenizer", tok_dir, "--out", tmp_path / "o.bin")
    assert (code, err) == (2, f"error: --out {tmp_path / 'o.bin'}: give the prefix, without .bin/.idx (writes"
                              " PREFIX.bin and PREFIX.idx)\n")  # fmt: skip


def test_an_old_shard_directory_left_by_a_killed_replace_is_removed_by_the_next(tmp_path, capsys):
    """--shard-bytes moves the old directory aside (.OUT.PID-xxxx.tmp) and removes it once the new one is in place:
    a time limit during that removal left a hidden copy of the whole old corpus that nothing removed. The next
    conversion of the same --out removes it; one of a process still running is left to it."""
    src, out = corpus(tmp_path / "in", files=2, each=30), tmp_path / "s"
    argv = ["data", "to-arrow", "--in", src, "--out", out, "--shard-bytes", "2K"]
    assert cli(capsys, *argv)[0] == 0
    dead, alive = tmp_path / f".s.{2**22 + 1}-0a0b0c0d.tmp", tmp_path / f".s.{os.getpid()}-0a0b0c0d.tmp"
    for copy in (dead, alive):
        shutil.copytree(out, copy)
    assert cli(capsys, *argv)[0] == 0
    assert not dead.exists() and alive.exists()


def test_a_staging_work_dir_left_by_a_kill_as_it_was_made_is_removed_by_the_next(tmp_path, capsys):
    """The work dir is made whole under a hidden name, then renamed: a kill in between left that hidden dir beside
    the output for good. The next conversion removes one of a process no longer running here, made a minute ago or
    more, that holds nothing but a job record; one of a running process, one just made (by a process on another
    node, whose pid says nothing here), or one holding anything else stays."""
    src, out = corpus(tmp_path / "in", files=2, each=30), tmp_path / "o.arrow"
    pids = (2**22 + 1, os.getpid(), 2**22 + 2, 2**22 + 3)
    dead, alive, held, fresh = (tmp_path / f".o.arrow.parts.{pid}-0a0b0c0d.tmp" for pid in pids)
    for staging in (dead, alive, held, fresh):
        staging.mkdir()
        (staging / f".job.json.{2**22 + 1}-01020304.tmp").write_text("{")
        if staging is held:
            (held / "notes.txt").write_text("mine")
        if staging is not fresh:
            os.utime(staging, (time.time() - 120, time.time() - 120))
    assert cli(capsys, "data", "to-arrow", "--in", src, "--out", out)[0] == 0
    assert not dead.exists() and alive.exists() and fresh.exists() and (held / "notes.txt").read_text() == "mine"


def test_bad_records_get_the_same_verdict_and_rejects_for_any_number_of_workers(tmp_path, capsys, a_unit_a_file):
    """The first file's bad record is its last line; the second's is its first, which the other worker meets first:
    the error names the first file's, as one process reading them in a row would."""
    first = write(tmp_path / "in/0.jsonl", docs(*[f"good {i}" for i in range(4000)]) + b"{broken\n")
    second = write(tmp_path / "in/1.jsonl", b"{also broken\n" + docs("after"))
    write(tmp_path / "in/2.jsonl", docs("last"))
    src, out = tmp_path / "in", tmp_path / "o.arrow"
    verdicts = {}
    for w in (1, 2):
        code, _, err = cli(capsys, "data", "to-arrow", "--in", src, "--out", out, "--workers", w)
        assert code == 2 and err.splitlines()[-1].startswith(f"error: {first}:4001: not valid JSON ("), err
        code, _, limit = cli(capsys, "data", "to-arrow", "--in", src, "--out", out, "--workers", w,
                             "--on-bad-record", "skip", "--max-bad-records", 1)  # fmt: skip
        assert code == 2 and not out.exists()
        code, stdout, _ = cli(capsys, "data", "to-arrow", "--in", src, "--out", out, "--workers", w,
                              "--on-bad-record", "skip")  # fmt: skip
        assert code == 0 and stdout.endswith(", rejected 2 bad records (listed in " + f"{out}.rejects.jsonl)\n")
        rejects = Path(f"{out}.rejects.jsonl").read_bytes()
        verdicts[w] = (err.splitlines()[-1], limit.splitlines()[-1], texts_of(out), rejects)
        out.unlink()
    assert verdicts[1] == verdicts[2]
    _, limit, texts, rejects = verdicts[2]
    assert limit.startswith(f"error: {second}:1: not valid JSON (") and f"(the first: {first}:4001: not valid" in limit
    listed = [(r["file"], r["line"]) for r in map(json.loads, rejects.splitlines())]
    assert listed == [(str(first), 4001), (str(second), 1)]
    assert texts[-2:] == ["after", "last"] and len(texts) == 4002


def test_the_quicker_json_lines_loop_reads_what_the_line_by_line_reader_reads(tmp_path):
    """Blank lines, CRLF, a BOM, bad records of every kind, whitespace-only and non-ASCII texts, a duplicate key, a
    last line without a newline: the same texts and the same bad records, in the same order."""
    lines = [b'{"text": "plain"}', b"", b" \t ", b'{"text": "crlf"}\r', b'{"text": null}', b'{"text": 5}',
             b'{"body": "no text"}', b"[1, 2]", b'"a string"', b"null", b'{"text": "a", "text": "b"}',
             b'{"text": "x"} trailing', b'\xef\xbb\xbf{"text": "bom"}', b'{"text": "\xff"}', b'{"text": "  "}',
             b'{"text": "\\u2003"}', b'{"text": "caf\\u00e9 \\ud83d\\ude00", "meta": {"a": [1, null]}}',
             b'{"text": "big", "n": ' + b"9" * 5000 + b"}", b'{"text": "last"}']  # fmt: skip
    src = InputFile(write(tmp_path / "tricky.jsonl", b"\n".join(lines)), "jsonl")
    quick, one_by_one = BadRecords("skip"), BadRecords("skip")
    quick.sink, one_by_one.sink = io.StringIO(), io.StringIO()
    texts = [text for block, _ in file_texts(src, "text", quick, None) for text in as_list(block)]
    assert texts == [text for text, _ in file_records(src, "text", one_by_one, None)]
    assert texts == ["plain", "crlf", "b", "  ", "\u2003", "caf\u00e9 \U0001f600", "big", "last"]
    assert quick.sink.getvalue() == one_by_one.sink.getvalue() and quick.count == one_by_one.count == 9


def as_list(texts: pa.Array | list[str]) -> list[str]:
    return texts.to_pylist() if isinstance(texts, pa.Array) else texts


def test_a_killed_conversion_resumes_from_the_parts_done(tmp_path, capsys, a_unit_a_file):
    src = corpus(tmp_path / "in", files=6, each=200)
    out, work = tmp_path / "o.arrow", tmp_path / "o.arrow.parts"
    argv = ["data", "to-arrow", "--in", str(src), "--out", str(out), "--workers", "2"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "SLOW_PARTS_PAUSE_S": "0.4"}
    proc = subprocess.Popen([sys.executable, str(REPO / "tests/slow_parts.py"), *argv], env=env, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not list(work.glob("part_*.json")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)
    workers = children(proc.pid)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    gone_by = time.monotonic() + 20  # the workers see their parent gone, and stop
    while any(Path(f"/proc/{pid}").exists() for pid in workers) and time.monotonic() < gone_by:
        time.sleep(0.05)
    assert workers and not [pid for pid in workers if Path(f"/proc/{pid}").exists()]
    done = sorted(p.name for p in work.glob("part_*.json"))
    assert 1 <= len(done) < 6 and not out.exists(), (done, proc.stderr.read())
    code, stdout, err = cli(capsys, *argv[:-2], "--workers", 1)
    assert code == 0 and stdout == f"wrote {out}: 1200 documents\n"
    assert err.startswith(f"[trnrecipes] resuming {work}: {len(done)} of 6 parts already done\n"), err
    assert not work.exists()
    to_arrow([src], tmp_path / "straight.arrow", progress=False)
    assert out.read_bytes() == (tmp_path / "straight.arrow").read_bytes()


def started(argv: list[str], work: Path, pause_s: float, hold: Path | None = None, env: dict | None = None,
            **popen) -> subprocess.Popen:  # fmt: skip
    """tests/slow_parts.py running `argv`, once its first part is done; with `hold` (a new directory), once both
    spawned workers hold their first unit (tests/slow_parts.py: SLOW_PARTS_HOLD), each amid it until `hold`/go:
    --workers 3, the first process converting the other units. `env`: more of slow_parts.py's settings."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "SLOW_PARTS_PAUSE_S": str(pause_s), "SLOW_PARTS_BUSY": "1",
           **(env or {})}  # fmt: skip
    if hold is not None:
        hold.mkdir()
        env["SLOW_PARTS_HOLD"] = str(hold)
    proc = subprocess.Popen([sys.executable, str(REPO / "tests/slow_parts.py"), *argv], env=env,
                            stderr=subprocess.PIPE, text=True, **popen)  # fmt: skip
    deadline = time.monotonic() + 60

    def waiting() -> bool:
        return len(holders(hold)) < 2 if hold is not None else not list(work.glob("part_*.json"))

    while waiting() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)
    return proc


def communicated(proc: subprocess.Popen) -> str:
    """`proc`'s standard error once it ends; killed (its workers with it) where it has not within 120 s."""
    try:
        return proc.communicate(timeout=120)[1]
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise


def holders(hold: Path) -> list[int]:
    """The workers holding their first unit."""
    return sorted(int(p.name) for p in hold.iterdir() if p.name.isdigit())


@pytest.mark.parametrize("first", ["waits", "converts"])
def test_a_worker_killed_on_its_own_is_told_while_the_others_still_work(tmp_path, capsys, first):
    """A worker killed by the OOM killer: the first process says so while the other worker still works and sends
    progress (not once every other unit is done, hours later at TB scale), naming its file, with exit 1 (a node's
    fault, not the input's), and the rerun resumes. The other worker never finishes its unit here (nothing says go),
    so a death told only at the end would not be told within the test's 120 s. The first process is either waiting
    for an outcome with a queue kept busy by the other worker's progress (its check runs on a clock), or amid the
    very unit it waits for (its check runs from within that unit's conversion, which must not take it for the
    input's fault)."""
    src = corpus(tmp_path / "in", files=3, each=100)
    out, work = tmp_path / "o.arrow", tmp_path / "o.arrow.parts"
    argv = ["data", "to-arrow", "--in", str(src), "--out", str(out), "--workers", "3"]
    hold = tmp_path / "hold"
    env = {"SLOW_PARTS_HOLD_FIRST": "1"} if first == "converts" else {}
    proc = started(argv, work, pause_s=0.0, hold=hold, env=env)
    assert proc.poll() is None and len(holders(hold)) == 2, "the workers did not both hold a unit"
    os.kill(holders(hold)[0], signal.SIGKILL)  # its outcome unsent (not a worker still starting, which holds no unit)
    err = communicated(proc)
    assert proc.returncode == 1, err
    assert "died (signal 9: out of memory?)" in err and "rerun the same command to resume" in err, err
    done = sorted(p.name for p in work.glob("part_*.json"))
    assert done == (["part_000000.json"] if first == "waits" else []), done  # the held units: never done
    code, _, err = cli(capsys, *argv)
    resumed = f"[trnrecipes] resuming {work}: 1 of 3 parts already done\n"
    assert code == 0 and err.startswith(resumed) == (first == "waits"), err
    to_arrow([src], tmp_path / "straight.arrow", progress=False)
    assert out.read_bytes() == (tmp_path / "straight.arrow").read_bytes()


def test_workers_done_before_the_parent_reads_their_outcomes_are_not_taken_for_dead(
    tmp_path, capsys, a_unit_a_file, monkeypatch
):
    """The parent joins each part before it reads the next outcome: with a slow join of the first part, the worker
    has converted the other units and ended while their outcomes still wait in the queue. They are read, not taken for
    lost workers (the benchmark's 32 shards of 128 MB stopped so, with every part done)."""
    from trnrecipes.data import conversion

    replayed = conversion._replayed
    joined = []

    def slow_join(outcome, work, bad):
        if not joined:  # longer than the worker takes to start and convert the other units, and than ALIVE_CHECK_S
            time.sleep(3.0)
        joined.append(outcome["unit"])
        return replayed(outcome, work, bad)

    monkeypatch.setattr(conversion, "_replayed", slow_join)
    src = corpus(tmp_path / "in", files=4, each=20)
    code, out, err = cli(capsys, "data", "to-arrow", "--in", src, "--out", tmp_path / "o.arrow", "--workers", 2)
    assert code == 0 and out == f"wrote {tmp_path / 'o.arrow'}: 80 documents\n", err


def test_the_first_process_converts_units_too_and_spawns_one_worker_fewer(tmp_path, capsys, a_unit_a_file, monkeypatch):
    """--workers 2 is this process and one spawned worker, not two: this one converts a unit whenever the part it is
    to join next is not done (the spawned worker imports the module afresh, so only this process's units are
    recorded here)."""
    from trnrecipes.data import parallel

    here, spawned = [], []
    convert, start = parallel.convert_unit, parallel._Pool.__init__

    def recorded(task, tick):
        here.append(task.unit)
        return convert(task, tick)

    def counted(self, tasks, n, bar, work):
        spawned.append(n)
        start(self, tasks, n, bar, work)

    monkeypatch.setattr(parallel, "convert_unit", recorded)
    monkeypatch.setattr(parallel._Pool, "__init__", counted)
    src = corpus(tmp_path / "in", files=6, each=50)
    code, out, err = cli(capsys, "data", "to-arrow", "--in", src, "--out", tmp_path / "o.arrow", "--workers", 2)
    assert code == 0 and out == f"wrote {tmp_path / 'o.arrow'}: 300 documents\n", err
    assert spawned == [1] and here and set(here) <= set(range(6)), (spawned, here)


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_ctrl_c_or_sigterm_keeps_the_parts_synced_in_one_line_without_a_traceback(tmp_path, capsys, sig):
    """Ctrl-C reaches the whole process group (the parent and its workers), as Slurm's SIGTERM (a time limit,
    scancel) reaches a job step's: one line says what was kept, none of the processes prints a traceback, the parts
    kept are synced (a requeued job resumes from them on another node), and the same command resumes."""
    src = corpus(tmp_path / "in", files=6, each=100)
    out, work = tmp_path / "o.arrow", tmp_path / "o.arrow.parts"
    argv = ["data", "to-arrow", "--in", str(src), "--out", str(out), "--workers", "3"]
    # Both spawned workers hold their first part until Ctrl-C (nothing says go): it lands with parts still to do, and
    # after the pool started, however loaded the machine (CI's once saw the whole conversion done first at a 0.5 s
    # pause).
    proc = started(argv, work, pause_s=0.0, hold=tmp_path / "hold", start_new_session=True)
    assert proc.poll() is None and len(holders(tmp_path / "hold")) == 2, "the workers did not both hold a part"
    os.killpg(proc.pid, getattr(signal, sig))
    err = communicated(proc)
    code, said = {"SIGINT": (130, "interrupted"), "SIGTERM": (143, "terminated (SIGTERM)")}[sig]
    assert proc.returncode == code and "Traceback" not in err, err
    assert err.endswith(f"parts done: the same command resumes\nerror: {said}\n"), err
    records = list(work.glob("part_*.json"))
    assert records and all(json.loads(r.read_text())["boot"] is None for r in records), err
    code, _, err = cli(capsys, *argv)
    assert code == 0 and "[trnrecipes] resuming" in err and not work.exists()


def test_a_work_dir_removed_amid_the_conversion_is_one_line(tmp_path):
    """OUT.parts/ removed while the workers write their parts there (by hand, a clean-up job): one line saying so
    and that the output is untouched, not two chained tracebacks (the part's write, then the work dir's removal)."""
    src = corpus(tmp_path / "in", files=6, each=100)
    out, work, hold = tmp_path / "o.arrow", tmp_path / "o.arrow.parts", tmp_path / "hold"
    argv = ["data", "to-arrow", "--in", str(src), "--out", str(out), "--workers", "3"]
    proc = started(argv, work, pause_s=0.0, hold=hold, env={"SLOW_PARTS_HOLD_FIRST": "1"})  # all three amid a unit
    assert proc.poll() is None and len(holders(hold)) == 2, "the workers did not both hold a part"
    while work.exists():  # the first process may be making its part's file as it is removed
        shutil.rmtree(work, ignore_errors=True)
    (hold / "go").touch()
    err = communicated(proc)
    assert proc.returncode == 2 and err == (
        f"error: {work} was removed while the conversion wrote there (by hand, or a clean-up?): {out} is as it was;"
        " run the command again\n"
    ), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hold", "in"]


@pytest.mark.parametrize("output", ["a file", "shards replacing older ones"])
def test_a_stop_once_the_output_is_in_place_lets_the_command_end_as_done(tmp_path, capsys, output):
    """A time limit's SIGTERM, or Ctrl-C, landing once the output had its name (as the old shard directory or the work
    dir was removed, or as the interpreter exited) ended a conversion whose work was done as failed: exit 143 or 130,
    a death by the signal, or a traceback, and a requeue converted it all again. The command now ends as done."""
    src, end, out = corpus(tmp_path / "in", files=3, each=50), tmp_path / "end", tmp_path / "o.arrow"
    end.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "SLOW_PARTS_PAUSE_S": "0", "SLOW_PARTS_HOLD_END": str(end)}
    argv = ["data", "to-arrow", "--in", str(src), "--out", str(out), "--workers", "2"]
    if output != "a file":
        argv += ["--shard-bytes", "4K"]
        assert cli(capsys, *argv, "--in", src / "00.jsonl")[0] == 0  # the older shards, to be replaced
    proc = subprocess.Popen([sys.executable, str(REPO / "tests/slow_parts.py"), *argv], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    for mark, go in (("clearing", "cleared"), ("exiting", "exit")):
        deadline = time.monotonic() + 60
        while not (end / mark).exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (end / mark).exists() and (out / "corpus.json" if output != "a file" else out).is_file(), mark
        for sig in (signal.SIGTERM, signal.SIGINT):
            proc.send_signal(sig)
        (end / go).touch()
    try:
        stdout, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert (proc.returncode, stdout, err) == (0, f"wrote {out}: 150 documents\n", "")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["end", "in", "o.arrow"]  # no old copy, no work dir left
    shards = sorted(out.glob("shard_*.arrow")) if output != "a file" else [out]
    assert sum(len(texts_of(shard)) for shard in shards) == 150


def test_main_called_in_process_puts_the_stop_handlers_back(tmp_path, capsys):
    """What the command line's own process leaves ignored at its end, a caller of main() gets back as it was."""
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    src = corpus(tmp_path / "in", files=2, each=10)
    assert cli(capsys, "data", "to-arrow", "--in", src, "--out", tmp_path / "o.arrow", "--workers", 1)[0] == 0
    assert cli(capsys, "data", "to-arrow", "--in", tmp_path / "none", "--out", tmp_path / "p.arrow")[0] == 2
    assert {s: signal.getsignal(s) for s in before} == before


def test_a_sigterm_while_the_workers_start_stops_the_conversion_and_those_started(tmp_path, capsys, monkeypatch,
                                                                                   a_unit_a_file):  # fmt: skip
    """Starting a worker waits for its interpreter (seconds with a long task list): a SIGTERM meanwhile (Slurm sends
    one) is not lost, stops the conversion before the next worker starts, and the workers started are stopped,
    though they ignore SIGTERM. (It reaches the main thread once the start it came during is done, or at once
    through another thread of the process: one worker started, or two, never the third.)"""
    import multiprocessing.context

    started, start = [], multiprocessing.context.SpawnProcess.start

    def sigterm_at_the_second(self) -> None:
        if started:
            os.kill(os.getpid(), signal.SIGTERM)
        start(self)
        started.append(self)

    monkeypatch.setattr(multiprocessing.context.SpawnProcess, "start", sigterm_at_the_second)
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as in a fresh interpreter, whatever pytest's is
    try:
        src = corpus(tmp_path / "in", files=6, each=50)
        code, _, err = cli(capsys, "data", "to-arrow", "--in", src, "--out", tmp_path / "o.arrow", "--workers", 4)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert code == 143 and err.endswith("error: terminated (SIGTERM)\n"), err
    assert len(started) in (1, 2) and not any(p.is_alive() for p in started), started
    assert not (tmp_path / "o.arrow").exists()


def test_a_work_dir_that_cannot_be_made_leaves_nothing_beside_the_output(tmp_path, monkeypatch, capsys):
    """The work dir is staged under a temp name with its record, then renamed: a storage refusing the record leaves
    no staging dir behind (one line says what could not be written)."""

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    out = tmp_path / "o" / "o.arrow"
    out.parent.mkdir()
    code, _, err = cli(capsys, "data", "to-arrow", "--in", corpus(tmp_path / "in", files=2, each=10), "--out", out)
    assert code == 2 and "No space left on device" in err, err
    assert list(out.parent.iterdir()) == []


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_worker_sent_a_stop_amid_its_imports_ignores_it(tmp_path, sig):
    """Ctrl-C and Slurm's SIGTERM reach the workers too; the parent stops them. One that lands while a worker's
    interpreter starts, before _serve ignores it, neither kills the worker nor reads as a worker that died: here each
    spawned worker sends it to itself from sitecustomize, the first code its interpreter runs, and then converts the
    unit it takes (tests/slow_parts.py holds each worker's first unit, so both must convert one)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        f"import os, signal, sys\nif '--multiprocessing-fork' in sys.argv:\n    os.kill(os.getpid(), signal.{sig})\n"
    )
    src, out, hold = corpus(tmp_path / "in", files=4, each=50), tmp_path / "o.arrow", tmp_path / "hold"
    argv = ["data", "to-arrow", "--in", str(src), "--out", str(out), "--workers", "3"]
    proc = started(argv, out.with_name("o.arrow.parts"), 0.0, hold, env={"PYTHONPATH": f"{site}{os.pathsep}{REPO}"})
    (hold / "go").touch()
    err = communicated(proc)
    assert proc.returncode == 0 and len(holders(hold)) == 2, err
    assert len(texts_of(out)) == 200 and texts_of(out)[-1].startswith("shard 3 document 49 ")


def test_a_conversion_runs_from_a_thread_other_than_the_main_one(tmp_path, a_unit_a_file):
    """Signal handlers can be set only in the main thread: elsewhere (a caller's thread) none is set, and it runs."""
    src, codes = corpus(tmp_path / "in", files=3, each=20), []
    argv = ["data", "to-arrow", "--in", str(src), "--out", str(tmp_path / "o.arrow"), "--workers", "2"]
    thread = threading.Thread(target=lambda: codes.append(main(argv)))
    thread.start()
    thread.join(timeout=120)
    assert codes == [0] and texts_of(tmp_path / "o.arrow")


def children(pid: int) -> list[int]:
    """The processes `pid` started (its workers, multiprocessing's resource tracker)."""
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]


def test_a_failed_conversion_keeps_its_parts_and_refuses_other_arguments(tmp_path, capsys, a_unit_a_file):
    a = write(tmp_path / "in/a.jsonl", docs("a1", "a2"))
    b = write(tmp_path / "in/b.jsonl", docs("b1") + b"{bad\n")
    out, work = tmp_path / "out/o.arrow", tmp_path / "out/o.arrow.parts"
    code, _, err = cli(capsys, "data", "to-arrow", "--in", a, b, "--out", out, "--workers", 1)
    assert code == 2 and err.startswith(
        f"[trnrecipes] kept {work} with 1 of 2 parts done: a rerun resumes from them once the error below is mended\n"
    )
    assert err.splitlines()[1].startswith(f"error: {b}:2: not valid JSON (")
    held = files_of(work)
    code, _, err = cli(capsys, "data", "to-arrow", "--in", a, b, "--out", out, "--label-field", "label")
    assert code == 2 and err == (
        f"error: {work} holds a partial conversion made from other inputs or settings: label_field None -> 'label'."
        f" Rerun with the same ones to resume, or remove {work} (or choose another --out) to start over\n"
    )
    code, _, err = cli(capsys, "data", "to-arrow", "--in", b, a, "--out", out)
    assert (
        code == 2 and f"other inputs or settings: inputs: 2 files -> 2 (the first that differs: #1 {a} -> {b})" in err
    )
    assert files_of(work) == held and sorted(held) == [".lock", "job.json", "part_000000.arrow", "part_000000.json"]
    code, _, err = cli(capsys, "data", "to-arrow", "--in", out.parent, "--out", tmp_path / "other.arrow")
    assert code == 2 and f"directory {out.parent} holds no input to read" in err  # a work dir's parts are no input
    write(a, docs("a1", "a2", "a3"))  # its part is stale now; the bad record is skipped instead (the policy may change)
    code, stdout, err = cli(capsys, "data", "to-arrow", "--in", a, b, "--out", out, "--on-bad-record", "skip")
    assert code == 0 and ", rejected 1 bad record" in stdout
    assert err == f"[trnrecipes] resuming {work}: 0 of 2 parts already done; converting again the parts of inputs" \
                  f" changed since: {listed([a])}\n"  # fmt: skip
    assert texts_of(out) == ["a1", "a2", "a3", "b1"] and sorted(p.name for p in out.parent.iterdir()) == [
        "o.arrow",
        "o.arrow.rejects.jsonl",
    ]


@pytest.mark.parametrize("how", ["rewritten in place", "replaced by a new file"])
def test_a_changed_input_whose_modification_time_was_put_back_is_converted_again(tmp_path, capsys, how, a_unit_a_file):
    """`cp -p`, `rsync -a` and `touch -r` put a changed file's modification time back: the same size and time, yet
    another text, whose old part a resume must not take."""
    a = write(tmp_path / "in/a.jsonl", docs("a1", "a2"))
    b = write(tmp_path / "in/b.jsonl", docs("b1") + b"{bad\n")
    out, work = tmp_path / "o.arrow", tmp_path / "o.arrow.parts"
    code, _, err = cli(capsys, "data", "to-arrow", "--in", a, b, "--out", out, "--workers", 1)
    assert code == 2 and f"kept {work} with 1 of 2 parts done" in err
    was = a.stat()
    while a.stat().st_ctime_ns == was.st_ctime_ns:  # file times move by the kernel's tick: write until it has moved
        if how == "rewritten in place":
            a.write_bytes(docs("A1", "a2"))
        else:
            write(tmp_path / "new.jsonl", docs("A1", "a2")).replace(a)
        os.utime(a, ns=(was.st_atime_ns, was.st_mtime_ns))
    assert (a.stat().st_size, a.stat().st_mtime_ns) == (was.st_size, was.st_mtime_ns)
    code, _, err = cli(capsys, "data", "to-arrow", "--in", a, b, "--out", out, "--on-bad-record", "skip")
    assert code == 0 and f"converting again the parts of inputs changed since: {listed([a])}" in err
    assert texts_of(out) == ["A1", "a2", "b1"]


def test_a_change_time_moved_as_the_file_is_read_does_not_cost_its_part(tmp_path, capsys, monkeypatch, a_unit_a_file):
    """A lazy restore (Lustre HSM, as FSx's from S3) moves a file's change time as it is first read: the part's
    record holds the times as they are once it is read, unless its size or modification time moved meanwhile."""
    from trnrecipes.data import parallel

    a = write(tmp_path / "in/a.jsonl", docs("a1", "a2"))
    b = write(tmp_path / "in/b.jsonl", docs("b1") + b"{bad\n")
    out, work = tmp_path / "o.arrow", tmp_path / "o.arrow.parts"
    convert_unit = parallel.convert_unit

    def restored_as_read(task, tick):
        def ticked(*args, **kwargs):
            for f in task.files:
                was = f.path.stat().st_ctime_ns
                while f.path.stat().st_ctime_ns == was:  # as a restore does: metadata only
                    f.path.chmod(f.path.stat().st_mode ^ 0o004)
            tick(*args, **kwargs)

        return convert_unit(task, ticked)

    monkeypatch.setattr(parallel, "convert_unit", restored_as_read)
    code, _, err = cli(capsys, "data", "to-arrow", "--in", a, b, "--out", out, "--workers", 1)
    assert code == 2 and f"kept {work} with 1 of 2 parts done" in err
    monkeypatch.setattr(parallel, "convert_unit", convert_unit)
    code, _, err = cli(capsys, "data", "to-arrow", "--in", a, b, "--out", out, "--on-bad-record", "skip")
    assert code == 0 and err == f"[trnrecipes] resuming {work}: 1 of 2 parts already done\n"


@pytest.mark.parametrize("what", ["no record", "someone else's file", "a link"])
def test_a_work_dir_the_conversion_did_not_make_is_neither_used_nor_removed(tmp_path, capsys, what, a_unit_a_file):
    src = write(tmp_path / "in/a.jsonl", docs("a"))
    out, work = tmp_path / "o.arrow", tmp_path / "o.arrow.parts"
    if what == "a link":
        (tmp_path / "elsewhere").mkdir()
        work.symlink_to(tmp_path / "elsewhere")
        expected = f"error: the work dir {work} is a symbolic link"
    elif what == "no record":
        work.mkdir()
        (work / "notes.txt").write_text("mine\n")
        expected = f"error: {work} exists and was not made by `trnrecipes data to-arrow` (no job.json in it)"
    else:
        write(tmp_path / "bad.jsonl", b"{bad\n")
        assert (
            cli(capsys, "data", "to-arrow", "--in", src, tmp_path / "bad.jsonl", "--out", out, "--workers", 1)[0] == 2
        )
        (work / "notes.txt").write_text("mine\n")
        expected = f"error: {work} holds files `trnrecipes data to-arrow` did not write (notes.txt)"
    held = files_of(work)
    code, _, err = cli(capsys, "data", "to-arrow", "--in", src, "--out", out)
    assert code == 2 and err.startswith(expected), err
    assert files_of(work) == held and not out.exists()


def test_a_shard_directory_is_read_by_training_as_one_file_of_the_same_documents(tmp_path, capsys):
    texts = [f"document {i}: " + "word " * (i % 29) for i in range(900)]
    write(tmp_path / "in/docs.jsonl", docs(*texts))
    one, shards = tmp_path / "one.arrow", tmp_path / "shards"
    assert cli(capsys, "data", "to-arrow", "--in", tmp_path / "in", "--out", one)[0] == 0
    argv = ["--shard-bytes", "16K", "--batch-rows", 64]
    assert cli(capsys, "data", "to-arrow", "--in", tmp_path / "in", "--out", shards, *argv)[0] == 0
    manifest = json.loads((shards / "corpus.json").read_text())
    assert len(manifest["shards"]) > 4 and manifest["rows"] == 900 and manifest["text_field"] == "text"
    tok = load_tokenizer(GPT2)
    a, b = (open_documents("arrow", p, tok, "text", REPO) for p in (one, shards))
    assert a.num_docs == b.num_docs == 900
    train, _ = split_documents(900, 0.05, seed=3)
    straight = take(PackedStream(a, train, 32, seed=3, dp_rank=1, dp_size=2), 300)
    sharded = take(PackedStream(b, train, 32, seed=3, dp_rank=1, dp_size=2), 300)
    assert all(np.array_equal(x, y) and p == q for (x, p), (y, q) in zip(straight, sharded, strict=True))
    position = StreamPosition.from_dict(json.loads(json.dumps(sharded[150][1].to_dict())))
    resumed = take(PackedStream(b, train, 32, seed=3, dp_rank=1, dp_size=2, start=position), 149)
    assert all(np.array_equal(x, y) for (x, _), (y, _) in zip(straight[151:], resumed, strict=True))
    # Opening reads the manifest, not the shards: a shard gone is met where one of its rows is read.
    last = shards / manifest["shards"][-1]["file"]
    last.unlink()
    texts_read = ArrowTexts(shards)
    assert texts_read.take([0, 5]) == [texts[0], texts[5]]
    with pytest.raises(DataError, match=f"Arrow file {last} does not exist"):
        texts_read.take([899])


def test_sbatch_and_plan_take_a_shard_directory_as_data_path(tmp_path, capsys):
    write(tmp_path / "in/docs.jsonl", docs(*[f"document {i}: " + "word " * (i % 17) for i in range(400)]))
    shards = tmp_path / "shards"
    assert cli(capsys, "data", "to-arrow", "--in", tmp_path / "in", "--out", shards, "--shard-bytes", "8K")[0] == 0
    overrides = ["--overrides", f"data.path={shards} run_dir={tmp_path / 'run'}"]
    recipe = ["--recipe", "llama2-tiny", "--nodes", 1]
    code, stdout, err = cli(capsys, "plan", *recipe, *overrides)
    assert code == 0 and "epochs of ~" in stdout and str(shards) in stdout, stdout + err
    code, _, err = cli(capsys, "sbatch", *recipe, "--out", tmp_path / "job", *overrides)
    assert code == 0, err
    gone = sorted(shards.glob("shard_*.arrow"))[1]
    gone.unlink()
    code, _, err = cli(capsys, "sbatch", *recipe, "--out", tmp_path / "job2", *overrides)
    assert code == 2 and f"data.path {shards}: {gone} is missing, yet corpus.json lists it" in err, err


def test_an_error_after_every_part_is_done_keeps_the_parts_for_the_rerun(tmp_path, capsys, a_unit_a_file):
    """--max-bad-records is met when the parent replays the parts' bad records, after every part is converted: the
    parts are kept (they were removed whole), and a rerun with the limit raised resumes them all."""
    src = corpus(tmp_path / "in", files=3, each=50)
    write(src / "01.jsonl", docs("one") + b"{bad one\n")  # one bad record a part: no worker stops at the limit
    write(src / "03.jsonl", b"{bad two\n" + docs("tail"))
    out, work = tmp_path / "o.arrow", tmp_path / "o.arrow.parts"
    code, _, err = cli(capsys, "data", "to-arrow", "--in", src, "--out", out, "--workers", 2,
                       "--on-bad-record", "skip", "--max-bad-records", 1)  # fmt: skip
    assert code == 2 and not out.exists(), err
    assert f"[trnrecipes] kept {work} with 4 of 4 parts done: a rerun resumes from them once the error below" in err
    code, _, err = cli(capsys, "data", "to-arrow", "--in", src, "--out", out, "--workers", 2,
                       "--on-bad-record", "skip", "--max-bad-records", 2)  # fmt: skip
    assert code == 0 and f"[trnrecipes] resuming {work}: 4 of 4 parts already done" in err
    assert texts_of(out)[-1] == "tail" and not work.exists()


def test_joining_thousands_of_parts_holds_one_open_at_a_time(tmp_path):
    """A TB of 128 MB files is thousands of units: the .idx join must not hold a file open per part (1024 is the
    common open-files limit; here 64 with 100 parts)."""
    from trnrecipes.data.megatron_files import join, write_index

    prefixes = []
    for k in range(100):
        prefix = tmp_path / f"part_{k:06d}"
        lengths = np.array([k % 7 + 1, 3], np.int32)
        np.zeros(int(lengths.sum()), np.uint16).tofile(f"{prefix}.bin")
        write_index(Path(f"{prefix}.idx"), [lengths], np.uint16)
        prefixes.append(prefix)
    code = (
        "import resource, sys, numpy as np; from pathlib import Path\n"
        "from trnrecipes.data.megatron_files import join\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))\n"
        "join([Path(p) for p in sys.argv[2:]], Path(sys.argv[1]), np.uint16)\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "all"), *map(str, prefixes)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    join(prefixes, tmp_path / "again", np.uint16)  # the same bytes as without the limit
    for ext in (".bin", ".idx"):
        assert Path(f"{tmp_path / 'all'}{ext}").read_bytes() == Path(f"{tmp_path / 'again'}{ext}").read_bytes()


def test_a_part_shorter_than_its_record_is_converted_again(tmp_path, capsys, a_unit_a_file):
    """A part shorter than its record says (a work dir copied or restored in part) is converted again on the rerun,
    not joined as it is."""
    src = corpus(tmp_path / "in", files=3, each=50)
    bad = write(tmp_path / "in/03.jsonl", b"{bad\n")
    out, work = tmp_path / "o.arrow", tmp_path / "o.arrow.parts"
    argv = ["data", "to-arrow", "--in", src, "--out", out, "--workers", 1]
    code, _, err = cli(capsys, *argv)
    assert code == 2 and "kept" in err and "3 of 4 parts done" in err, err
    part = work / "part_000001.arrow"
    os.truncate(part, part.stat().st_size // 2)
    bad.unlink()
    write(tmp_path / "in/03.jsonl", docs("last"))
    code, stdout, err = cli(capsys, *argv)
    assert code == 0 and err.startswith(f"[trnrecipes] resuming {work}: 2 of 4 parts already done"), err
    assert stdout == f"wrote {out}: 151 documents\n"
    to_arrow([src], tmp_path / "straight.arrow", progress=False)
    assert out.read_bytes() == (tmp_path / "straight.arrow").read_bytes()


def test_a_part_written_in_another_boot_of_the_machine_is_converted_again(tmp_path, capsys, a_unit_a_file):
    """Parts are not synced as they are written: one recorded in another boot (a crash, a reboot, another machine)
    may have lost its data, so it is converted again; one of this boot, or synced (no boot), is reused. A conversion
    that stops on an error syncs the parts it keeps, so that any machine resumes from them."""
    src = corpus(tmp_path / "in", files=3, each=50)
    bad = write(tmp_path / "in/03.jsonl", b"{bad\n")
    out, work = tmp_path / "o.arrow", tmp_path / "o.arrow.parts"
    argv = ["data", "to-arrow", "--in", src, "--out", out, "--workers", 1]
    code, _, err = cli(capsys, *argv)
    assert code == 2 and "3 of 4 parts done" in err, err
    records = [work / f"part_00000{k}.json" for k in range(3)]
    assert [json.loads(r.read_text())["boot"] for r in records] == [None] * 3  # synced when kept
    for record, boot in zip(records[1:], ["an-earlier-boot", parts.BOOT], strict=True):  # as a killed run leaves them
        record.write_text(json.dumps(json.loads(record.read_text()) | {"boot": boot}))
    bad.unlink()
    write(tmp_path / "in/03.jsonl", docs("last"))
    code, _, err = cli(capsys, *argv)
    assert code == 0, err
    again = "converting again 1 part written before this machine restarted, or on another machine (parts are not"
    assert err.startswith(f"[trnrecipes] resuming {work}: 2 of 4 parts already done; {again} synced"), err
    to_arrow([src], tmp_path / "straight.arrow", progress=False)
    assert out.read_bytes() == (tmp_path / "straight.arrow").read_bytes()


def test_a_shard_directory_that_cannot_be_synced_leaves_the_old_one_in_place(tmp_path, monkeypatch, capsys):
    """--shard-bytes replaces OUT: the new shards are synced before the old directory is moved aside, so a storage
    failing there (ENOSPC at fsync: a network file system's write-back) leaves the old corpus whole under its name."""
    out = tmp_path / "corpus"
    code, _, err = cli(capsys, "data", "to-arrow", "--in", corpus(tmp_path / "old", files=2, each=20), "--out", out,
                       "--shard-bytes", "4K")  # fmt: skip
    assert code == 0, err
    before = files_of(out)
    fsync = os.fsync

    def failing(fd: int) -> None:
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        if path.name.startswith("shard_") and path.parent.name.startswith(f".{out.name}."):  # a new shard
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", failing)
    code, _, err = cli(capsys, "data", "to-arrow", "--in", corpus(tmp_path / "new", files=3, each=30), "--out", out,
                       "--shard-bytes", "4K")  # fmt: skip
    assert code == 2 and "No space left on device" in err and err.count("\nerror: ") + err.startswith("error: ") == 1
    assert files_of(out) == before


@pytest.mark.parametrize("output", ["file", "shards"])
def test_the_output_is_on_disk_before_it_takes_its_name_and_the_parts_are_not_synced(tmp_path, monkeypatch, output,
                                                                                      a_unit_a_file):  # fmt: skip
    """A crash of the machine after `wrote` must not leave the output's name on lost data (the parts are deleted by
    then): its data is fsynced before the rename, the directory after it. The parts are not (their records hold the
    boot instead): every byte would wait to reach the disk twice."""
    synced, fsync = [], os.fsync

    def watched(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", watched)
    src = corpus(tmp_path / "in", files=3, each=50)
    out, work = tmp_path / "o" / "corpus.arrow", tmp_path / "o" / "corpus.arrow.parts"
    shards = [] if output == "file" else ["--shard-bytes", "4K"]
    assert main(["data", "to-arrow", "--in", str(src), "--out", str(out), "--workers", "1", *shards]) == 0
    in_work = [Path(p) for p in synced if Path(p).parent == work]
    assert not [p for p in in_work if "part_" in p.name and ".json" not in p.name], synced  # records are synced
    assert [p.name for p in in_work if p.name.startswith(".corpus.arrow")], synced  # the output under its temp name
    assert synced[-1] == str(out.parent), synced  # the rename, last
    if output == "shards":
        assert sum(Path(p).parent.parent == work for p in synced) == len(list(out.iterdir())), synced


# (command, what is refused): the documents a file, whether file 01 is a large one, the file size limit in bytes
REFUSED = {
    ("to-arrow", "a part"): (40, True, 60_000),  # parts of 2.6 KB, the large file's ~80 KB
    ("to-arrow", "the output"): (40, False, 8_192),  # every part fits, the output (10 KB) does not
    ("preprocess", "a part"): (40, True, 20_000),  # parts' .bin of ~0.7 KB, the large file's ~32 KB
}  # (a limit under 4 KB would refuse multiprocessing's shared memory too)


@pytest.mark.parametrize(
    ("command", "refused", "workers"),
    [(*case, workers) for case in REFUSED for workers in (1, 2) if case[0] == "to-arrow" or workers == 2],
)  # preprocess (its subprocess imports torch for megatron-core: ~10 s) where a worker meets it
def test_a_storage_that_refuses_writes_is_told_in_one_line_and_what_was_done_is_kept(tmp_path, capsys, command,
                                                                                     refused, workers):  # fmt: skip
    """A full disk, a quota, a read-only mount or a file size limit (here the limit, EFBIG: what a test can set
    without mounting anything) while a part or the output is written: one line naming what could not be written,
    the errno and what would fix it, exit 2 (the same command fails the same way until it is fixed), no traceback,
    whichever process met it (at --workers 2 the first process pauses 2 s in unit 0, so the spawned worker, once
    started, takes the large unit 1); the parts done are kept, and once the storage takes them it resumes."""
    import resource

    each, large, limit = REFUSED[command, refused]
    src = corpus(tmp_path / "in", files=4, each=each)
    if large:
        write(src / "01.jsonl", docs(*[f"long document {i} " + "word " * 4000 for i in range(4)]))
    out = tmp_path / ("o.arrow" if command == "to-arrow" else "o")
    work = Path(f"{out}.parts")
    argv = ["data", command, "--in", str(src), "--out", str(out), "--workers", str(workers)]
    argv += ["--tokenizer", str(GPT2)] if command == "preprocess" else []
    pause = "2" if large and workers == 2 else "0"
    env = {**os.environ, "PYTHONPATH": str(REPO), "SLOW_PARTS_PAUSE_S": pause, "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "tests/slow_parts.py"), *argv], env=env, text=True,
                          capture_output=True, timeout=120,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    fix = "[Errno 27] File too large; raise the file size limit (ulimit -f)"
    shown = out if command == "to-arrow" else f"{out}.bin/.idx"
    if refused == "a part":
        said = f"error: cannot write the part of {src / '01.jsonl'} in {work}: {fix}, or convert to an --out elsewhere"
    else:
        said = f"error: cannot write {shown} or its work dir {work}: {fix}, or choose another --out; then run"
    assert said in proc.stderr, proc.stderr
    done = len(list(work.glob("part_*.json")))
    assert done >= (1 if refused == "a part" else 4), proc.stderr  # the units before the refused one at least
    assert f"kept {work} with {done} of 4 parts done" in proc.stderr, proc.stderr
    code, _, err = cli(capsys, *argv)
    assert code == 0 and err.startswith(f"[trnrecipes] resuming {work}: {done} of 4 parts already done\n"), err
    if command == "to-arrow":
        to_arrow([src], tmp_path / "straight.arrow", progress=False)
        assert out.read_bytes() == (tmp_path / "straight.arrow").read_bytes()


def test_a_disk_filled_by_the_output_keeps_the_parts_and_frees_the_output(tmp_path, capsys, monkeypatch,
                                                                           a_unit_a_file):  # fmt: skip
    """The disk fills as the output's last bytes are written (on a large join, the likeliest moment): the output's
    temp file is closed as it is removed (open, it would hold its blocks), and the parts are kept for the rerun, with
    their records as they were where the disk is still too full to rewrite them."""
    from trnrecipes.data import conversion, corpus_writer
    from trnrecipes.data.arrow_marks import END_OF_STREAM

    full, open_at_sync = [], []
    write_all = corpus_writer.write_all

    def filling(sink, data) -> None:
        if bytes(data) == END_OF_STREAM and not full:
            full.append(os.readlink(f"/proc/self/fd/{sink.fileno()}"))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        write_all(sink, data)

    def refused_while_full(path, *args):
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):  # listdir's own, closed since
                if os.readlink(f"/proc/self/fd/{fd}").removesuffix(" (deleted)") == full[0]:
                    open_at_sync.append(fd)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(corpus_writer, "write_all", filling)
    monkeypatch.setattr(conversion, "atomic_file", refused_while_full)
    src, out = corpus(tmp_path / "in", files=2, each=30), tmp_path / "o.arrow"
    work = tmp_path / "o.arrow.parts"
    code, _, err = cli(capsys, "data", "to-arrow", "--in", src, "--out", out, "--workers", 1)
    assert code == 2 and f"kept {work} with 2 of 2 parts done" in err and "(it resumes from the parts done)" in err
    assert full and not open_at_sync, (full, open_at_sync)
    monkeypatch.undo()
    code, _, err = cli(capsys, "data", "to-arrow", "--in", src, "--out", out, "--workers", 1)
    assert code == 0 and err == f"[trnrecipes] resuming {work}: 2 of 2 parts already done\n", err
    assert len(texts_of(out)) == 60


def test_a_refused_list_of_bad_records_is_a_write_refused_not_the_inputs_fault(tmp_path):
    """--on-bad-record skip lists each bad record as it is met: where the storage refuses that list (here a file size
    limit, EFBIG), the line says so, not that the Parquet file being read is unreadable."""
    import resource

    src = tmp_path / "in"
    src.mkdir()
    pq.write_table(pa.table({"text": pa.array(["good"] + [None] * 2000, pa.string())}), src / "n.parquet")
    out, work = tmp_path / "o.arrow", tmp_path / "o.arrow.parts"
    argv = ["data", "to-arrow", "--in", str(src), "--out", str(out), "--workers", "1", "--on-bad-record", "skip"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "SLOW_PARTS_PAUSE_S": "0", "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "tests/slow_parts.py"), *argv], env=env, text=True,
                          capture_output=True, timeout=120,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (60_000, 60_000)))  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    said = f"error: cannot write the list of bad records in {work}: [Errno 27] File too large; raise the file size"
    assert said in proc.stderr and "not a readable" not in proc.stderr, proc.stderr


def test_the_cli_tells_refused_writes_of_the_files_a_conversion_writes_for_its_output_only():
    """What the CLI tells as a write refused: the output, what is under it (shards) or beside it by suffix (the work
    dir, the rejects list, a prefix's .bin) and its temp files beside it; not an input beside it."""
    from trnrecipes.cli import _written_for

    ours = ["/d/o.arrow", "/d/o.arrow/shard-00000.arrow", "/d/o.arrow.parts/part_000001.arrow",
            "/d/o.arrow.rejects.jsonl", "/d/.o.arrow.abc123.tmp", "/d/.o.arrow.parts.77-ab.tmp/job.json"]  # fmt: skip
    assert all(_written_for(name, "/d/o.arrow") for name in ours)
    for name in ["/d/o.jsonl", "/d/other.arrow", "/d/o.arrowx", "/e/o.arrow"]:
        assert not _written_for(name, "/d/o.arrow"), name
    assert _written_for("/d/c.bin", "/d/c") and not _written_for("/d/c2.jsonl", "/d/c")


def test_an_input_that_cannot_be_read_is_named_as_such_not_as_a_write_refused(tmp_path, capsys, a_unit_a_file,
                                                                               monkeypatch):  # fmt: skip
    """An input the user may not read (EACCES, as a refused write has: opened here by a stand-in of open(), since
    root reads any file) is the input's error, named with what to do, exit 2: not a write refused, not a
    traceback."""
    import builtins

    from trnrecipes.data import arrow

    src = corpus(tmp_path / "in", files=3, each=10)
    unreadable = src / "02.jsonl"

    def guarded_open(path, *args, **kwargs):
        if Path(path) == unreadable:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return builtins.open(path, *args, **kwargs)

    monkeypatch.setattr(arrow, "open", guarded_open, raising=False)
    code, _, err = cli(capsys, "data", "to-arrow", "--in", src, "--out", tmp_path / "o.arrow", "--workers", 1)
    assert code == 2 and f"error: {unreadable}: cannot be read ([Errno 13] Permission denied" in err, err
    assert "fix its permissions or name another file" in err and "cannot write" not in err, err
