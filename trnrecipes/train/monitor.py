"""Per-step metrics (seed 002): metrics.jsonl, TensorBoard events, console lines, and a grad-norm spike detector."""

from __future__ import annotations

import json
from collections import Counter, deque
from pathlib import Path


class SpikeDetector:
    """A spike is a step whose grad norm exceeds the mean of the previous `window` steps by more than `margin`
    (seed 002: 20 steps, 0.1). Its recovery length is the number of steps, the spike included, until the norm is
    back at or under that threshold; the histogram of recovery lengths says how the run heals."""

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

    A run continuing from another run's checkpoint (train.init_from: fine-tuning, incremental training) is a new
    phase of it: its metrics.jsonl starts with the earlier run's records up to that checkpoint (`previous`), and its
    own records follow with steps counted on from the checkpoint's, each tagged with its phase (1, 2, ...), so one
    file and one plot show the whole history. The console keeps this run's own step count."""

    def __init__(
        self, run_dir: Path, enabled: bool, tensorboard: bool = True, previous: tuple[Path, int] | None = None
    ):
        self.enabled = enabled
        self.file = None
        self.tb = None
        self.step_offset, self.phase = 0, None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / "metrics.jsonl"
        fresh = not path.exists() or path.stat().st_size == 0
        earlier = _records_until(*previous) if previous is not None else []
        if earlier:  # a checkpoint with no run history (`convert from-hf`'s) starts the file afresh
            # The earlier run's last step as its file counts them (itself a later phase: counted on from its own)
            self.step_offset = max(r["step"] for r in earlier)
            self.phase = max(r.get("phase", 1) for r in earlier) + 1
            if fresh:
                path.write_text("".join(json.dumps({"phase": 1} | r) + "\n" for r in earlier))
        self.file = open(path, "a", buffering=1)  # line-buffered: tail -f works
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tensorboard"))

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        if self.phase is not None:
            local = record["step"]
            record = record | {"step": local + self.step_offset, "phase": self.phase, "phase_step": local}
        self.file.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self.tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.tb:
            self.tb.close()


def _records_until(path: Path, step: int) -> list[dict]:
    """The step records of an earlier run's metrics.jsonl up to its own step `step` (phase_step where the run was
    itself a later phase), none if it has no readable file."""
    records = []
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return records
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a half-written last line of a killed run
        own = record.get("phase_step", record.get("step")) if isinstance(record, dict) else None
        if isinstance(own, int) and isinstance(record.get("step"), int) and own <= step:
            records.append(record)
    return records


def progress_line(r: dict, max_steps: int) -> str:
    parts = [f"step {r['step']:>{len(str(max_steps))}}/{max_steps}", f"loss {r['loss']:.4f}"]
    if "accuracy" in r:
        parts.append(f"acc {r['accuracy']:.3f}")
    if "val_loss" in r:
        parts.append(f"val {r['val_loss']:.4f}")
    if "val_accuracy" in r:
        parts.append(f"val acc {r['val_accuracy']:.3f}")
    parts += [f"lr {r['lr']:.2e}", f"grad {r['grad_norm']:.3f}", f"{r['tokens_per_s']:,.0f} tok/s"]
    if r.get("mfu") is not None:
        parts.append(f"MFU {100 * r['mfu']:.2f}%")
    if r.get("spike"):
        parts.append("grad-norm SPIKE")
    return " | ".join(parts)
