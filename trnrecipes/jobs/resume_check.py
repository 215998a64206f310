"""What the trainer would refuse about the run dir's checkpoints at the job's start, said when the job is rendered
instead (after hours in the queue, a 2 at the first second is the costliest way to learn it): checkpoint.resume
false on a run dir with checkpoints, or a recipe (or data-parallel size) its newest checkpoint was not trained
with. Torch-free; the trainer's own checks (train/run_dir.py settle_checkpoints, train/resume_compat.py
check_resume, train/restore.py's data-parallel size) still decide."""

from __future__ import annotations

import json
from pathlib import Path

from trnrecipes.config.changes import allows
from trnrecipes.config.saved_recipe import resume_differences
from trnrecipes.config.sections import Recipe, RecipeError
from trnrecipes.files.run_files import CHECKPOINTS, DONE, FRESH_START, STEP_DIR
from trnrecipes.plan.layout import compute_layout


def newest_whole_checkpoint(run_dir: Path) -> Path | None:
    """The run dir's newest step_N with its done marker (not verified: that reads every byte)."""
    try:
        found = [
            (int(m.group(1)), p)
            for p in (run_dir / CHECKPOINTS).iterdir()
            if (m := STEP_DIR.match(p.name)) and not p.is_symlink() and (p / DONE).is_file()
        ]
    except OSError:  # no checkpoints/ (a new run), or not readable from here: the trainer judges
        return None
    return max(found)[1] if found else None


def resume_problem(recipe: Recipe, run_dir: Path, repo_root: Path) -> tuple[str | None, str | None]:
    """(one line naming what would stop the job at its start, a warning), each or None."""
    c = recipe.checkpoint
    newest = newest_whole_checkpoint(run_dir)
    if newest is None or (not c.resume and c.force_fresh):
        return None, None
    warning = None
    if not c.resume:
        stop = (
            f"run dir {run_dir} already has checkpoints ({newest.name} the newest) and checkpoint.resume is false:"
            " {who} would stop at its start; resume (the default), use another run_dir, or set"
            " checkpoint.force_fresh=true to move them aside and start at step 0"
        )
        if not (run_dir / FRESH_START).is_file():
            return stop.format(who="the job"), None
        # A run a job started at step 0 (resume false): that job's requeue resumes them (train/run_dir.py
        # restarted_job), and re-rendering it is how its recipe is mended: said, not refused.
        warning = stop.format(who="a new submission of this job (not the requeue of the one that started them)")
    try:
        refused, _ = resume_differences(newest, recipe.to_dict(), repo_root / recipe.data.tokenizer, c.allow_changes)
    except (RecipeError, OSError):
        return None, warning  # a checkpoint whose recipe cannot be read: the trainer tries the one before it
    saved_dp, dp = _saved_dp(newest), compute_layout(recipe).dp
    if saved_dp is not None and saved_dp != dp and not allows(c.allow_changes, "layout.dp"):
        # train/restore.py's rule: each DP rank's data position is its own (other nodes, workers, tp or cp)
        refused.append(f"data-parallel size {saved_dp} -> {dp} (name layout.dp to restart the data stream)")
    if not refused:
        return None, warning
    return (
        f"run dir {run_dir}: the job would resume from {newest.name}, which was trained with another recipe:"
        f" {'; '.join(refused)}; restore those values, use another run_dir, or (where the change is sane, e.g."
        " optim.lr) name each key in checkpoint.allow_changes"
    ), warning


def _saved_dp(checkpoint: Path) -> int | None:
    try:
        dp = json.loads((checkpoint / "state.json").read_text()).get("dp")
    except (OSError, ValueError, AttributeError):
        return None
    return dp if isinstance(dp, int) and not isinstance(dp, bool) else None
