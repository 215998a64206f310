"""monitor.profile_steps: a profile of a few training steps, to see where a step's time goes before a cluster is
committed to a recipe (which steps, ranks and tools: trnrecipes/config/profiling.py).

cpu, cuda and TorchNeuron (the plain-PyTorch paths): torch.profiler runs from the start of step `first` to the end
of step `last`, each step inside a `trnrecipes step N` range, and writes one Chrome trace per profiled rank,
RUN_DIR/profile/rank<R>-steps<first>-<last>.json (chrome://tracing or https://ui.perfetto.dev open it).

torch-xla + NxD: the Neuron runtime captures (run.sbatch sets its variables). It reads them when it starts, after
the trainer's first lines: a rank that is not to profile turns the capture off in its own environment first
(`rank_env`).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from trnrecipes.config.profiling import PROFILE_DIR, neuron_profile_env, profiles_in_process, profiles_this_rank
from trnrecipes.config.sections import Recipe
from trnrecipes.files.run_files import newest_complete_step


def rank_env(r: Recipe, rank: int, local_rank: int, run_dir: str | None) -> None:
    """On torch-xla + NxD, before the runtime starts: the capture run.sbatch set is turned off on a rank that is not to
    profile, and on every rank of a launch that resumes at or past the window's last step (`run_dir`'s newest
    complete checkpoint; run.sbatch exports TRNRECIPES_RUN_DIR)."""
    if not neuron_profile_env(r):
        return
    resumes_at = newest_complete_step(Path(run_dir)) if run_dir else 0
    if not profiles_this_rank(r, rank, local_rank) or resumes_at >= r.monitor.profile_steps[1]:
        os.environ["NEURON_RT_INSPECT_ENABLE"] = "0"


class StepProfiler:
    """torch.profiler over monitor.profile_steps on this rank (a no-op where it does not profile). `step(n)` wraps
    step n (1-based); the trace is written when step `last` ends."""

    def __init__(
        self, r: Recipe, run_dir: Path, rank: int, local_rank: int, device_type: str, log=print, enabled: bool = True
    ):
        self.window = r.monitor.profile_steps if profiles_in_process(r) and enabled else None
        self.enabled = self.window is not None and profiles_this_rank(r, rank, local_rank)
        self.path = None  # the trace's, once the first profiled step is known (a resume may start inside the window)
        self.dir, self.rank, self.first = run_dir / PROFILE_DIR, rank, None
        self.device_type, self.log = device_type, log
        self._profiler = None

    def profiled(self, n: int) -> bool:
        return self.window is not None and self.window[0] <= n <= self.window[1]

    def start_step(self, n: int):
        """Call before step n; returns the context its work runs in."""
        if not self.enabled or not self.profiled(n):
            return contextlib.nullcontext()
        import torch

        if self._profiler is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device_type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities)
            self._profiler.start()
            self.first = n
            self.path = self.dir / f"rank{self.rank}-steps{n}-{self.window[1]}.json"
        return torch.profiler.record_function(f"trnrecipes step {n}")

    def end_step(self, n: int) -> None:
        """Call after step n: the trace is written after the window's last step."""
        if self._profiler is None or n != self.window[1]:
            return
        self._profiler.stop()
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._profiler.export_chrome_trace(str(tmp))  # kineto only logs a write it could not make
            os.replace(tmp, self.path)  # a reader never sees half a trace
        except (OSError, RuntimeError) as err:  # a full or read-only disk: the trace is lost, not the step's save
            self.log(f"[trnrecipes] warning: the profile of steps {self.first}-{n} could not be written to {self.path}"
                     f" ({getattr(err, 'strerror', None) or err}); training goes on")  # fmt: skip
            return
        finally:
            self._profiler = None
        self.log(f"[trnrecipes] profile of steps {self.first}-{n}: {self.path} (open in https://ui.perfetto.dev)")

    def close(self) -> None:
        """A run that stops inside the window: the profiler is stopped, nothing is written."""
        if self._profiler is not None:
            self._profiler.stop()
            self._profiler = None
