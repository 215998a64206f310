"""Render a recipe into a job directory: compile/run/eval.sbatch (and infer.sbatch for classification families), the
resolved recipe.yaml and provenance.json.

Everything is rendered in memory first, so a bad value writes nothing; files are then replaced atomically.
No torch import: `make ... sbatch` must stay instant.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import jinja2
import yaml

from trnrecipes import REPO_ROOT, __version__
from trnrecipes.config.cluster import LOCAL_INSTANCES
from trnrecipes.config.families import family_spec
from trnrecipes.config.preemption import render_warnings as preemption_warnings
from trnrecipes.config.preemption import signal_seconds
from trnrecipes.config.profiling import neuron_profile_env
from trnrecipes.config.recipe import is_plain_path
from trnrecipes.config.sections import TRACKER_PACKAGES, Recipe, RecipeError
from trnrecipes.config.stacks import TORCHNEURON, default_python
from trnrecipes.jobs.neuron_env import JOB_USER, backend_env
from trnrecipes.jobs.storage import run_dir_for
from trnrecipes.jobs.wheelhouse import job_wheels
from trnrecipes.plan.eval_cost import CPU_CORES as EVAL_CPU_CORES
from trnrecipes.plan.eval_cost import eval_mem_gb
from trnrecipes.plan.layout import Layout, compute_layout, layout_memory, rank_coords
from trnrecipes.plan.memory import memory_problem
from trnrecipes.schema import shell_word, shown

TEMPLATES_DIR = REPO_ROOT / "templates"
SCRIPTS = ("compile.sbatch", "run.sbatch", "eval.sbatch")
# Classification families (FamilySpec.objective) also get a batch-embedding job (`trnrecipes embed`), and their
# eval.sbatch scores a labelled holdout with `trnrecipes predict` instead of running lm-eval.
CLASSIFICATION_SCRIPTS = (*SCRIPTS, "infer.sbatch")
# infer.sbatch's pre-timeout signal lead: it only has to stop embed and requeue (finished chunks are on disk
# already), but Slurm may send the signal up to 60 s early.
INFER_SIGNAL_SECONDS = 120
RECIPE_HEADER = "# Resolved recipe: "  # the first line of every recipe.yaml we write: it marks our job dirs


@dataclass(frozen=True)
class Job:
    recipe: Recipe
    layout: Layout
    job_dir: Path
    files: dict[str, str]  # file name -> content


def default_job_dir(recipe: Recipe) -> Path:
    return REPO_ROOT / "jobs" / recipe.job_name


def objective(recipe: Recipe) -> str:
    """What the recipe's family trains: "causal_lm" or "classification" (recipes/common/spec.py FamilySpec)."""
    return family_spec(recipe.model.family).objective


def scripts(recipe: Recipe) -> tuple[str, ...]:
    """The scripts of the recipe's job dir."""
    return CLASSIFICATION_SCRIPTS if objective(recipe) == "classification" else SCRIPTS


