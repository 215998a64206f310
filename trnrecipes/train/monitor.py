"""Per-step metrics (the 128-node Llama 2 post): metrics.jsonl, TensorBoard events, console lines, and a grad-norm
spike detector.

metrics.jsonl holds each step once. A run that trains on from step S (its checkpoint's; 0 when it starts over after a
kill before its first checkpoint) first removes from the file its phase's records beyond S, logged by the attempt
that crashed, and every line that is not a whole step record (half a line from a kill); earlier phases stay whole.
The kept lines go to a temp file renamed onto metrics.jsonl after the dropped ones are appended, fsynced, to
metrics.dropped.jsonl beside it: a kill in between loses nothing (the next resume drops them again, so the side file
may hold them twice). A line there is the dropped record with "dropped_by_resume_from_step": S and "dropped_at" (UTC)
added; for a line that was not a record, those two and "line", its text. In files written before this a step can
appear twice: readers take its later record (step_records).

TensorBoard: the dropped steps' events stay in the tensorboard/ event files (a killed writer may not have flushed
them); the resumed writer opens with a purge at the first step it trains again (SummaryWriter purge_step), which
TensorBoard's event loader honours by hiding the points it wrote before at that step or later. MLflow deletes its
values beyond S (train/trackers.py)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
from collections import Counter, deque
from collections.abc import Iterator
from pathlib import Path

from trnrecipes.config.sections import RecipeError
from trnrecipes.data.arrow import atomic_output
from trnrecipes.files.run_files import METRICS, METRICS_DROPPED, TENSORBOARD
from trnrecipes.plan.report import si
from trnrecipes.train.trackers import Outcome, Tracker, numbers


class SpikeDetector:
    """A spike is a step whose grad norm exceeds the mean of the previous `window` steps by more than `margin`
    (the 128-node Llama 2 post: 20 steps, 0.1). Its recovery length is the number of steps, the spike included, until
    the norm is back at or under that threshold; the histogram of recovery lengths says how the run heals."""

    def __init__(self, window: int = 20, margin: float = 0.1):
        self.window, self.margin = window, margin
        self.history: deque[float] = deque(maxlen=window)
        self.spikes = 0
        self.recoveries: Counter[int] = Counter()
        self._threshold: float | None = None  # set while in a spike
        self._length = 0

    def update(self, grad_norm: float) -> bool:
        """Feed one step's norm; True if this step starts a spike."""
        started = False
        if self._threshold is not None:
            if grad_norm <= self._threshold:
                self.recoveries[self._length] += 1
                self._threshold = None
            else:
                self._length += 1
        elif len(self.history) == self.window:
            threshold = sum(self.history) / self.window + self.margin
            if grad_norm > threshold:
                self.spikes += 1
                self._threshold, self._length, started = threshold, 1, True
        self.history.append(grad_norm)
        return started

    @property
    def in_spike(self) -> bool:
        return self._threshold is not None

    def summary(self) -> dict:
        return {"spikes": self.spikes, "recovery_histogram": dict(sorted(self.recoveries.items()))}


