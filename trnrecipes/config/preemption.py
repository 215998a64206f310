"""How long before the time limit run.sbatch asks training to save: long enough to write the checkpoint.

A fixed lead (Slurm's --signal=B:USR1@N) that suits a 1B model kills a 70B save halfway: its checkpoint is ~700 GB
(bf16 weights + fp32 AdamW moments), 12 minutes at 1 GB/s. So the lead is derived from the checkpoint's size and
the job's write rate (slurm.checkpoint_write_gbps), unless slurm.signal_seconds says otherwise.
No torch import: `plan` and `sbatch` use this.
"""

from __future__ import annotations

import math
import shlex

from trnrecipes.config.cluster import LOCAL_INSTANCES
from trnrecipes.config.sections import Recipe

# After the signal the trainer finishes the step it is in, validates if due, and copies its state to host memory
# before the write starts: a few minutes at most on the recipes we ship.
STEP_MARGIN_S = 180
SIGNAL_MIN_S, SIGNAL_MAX_S = 60, 65535  # Slurm's resolution; sbatch --signal takes at most 65535


def checkpoint_bytes(r: Recipe) -> int:
    """Bytes of one training checkpoint: weights in their training dtype (bf16, else fp32 master weights) and two
    fp32 AdamW moments per parameter. Small files (recipe, tokenizer, data position) are left out."""
    weight_bytes = 2 if r.precision.dtype == "bf16" else 4
    return r.model.param_count() * (weight_bytes + 2 * 4)


def derived_signal_seconds(r: Recipe) -> int:
    write_s = checkpoint_bytes(r) / (r.slurm.checkpoint_write_gbps * 1e9)
    return min(SIGNAL_MAX_S, max(SIGNAL_MIN_S, STEP_MARGIN_S + math.ceil(write_s)))


def signal_seconds(r: Recipe) -> int:
    """The pre-timeout signal's lead: slurm.signal_seconds, or derived from the checkpoint size."""
    return r.slurm.signal_seconds if r.slurm.signal_seconds is not None else derived_signal_seconds(r)


def render_warnings(r: Recipe, time_limit_shown: bool = False) -> list[str]:
    """What `trnrecipes sbatch` prints to stderr: the job dir is still written. The unset time limit is said for a
    cluster job only, and not again where `time_limit_shown` (trnrecipes.jobs.render: once per job dir)."""
    warnings = []
    if r.slurm.time_limit is None and r.cluster.instance not in LOCAL_INSTANCES and not time_limit_shown:
        # The partition's MaxTime is the most a job may ask for there; no fixed value suits every partition.
        shows = (
            f"scontrol show partition {shlex.quote(r.slurm.partition)} prints it as MaxTime="
            if r.slurm.partition
            else "sinfo -o '%P %l' lists every partition's, the default one marked *"
        )
        warnings.append(
            "slurm.time_limit is not set: the job runs under the partition's limit, and Slurm sends the pre-timeout"
            " signal (save, then requeue) only if that limit is finite. Set slurm.time_limit to the partition's"
            f" MaxTime or less ({shows}), so the last minutes of training are saved (said once per job dir)"
        )
    need = derived_signal_seconds(r)
    if r.slurm.signal_seconds is not None and r.slurm.signal_seconds < need:
        gb = checkpoint_bytes(r) / 1e9
        warnings.append(
            f"slurm.signal_seconds {r.slurm.signal_seconds} may not leave time to write a {gb:,.0f} GB checkpoint at"
            f" slurm.checkpoint_write_gbps {r.slurm.checkpoint_write_gbps} (about {need} s with the step before"
            " it); unset it to use the derived value"
        )
    return warnings