def render_warnings(recipe: Recipe, job_dir: Path | None = None) -> list[str]:
    """What `trnrecipes sbatch` prints to stderr (the job dir is still written): the time-limit and signal checks
    (trnrecipes.config.preemption; the unset time limit once per job dir), a memory estimate within 10% of the
    device's, and a classification recipe without a holdout for eval.sbatch. That one is a
    warning, not an error: training does not need it (its validation split comes from data.val_fraction), and
    eval.sbatch can still be given a file when it is submitted."""
    warnings = preemption_warnings(recipe, time_limit_shown=job_dir is not None and _time_limit_shown(job_dir))
    if objective(recipe) == "classification" and recipe.data.eval_path is None:
        warnings.append(
            "data.eval_path is not set: eval.sbatch has no labelled holdout to score and stops saying so, unless it is"
            " submitted as EVAL_IN=<labelled Arrow file> sbatch .../eval.sbatch. Set data.eval_path to score one"
            " after every run"
        )
    if recipe.train.compile and recipe.layout.fsdp and recipe.stack == TORCHNEURON:
        warnings.append(
            "train.compile true with layout.fsdp on TorchNeuron: AWS's TorchNeuron overview (aws-neuron-sdk"
            " frameworks/torch/pytorch-native-overview.rst) supports SimpleFSDP under torch.compile, not the FSDP2"
            " fully_shard this recipe uses; compile with FSDP2 (and TP) is tested here on the CPU only. Set"
            " train.compile false (eager) if the compile job fails"
        )
    tracked = [name for name in recipe.monitor.trackers if name in TRACKER_PACKAGES]
    if tracked and recipe.cluster.backend == "neuron":  # the login node's doctor cannot see the nodes' venv
        dists = ", ".join(dist for name in tracked for _, dist in TRACKER_PACKAGES[name])
        warnings.append(
            f"monitor.trackers {', '.join(tracked)}: the DLAMI venv has no {dists}, and the wheelhouse does not carry"
            " them (the tracking extra): install them into the job's Python on every node (pip install -c <its pip"
            " freeze> -e '.[tracking]'), or each node's pre-flight stops the job at its start"
        )
    estimate, _ = layout_memory(recipe)
    if estimate.verdict == "does not fit":  # written anyway: --no-memory-check
        warnings.append(
            f"memory: ~{estimate.total / 2**30:.1f} GiB per worker estimated, more than the device's"
            f" {estimate.capacity / 2**30:.0f} (--no-memory-check)"
        )
    if estimate.verdict == "tight":
        warnings.append(
            f"memory: ~{estimate.total / 2**30:.1f} of {estimate.capacity / 2**30:.0f} GiB per worker (an estimate,"
            " trnrecipes/plan/memory.py): within 10% of the device's; a longer sequence or a compiler's extra buffers"
            " may not fit. model.activation_checkpointing=full, layout.zero1 or a larger layout.tp leave room"
        )
    return warnings


def _time_limit_shown(job_dir: Path) -> bool:
    """Whether sbatch already warned of an unset slurm.time_limit in `job_dir`: the recipe.yaml it wrote there is a
    cluster recipe without one (a new decision, such as unsetting a limit, is warned of again)."""
    previous = _load_mapping(previous_recipe(job_dir) or "")
    slurm, cluster = previous.get("slurm"), previous.get("cluster")
    return (
        isinstance(slurm, dict)
        and slurm.get("time_limit") is None
        and isinstance(cluster, dict)
        and cluster.get("instance") not in LOCAL_INSTANCES
    )


def previous_recipe(job_dir: Path) -> str | None:
    """The recipe.yaml an earlier `trnrecipes sbatch` wrote in `job_dir`, or None."""
    if not is_job_dir(job_dir):
        return None
    try:
        return (job_dir / "recipe.yaml").read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def recipe_changes(old: str, new: str, most: int = 10) -> list[str]:
    """One line per key whose value differs between two recipe.yaml texts, `key: old -> new`, at most `most` of
    them and then how many more."""
    before, after = _flat(_load_mapping(old)), _flat(_load_mapping(new))
    keys = [k for k in dict.fromkeys([*before, *after]) if before.get(k, _ABSENT) != after.get(k, _ABSENT)]
    lines = [f"{key}: {_shown_value(before, key)} -> {_shown_value(after, key)}" for key in keys[:most]]
    return lines + ([f"... and {len(keys) - most} more"] if len(keys) > most else [])


_ABSENT = object()


def _load_mapping(text: str) -> dict:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        return {}
    return data if isinstance(data, dict) else {}