class Metrics:
    """Rank 0 writes; other ranks hold a Metrics that writes nothing.

    A run continuing from another run's checkpoint (train.init_from: fine-tuning, incremental training) is the next
    phase of that run's history: its metrics.jsonl starts with the earlier run's records (its earlier phases whole,
    its own up to the checkpoint's step), and every record carries "phase" (1, 2, ...) and "history_step", the step
    counted over all phases, which plots and TensorBoard use. "step" stays this run's own (its checkpoints' names,
    the console, the LR schedule). A checkpoint outside a run dir (`convert from-hf`'s, a copied step dir) brings no
    history: the file starts plain. A resumed run takes its phase from its own file, unless that holds the history
    only (killed before its first step was logged).

    `resumed_from` is the step this run trains on from (its checkpoint's, 0 for a fresh start): this phase's records
    beyond it are of steps it trains again, and leave the file (module docstring)."""

    def __init__(
        self,
        run_dir: Path,
        enabled: bool,
        tensorboard: bool = True,
        previous: tuple[Path, int] | None = None,
        *,
        resumed_from: int,
    ):
        self.enabled = enabled
        self.file = None
        self.tb = None
        self.trackers: list[Tracker] = []  # MLflow, W&B: opened by the trainer once history_offset is known
        self.history_offset, self.phase = 0, None
        # the tokens trained on up to `resumed_from`, as its record says: a resume with another batch size or length
        # counts on from there (None: no such record; the trainer counts resumed_from x this batch)
        self.tokens_at_resume: int | None = None
        # this phase's grad norms up to `resumed_from`, in step order: the spike detector replays them, so a resumed
        # run flags spikes from its first step and its summary counts the whole run
        self.grad_norms_at_resume: list[float] = []
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / METRICS
        mine = read_step_records(path)
        phased = [r for r in mine if isinstance(r.get("phase"), int) and isinstance(r.get("history_step"), int)]
        if phased:  # a resumed run: its own phase
            self.phase = max(r["phase"] for r in phased)
            anchor = next(r for r in phased if r["phase"] == self.phase)
            self.history_offset = anchor["history_step"] - anchor["step"]
        earlier = history_until(*previous) if previous is not None else []
        # a fresh phase, or one killed before it logged a step of its own: its file holds the history only
        if earlier and (not mine or (phased and self.phase <= earlier[-1]["phase"])):
            self.phase, self.history_offset = earlier[-1]["phase"] + 1, earlier[-1]["history_step"]
        with _metrics_storage(run_dir):
            _drop_beyond(path, resumed_from, self.phase)
        at_resume = [r for r in mine if r.get("step") == resumed_from and r.get("phase") == self.phase]
        kept = {r["step"]: r for r in mine if r.get("phase") == self.phase and 0 < r.get("step", 0) <= resumed_from}
        norms = [kept[step].get("grad_norm") for step in sorted(kept)]
        if resumed_from and len(kept) == resumed_from and all(isinstance(n, (int, float)) for n in norms):
            self.grad_norms_at_resume = [float(n) for n in norms]
        if resumed_from and at_resume and isinstance(at_resume[-1].get("tokens_seen"), int):
            self.tokens_at_resume = at_resume[-1]["tokens_seen"]
        with _metrics_storage(run_dir):
            if earlier and not mine:
                with atomic_output(path) as tmp:  # a kill mid-copy leaves no partial history
                    Path(tmp).write_text("".join(json.dumps(r) + "\n" for r in earlier))
            self.file = open(path, "a", buffering=1)  # line-buffered: tail -f works
        self.run_dir = run_dir
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            purge = resumed_from + 1 + self.history_offset if mine else None  # hides the dropped steps' events
            try:  # probed first: SummaryWriter's writer thread dies with a traceback of its own
                (run_dir / TENSORBOARD).mkdir(exist_ok=True)
                with tempfile.TemporaryFile(dir=run_dir / TENSORBOARD):
                    pass
                self.tb = SummaryWriter(str(run_dir / TENSORBOARD), purge_step=purge)
            except OSError as err:  # the same on a requeue: exit 2, not a traceback's 1
                self.file.close()
                raise RecipeError(
                    f"run dir {run_dir}: TensorBoard cannot write {run_dir / TENSORBOARD} ({err.strerror or err});"
                    " make it writable, or leave tensorboard out of monitor.trackers"
                ) from None

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        if self.phase is not None:
            record = record | {"phase": self.phase, "history_step": record["step"] + self.history_offset}
        with _metrics_storage(self.run_dir):
            self.file.write(json.dumps(record) + "\n")
        x = record.get("history_step", record["step"])
        values = numbers(record)
        if self.tb is not None:
            for key, value in values.items():
                self.tb.add_scalar(key, value, x)
        for tracker in list(self.trackers):
            try:
                tracker.log(values, x)
            except Exception as err:  # a tracking server's outage must not stop a training run
                self._drop_tracker(tracker, f"logging step {x}", err)

    def _drop_tracker(self, tracker: Tracker, doing: str, err: Exception) -> None:
        self.trackers.remove(tracker)
        print(
            f"[trnrecipes] warning: {type(tracker).__name__} failed {doing} ({type(err).__name__}: {err}); it logs"
            " nothing more in this launch (metrics.jsonl and the console go on; a resume reopens it)",
            file=sys.stderr,
            flush=True,
        )

    def close(self, outcome: Outcome = "finished") -> None:
        if self.file:
            with contextlib.suppress(OSError):  # each record was flushed as written; never hiding what ended the run
                self.file.close()
        if self.tb:
            self.tb.close()
        for tracker in list(self.trackers):
            try:
                tracker.close(outcome)
            except Exception as err:  # each tracker on its own; never hiding the error that ended the run
                self._drop_tracker(tracker, "closing its run", err)


