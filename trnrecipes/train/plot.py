"""`trnrecipes plot RUN_DIR [RUN_DIR2]`: loss, grad-norm and param-norm curves as PNGs, one run or two overlaid
(how the seeds compare a GPU run with a Trainium run of the same recipe)."""

from __future__ import annotations

from pathlib import Path

from trnrecipes.train.monitor import read_metrics

PANELS = (("loss", "training loss"), ("grad_norm", "gradient L2 norm"), ("param_norm", "parameter L2 norm"))


def plot_runs(run_dirs: list[Path], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    runs = [(Path(d), read_metrics(Path(d))) for d in run_dirs]
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for key, title in PANELS:
        fig, ax = plt.subplots(figsize=(7, 4))
        for run_dir, records in runs:
            points = [(r["step"], r[key]) for r in records if key in r]
            if points:
                steps, values = zip(*points, strict=True)
                ax.plot(steps, values, label=run_dir.name, marker="." if len(points) < 50 else None)
            if key == "loss":
                val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
                if val:
                    steps, values = zip(*val, strict=True)
                    ax.plot(steps, values, "o--", label=f"{run_dir.name} (validation)")
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
        path = out / f"{key}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