def _flat(data: dict, prefix: str = "") -> dict[str, object]:
    flat: dict[str, object] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            flat |= _flat(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _shown_value(values: dict[str, object], key: str) -> str:
    return "(absent)" if key not in values else "null" if values[key] is None else shown(values[key])


def sbatch_command(recipe_arg: str, nodes: int, overrides: str = "", out: str = "", verb: str = "sbatch") -> str:
    """The command that re-creates a job dir (`verb`: sbatch, or k8s for its k8s/); printed at the top of every
    script."""
    argv = ["trnrecipes", verb, "--recipe", recipe_arg, "--nodes", str(nodes)]
    if out:
        argv += ["--out", out]
    if overrides:
        argv += ["--overrides", overrides]
    return shlex.join(argv)


def _quote_env(value: object) -> str:
    """An exported value: quoted, except that JOB_USER expands. Values holding it are built from plain paths only
    (recipe checks), so double quotes protect the rest."""
    text = str(value)
    if JOB_USER in text and is_plain_path(text.replace(JOB_USER, "")):
        return f'"{text}"'
    return shell_word(text)


def _comment(value: object) -> str:
    # A newline inside a comment would turn the rest of the value into code.
    return re.sub(r"[\x00-\x1f\x7f]", "?", str(value))


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES_DIR),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["q"] = shell_word
    env.filters["qenv"] = _quote_env
    env.filters["comment"] = _comment
    return env


def cache_leader_nodes(layout: Layout) -> list[int]:
    """One node (SLURM_NODEID) per distinct set of pipeline stages: nodes holding the same stages compile the same
    graphs, so one of them copies its compile cache to the shared job dir instead of all writing it at once. Node n
    holds ranks n*W .. n*W + W - 1 (torchrun's static rendezvous, node rank = SLURM_NODEID), placed by rank_coords."""
    dims = {"pp": layout.pp, "dp": layout.dp, "cp": layout.cp, "tp": layout.tp}
    seen: dict[frozenset[int], int] = {}
    for node in range(layout.nodes):
        first = node * layout.workers_per_node
        stages = frozenset(rank_coords(r, **dims)[0] for r in range(first, first + layout.workers_per_node))
        seen.setdefault(stages, node)
    return sorted(seen.values())


def render_job(
    recipe: Recipe,
    job_dir: Path,
    command: str,
    repo_root: Path = REPO_ROOT,
    runs_root: str | None = None,
    memory_check: bool = True,
) -> Job:
    """All files of a job dir as text. Paths are absolute so a script runs from anywhere, also under Slurm.
    `runs_root` ($TRNRECIPES_RUNS, which the CLI reads) holds the run dir when the recipe names none
    (trnrecipes.jobs.storage.run_dir_for)."""
    layout = compute_layout(recipe)
    estimate, dp_of = layout_memory(recipe)
    if memory_check and (problem := memory_problem(recipe, estimate, dp_of)):
        raise RecipeError(problem + "; --no-memory-check writes the job anyway (for a layout measured to fit)")
    job_dir = Path(os.path.abspath(job_dir))
    # The job dir appears in #SBATCH lines, which sbatch reads without a shell: no quoting can protect it.
    if not is_plain_path(str(job_dir)):
        raise RecipeError(
            f"job directory {shown(str(job_dir))} must use only letters, digits and . _ / + - (Slurm reads it from"
            " #SBATCH lines, which no quoting protects); pass --out with a plain path"
        )
    eval_in = Path(recipe.data.eval_path) if recipe.data.eval_path else None
    context = {
        "r": recipe,
        "layout": layout,
        "version": __version__,
        "command": command,
        "job_dir": job_dir,
        "repo_root": repo_root,
        "run_dir": run_dir_for(recipe, repo_root, runs_root),
        "python": default_python(recipe, repo_root),
        "eval_python": default_python(recipe, repo_root, scoring=True),
        "wheels": job_wheels(recipe, repo_root),
        "megatron": any(c.format == "megatron" for c in recipe.data.corpora()),  # the ready step installs its reader
        "stack": recipe.stack,
        "env_rows": backend_env(recipe, job_dir),
        "profile_env": neuron_profile_env(recipe, str(run_dir_for(recipe, repo_root, runs_root))),
        "signal_seconds": signal_seconds(recipe),
        "cache_leaders": " ".join(map(str, cache_leader_nodes(layout))),
        "objective": objective(recipe),
        "eval_in": eval_in and repo_root / eval_in,  # data paths are relative to the repository root
        "infer_signal_seconds": INFER_SIGNAL_SECONDS,
        "eval_mem_gb": eval_mem_gb(recipe),
        "eval_cpus": EVAL_CPU_CORES,
    }
    env = _environment()
    files = {name: env.get_template(f"{name}.j2").render(context) for name in scripts(recipe)}
    header = f"{RECIPE_HEADER}{_comment(recipe.name)}, {recipe.cluster.nodes} node(s). Made by: {_comment(command)}\n"
    files["recipe.yaml"] = header + yaml.safe_dump(recipe.to_dict(), sort_keys=False)
    return Job(recipe, layout, job_dir, files)