@contextlib.contextmanager
def _metrics_storage(run_dir: Path) -> Iterator[None]:
    """metrics.jsonl's storage failing (a full disk): one line and exit 2, the cause kept so that a transient one
    (EIO, ESTALE) is still a requeue (cli.requeue_may_pass); not a traceback's exit 1, requeued to fail again."""
    try:
        yield
    except OSError as err:
        raise RecipeError(
            f"run dir {run_dir}: cannot write {err.filename or METRICS} ({err.strerror or err}); free space or fix the"
            " storage there, then resubmit (the checkpoints are kept)"
        ) from err


def _drop_beyond(path: Path, step: int, phase: int | None) -> None:
    """Before a run trains on from `step`: remove from metrics.jsonl `path` the records of its phase (`phase`; None:
    a file without phases, all its own) beyond `step`, and every line that is not a whole step record (a line
    without its newline is half written), appending them to the side file first (module docstring). Earlier
    phases stay whole; a missing file, or one with nothing to drop, is left as it is."""
    try:
        lines = list(_lines(path))
    except FileNotFoundError:
        return
    kept, dropped = [], []
    for _, line, record in lines:
        whole = record is not None and line.endswith(b"\n")
        if whole and (record["step"] <= step or _phase_before(record.get("phase"), phase)):
            kept.append(line)
        else:
            dropped.append((line, record))
    if not dropped:
        return
    why = {"dropped_by_resume_from_step": step, "dropped_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    with open(path.with_name(METRICS_DROPPED), "a") as side:
        for line, record in dropped:
            entry = why | record if record is not None else why | {"line": line.decode("utf-8", "replace").rstrip("\n")}
            side.write(json.dumps(entry) + "\n")
        side.flush()
        os.fsync(side.fileno())  # on disk before the rename below takes the lines out of metrics.jsonl
    with atomic_output(path) as tmp, open(tmp, "wb") as out:  # on disk before the rename (atomic_output syncs it)
        out.writelines(kept)


def _phase_before(value: object, phase: int | None) -> bool:
    """Whether a record's "phase" is one before `phase` (None: the file has no phases)."""
    return phase is not None and isinstance(value, int) and not isinstance(value, bool) and value < phase


def _lines(path: Path) -> Iterator[tuple[int, bytes, dict | None]]:
    """(line number, the line as written, its step record or None where it is not one) for each non-blank line of a
    metrics.jsonl. OSError if the file cannot be read."""
    with open(path, "rb") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:  # JSONDecodeError, UnicodeDecodeError
                record = None
            step = record.get("step") if isinstance(record, dict) else None
            yield i, line, record if isinstance(step, int | float) and not isinstance(step, bool) else None


def step_records(path: Path) -> tuple[list[dict], list[int]]:
    """The step records of a metrics.jsonl (JSON objects with a numeric step), one per step, in order, and the
    numbers of the lines that are not one (a run killed mid-write leaves half a line). Where a step (of a phase)
    is there twice, in a file written before resumes truncated it (Metrics), the later record wins: it is on the
    trajectory that went on. In (phase, step) order. OSError if the file cannot be read."""
    latest: dict[tuple, dict] = {}
    bad = []
    for i, _, record in _lines(path):
        if record is None:
            bad.append(i)
            continue
        phase = record.get("phase")
        latest[phase if isinstance(phase, int) else 0, record["step"]] = record  # a later record replaces the earlier
    return [latest[key] for key in sorted(latest)], bad  # in (phase, step) order, as plots draw them


def read_step_records(path: Path) -> list[dict]:
    """step_records' records; none for a file that is missing or unreadable (no history to carry on)."""
    try:
        return step_records(path)[0]
    except OSError:
        return []


def history_until(path: Path, step: int) -> list[dict]:
    """An earlier run's history up to its checkpoint at its own step `step`: its earlier phases whole, its last
    phase up to `step`, every record with "phase" and "history_step" (a run without phases is phase 1)."""
    records = [{"phase": 1, "history_step": r["step"]} | r for r in read_step_records(path)]
    if not records:
        return []
    last = max(r["phase"] for r in records)
    return [r for r in records if r["phase"] < last or r["step"] <= step]


def progress_line(r: dict, max_steps: int) -> str:
    """The console line of a logged step: loss, validation, lr, norms, speed, then tokens seen, time and ETA."""
    parts = [f"step {r['step']:>{len(str(max_steps))}}/{max_steps}", f"loss {r['loss']:.4f}"]
    if "accuracy" in r:
        parts.append(f"acc {r['accuracy']:.3f}")
    if "val_loss" in r:
        parts.append(f"val {r['val_loss']:.4f}")
    if "val_accuracy" in r:
        parts.append(f"val acc {r['val_accuracy']:.3f}")
    parts += [f"lr {r['lr']:.2e}", f"grad {r['grad_norm']:.3f}"]
    if "router_aux_loss" in r:  # a mixture of experts: its balance (1x: every expert as busy as the mean)
        parts.append(f"aux {r['router_aux_loss']:.4f} busiest {r['expert_load_max']:.2f}x")
    if "param_norm" in r:
        parts.append(f"param {r['param_norm']:.4g}")
    parts.append(f"{r['tokens_per_s']:,.0f} tok/s")
    if r.get("mfu") is not None:
        parts.append(f"MFU {100 * r['mfu']:.2f}%")
    if "tokens_seen" in r:
        parts.append(f"{si(r['tokens_seen'], 4)} tokens")
    if "elapsed_s" in r:
        eta = r.get("eta_s")
        parts.append(f"{duration(r['elapsed_s'])} elapsed, ETA {duration(eta) if eta is not None else '--'}")
    if r.get("spike"):
        parts.append("grad-norm SPIKE")
    if r.get("profiled"):
        parts.append("profiled")
    return " | ".join(parts)


def duration(seconds: float) -> str:
    """1:02:03, or 3d 04:05:06 past a day: what a person reads at a glance."""
    s = max(0, round(seconds))
    days, s = divmod(s, 86400)
    clock = f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
    return f"{days}d {clock.zfill(8)}" if days else clock


class Clock:
    """Elapsed wall time of this launch and the ETA to max_steps, from the mean wall time per step since the end of
    the first step (which carries compilation and warm-up; validation and saves are in the mean, as they will be)."""

    def __init__(self, start_step: int, max_steps: int):
        self.started, self.start_step, self.max_steps = time.monotonic(), start_step, max_steps
        self.first_done: float | None = None

    def tick(self, step: int) -> tuple[float, float | None]:
        """(elapsed s, ETA s or None) once `step` (1-based) is done."""
        now = time.monotonic()
        if self.first_done is None:
            self.first_done = now
        done = step - self.start_step - 1  # steps timed since the first
        eta = (now - self.first_done) / done * (self.max_steps - step) if done > 0 else None
        return now - self.started, (0.0 if step >= self.max_steps else eta)
