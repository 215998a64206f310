"""`trnrecipes plot RUN_DIR [RUN_DIR2]`: loss, grad-norm and param-norm curves as PNGs, one run or two overlaid
(how the seeds compare a GPU run with a Trainium run of the same recipe)."""

from __future__ import annotations

import sys
from pathlib import Path

from trnrecipes.config.sections import RecipeError
from trnrecipes.files.outputs import check_output
from trnrecipes.files.run_files import PLOTS

PANELS = (("loss", "training loss"), ("grad_norm", "gradient L2 norm"), ("param_norm", "parameter L2 norm"))
# Classification runs also log accuracy (training, per step) and val_accuracy: drawn when a run has them.
OPTIONAL_PANELS = (("accuracy", "accuracy"),)
VALIDATION = {"loss": "val_loss", "accuracy": "val_accuracy"}  # the panel's held-out curve


def plot_runs(run_dirs: list[Path], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    runs = [(Path(d), read_records(Path(d) / "metrics.jsonl")) for d in run_dirs]
    out.mkdir(parents=True, exist_ok=True)
    written = []
    present = [p for p in OPTIONAL_PANELS if any(_is_number(r.get(p[0])) for _, rs in runs for r in rs)]
    for key, title in (*PANELS, *present):
        fig, ax = plt.subplots(figsize=(7, 4))
        for run_dir, records in runs:
            points = [(_x(r), r[key]) for r in records if _is_number(r.get(key))]
            if points:
                steps, values = zip(*points, strict=True)
                ax.plot(steps, values, label=run_dir.name, marker="." if len(points) < 50 else None)
            if key in VALIDATION:
                val = [(_x(r), r[VALIDATION[key]]) for r in records if _is_number(r.get(VALIDATION[key]))]
                if val:
                    steps, values = zip(*val, strict=True)
                    ax.plot(steps, values, "o--", label=f"{run_dir.name} (validation)")
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
        path = check_output(out / f"{key}.png", flag="plot", run_entry=PLOTS)  # not through a link left there
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def read_records(path: Path) -> list[dict]:
    """The step records of a metrics.jsonl, one per step (monitor.step_records: of a step logged twice, by a run
    resumed before resumes truncated the file, the later record). A line that is not one (a run killed mid-write
    leaves half a line) is skipped with a warning: the rest of the run still plots."""
    from trnrecipes.train.monitor import step_records

    records, bad = step_records(path)
    if bad:
        lines = ", ".join(map(str, bad[:5])) + (", ..." if len(bad) > 5 else "")
        print(f"warning: {path}: skipped {len(bad)} line(s) that are not step records (line {lines})", file=sys.stderr)
    if not records:
        raise RecipeError(f"{path}: no step records to plot (JSON lines with a numeric 'step')")
    return records


def _x(record: dict) -> float:
    """Where a record goes on the step axis: its step over all phases of an incremental run, else its step."""
    return record["history_step"] if _is_number(record.get("history_step")) else record["step"]


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