def provenance(job: Job, command: str, source: Path, overrides: str) -> dict[str, object]:
    return {
        "command": command,
        "recipe_source": str(source),
        "overrides": overrides,
        "nodes": job.recipe.cluster.nodes,
        "trnrecipes_version": __version__,
        "git_sha": _git("rev-parse", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "rendered_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "layout": job.layout.to_dict(),
        "files": {name: _sha256(text.encode()) for name, text in job.files.items()},  # to tell edits by hand
    }


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _git(*args: str) -> str:
    try:
        done = subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def write_job(job: Job, extra_files: dict[str, str], force: bool = False) -> tuple[list[str] | None, list[str]]:
    """Write the job dir. A new dir appears whole (temp dir + rename), with the logs/ dir Slurm's --output needs
    (sbatch does not create it). In an existing dir (logs of earlier runs, the compile cache copy) each file is
    replaced atomically; but queued and requeued jobs read recipe.yaml when they start, so a different recipe
    replaces it only with force, and so do our files in a non-empty directory we did not write. A script edited
    by hand since it was rendered is moved aside (keep_edited), not replaced.
    Returns (what changed where a recipe.yaml of ours was replaced by a different one (recipe_changes), else None;
    one line per script moved aside)."""
    files = job.files | extra_files
    parent = job.job_dir.parent
    parent.mkdir(parents=True, exist_ok=True)
    if not job.job_dir.exists():
        tmp = Path(tempfile.mkdtemp(prefix=f".{job.job_dir.name}.", dir=parent))
        try:
            tmp.chmod(0o755)  # mkdtemp makes it private
            (tmp / "logs").mkdir()
            for name, text in files.items():
                _write(tmp / name, text, name)
            os.replace(tmp, job.job_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return None, []
    if not job.job_dir.is_dir():
        raise RecipeError(f"{job.job_dir} exists and is not a directory; pass --out with a new or empty directory")
    if not force and any(job.job_dir.iterdir()) and not is_job_dir(job.job_dir):
        clash = sorted(name for name in [*files, "logs"] if (job.job_dir / name).exists())
        replacing = f": writing there would replace its {', '.join(clash)}" if clash else ""
        raise RecipeError(
            f"{job.job_dir} is not empty and is not a job dir `trnrecipes sbatch` wrote (no recipe.yaml of ours)"
            f"{replacing}; pass --out with a new or empty directory, or --force (make: force=1) to write into it"
        )
    old = previous_recipe(job.job_dir)  # None: a new or empty dir, or one written with force
    changes = None
    if old is not None and old != files["recipe.yaml"]:
        changes = recipe_changes(old, files["recipe.yaml"]) or [_unset_change(old, files["recipe.yaml"])]
        if not force:
            raise RecipeError(
                f"{job.job_dir} already holds a different recipe.yaml, which queued or requeued jobs of it read when"
                " they start; pass --force (make: force=1) to replace it, or --out for a new job dir. It would"
                " change:" + "".join(f"\n  {line}" for line in changes)
            )
    (job.job_dir / "logs").mkdir(exist_ok=True)
    kept = keep_edited(job.job_dir, files)
    for name, text in files.items():
        fd, tmp_name = tempfile.mkstemp(prefix=f".{name}.", dir=job.job_dir)
        os.close(fd)
        try:
            _write(Path(tmp_name), text, name)
            os.replace(tmp_name, job.job_dir / name)
        finally:
            Path(tmp_name).unlink(missing_ok=True)
    # another recipe's script (infer.sbatch of a classification recipe it replaces) would read this recipe.yaml
    stale = [name for name in CLASSIFICATION_SCRIPTS if name not in files and _made_here(job.job_dir / name, name)]
    for name in stale:
        (job.job_dir / name).unlink()
    if stale:
        changes = [*(changes or []), f"{', '.join(stale)}: removed (of the job it replaces; this recipe has none)"]
    return changes, kept


def keep_edited(job_dir: Path, files: dict[str, str]) -> list[str]:
    """Move aside, as NAME.edited-TIME, each of the job dir's scripts that a re-render would replace and that was
    changed since it was rendered (its sha256 is not the one provenance.json recorded; in a job dir of a trnrecipes
    that recorded none, one that differs from the new text and was modified after provenance.json, which every
    render writes last): a hand-made fix (a module load, an srun flag) is not lost to the next `make ... sbatch`.
    One line per file moved."""
    try:
        recorded = json.loads((job_dir / "provenance.json").read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        recorded = None
    recorded = recorded if isinstance(recorded, dict) else None
    try:  # written last by every render: a script changed later than it was changed by hand
        rendered_at = (job_dir / "provenance.json").stat().st_mtime
    except OSError:
        rendered_at = None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    kept = []
    for name, text in files.items():
        if name in ("recipe.yaml", "provenance.json"):  # recipe.yaml's own edits are refused without --force
            continue
        try:
            now = (job_dir / name).read_bytes()
        except OSError:  # not there (or a directory, which the write will name)
            continue
        if now == text.encode() or (recorded is not None and recorded.get(name) == _sha256(now)):
            continue  # as the new render, or as the last one rendered it (an older template): nothing of the user's
        if recorded is None and rendered_at is not None and (job_dir / name).stat().st_mtime <= rendered_at:
            continue  # no record (an older trnrecipes rendered it), and not changed since: an older template's
        aside = job_dir / f"{name}.edited-{stamp}"
        n = 1
        while aside.exists():
            aside, n = job_dir / f"{name}.edited-{stamp}-{n}", n + 1
        os.replace(job_dir / name, aside)
        why = "edited since it was rendered"
        if recorded is None:
            why = "changed after it was rendered (by an older trnrecipes, which kept no sha256)"
        compare = f"diff {shell_word(str(aside))} {shell_word(str(job_dir / name))}"
        kept.append(f"{name}: {why}; moved to {aside.name}, not lost (compare: {compare})")
    return kept


def _made_here(script: Path, name: str) -> bool:
    """Whether `script` is one `trnrecipes sbatch` wrote as `name` (its second line says so), not a user's file."""
    try:
        with open(script, encoding="utf-8") as f:
            return f.readline().startswith("#!") and f.readline().startswith(f"# {name} for ")
    except (OSError, UnicodeDecodeError):
        return False


def _unset_change(old: str, new: str) -> str:
    """What differs between two recipe.yaml texts that set the same values: the first line (how it was made), or
    text a user added (comments, layout), which the new one does not keep."""
    if old.splitlines()[1:] == new.splitlines()[1:]:
        return "no setting: only its first line (how it was made)"
    return "no setting: comments or layout edited in it, which the new recipe.yaml does not keep"


def is_job_dir(path: Path) -> bool:
    try:
        with open(path / "recipe.yaml", encoding="utf-8") as f:
            return f.read(len(RECIPE_HEADER)) == RECIPE_HEADER
    except (OSError, UnicodeDecodeError):
        return False


def _write(path: Path, text: str, name: str) -> None:
    """`text` at `path`, with the mode the job dir's file `name` has (scripts executable): in an existing job dir,
    `path` is a temp name (.run.sbatch.XXXX) renamed to `name`, whose suffix decides."""
    path.write_text(text)
    path.chmod(0o755 if Path(name).suffix in (".sbatch", ".sh") else 0o644)


def provenance_json(data: dict[str, object]) -> str:
    return json.dumps(data, indent=2) + "\n"
