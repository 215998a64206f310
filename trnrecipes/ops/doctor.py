"""Pre-flight in seconds, before anything is compiled: `trnrecipes doctor --config jobs/X/recipe.yaml` on a login
node, and the first lines of every compile/run/eval/infer.sbatch on every node (`--node`). It checks what the first
real job would otherwise find after its nodes were allocated:

- the job's interpreter exists, and holds the stack's packages at the versions its Neuron SDK ships
  (trnrecipes.config.stacks.SDK_RELEASES) and importable, plus what trnrecipes needs for this job;
- neuron_parallel_compile beside the interpreter or on PATH (compile.sbatch on torch-xla + NxD);
- with --node: the NeuronCores the recipe expects per node (neuron-ls, else /dev/neuron*);
- the data and tokenizer (trnrecipes.jobs.data_check, corpus_check), the run dir writable (never created here) with
  room for the checkpoints, and room for the compile cache on the node.

Each failure is one line naming the thing, what was found and the command that fixes it. Exit 2 bad input; with
--node, 1 for a fault of this node alone (devices, disk) and NOT_READY (4) for this node's job Python: the job
script tells a node's fault from bad input by whether every node fails (docs/jobs.md, 'Exit codes'). Only the
standard library is imported at the top, so that a missing PyYAML is reported like any other missing package.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from trnrecipes import REPO_ROOT
from trnrecipes.config.sections import TRACKER_PACKAGES
from trnrecipes.jobs.mounts import SHARED_TYPES, mount_of, read_mountinfo

JOBS = ("compile", "run", "eval", "infer")
COMPILE_CACHE_MIN_BYTES = 10 * 2**30  # a 70B model's NEFFs are a few GB; less free than this fails mid-compile
# Under a billion parameters the NEFFs are a few hundred MB: 10 GiB would refuse a small model's node for no reason.
SMALL_MODEL_CACHE_MIN_BYTES = 2 * 2**30
SMALL_MODEL_PARAMS = 10**9
NEURON_LS = ("neuron-ls", "/opt/aws/neuron/bin/neuron-ls")  # aws-neuronx-tools; PATH first
MAX_CORES_PER_DEVICE = 64  # trn2's 8 physical cores a device; anything far beyond is not neuron-ls's JSON
# What trnrecipes imports for each job (module -> the pip distribution that provides it).
TRAIN_MODULES = {"yaml": "pyyaml", "numpy": "numpy", "pyarrow": "pyarrow", "safetensors": "safetensors",
                 "tokenizers": "tokenizers", "tiktoken": "tiktoken", "tqdm": "tqdm",
                 "tensorboard": "tensorboard"}  # fmt: skip
EVAL_MODULES = {"yaml": "pyyaml", "torch": "torch", "lm_eval": "lm-eval", "transformers": "transformers",
                "accelerate": "accelerate", "safetensors": "safetensors", "tokenizers": "tokenizers"}  # fmt: skip
CLASSIFY_MODULES = {"yaml": "pyyaml", "torch": "torch", "numpy": "numpy", "pyarrow": "pyarrow",
                    "safetensors": "safetensors", "tokenizers": "tokenizers"}  # fmt: skip
# The stack packages imported after their versions check out (a broken install fails on import, not on a version).
IMPORT_NAMES = {"torch": "torch", "torch-xla": "torch_xla", "torch-neuronx": "torch_neuronx",
                "neuronx-distributed": "neuronx_distributed"}  # fmt: skip


def _host() -> str:
    """This node as Slurm names it (what an exclusion names), else its short host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def _extra(stack: str) -> str:
    """The pyproject extra that installs what trnrecipes needs beside this stack's own packages."""
    return "neuron" if stack in ("xla-nxd", "torchneuron") else "train"


def _install(python: str, what: str) -> str:
    """The command that installs what is missing. Into a Neuron venv: the neuron requirements, held to what the venv
    already has (nothing there changes), on every node (the DLAMI's venvs are node-local: docs/jobs.md)."""
    py = shlex.quote(python)
    if what == "neuron":
        reqs = shlex.quote(str(REPO_ROOT / "requirements" / "neuron.txt"))
        return (
            f"{py} -m pip freeze --exclude-editable > /tmp/venv.txt && {py} -m pip install -c /tmp/venv.txt -r {reqs}"
            " on every node (srun --ntasks-per-node=1)"
        )
    # check() runs under the job's Python; .[train] and .[eval] pin for 3.11+ (the tracking extra resolves on 3.10)
    if sys.version_info < (3, 11) and what != "tracking":
        version = ".".join(map(str, sys.version_info[:2]))
        return (
            f"{python} is Python {version}, and the {what} install needs 3.11 or 3.12: run make setup where one is"
            " found (make setup python=PATH names it), or set cluster.python (or TRNRECIPES_PYTHON) to a Python that"
            " has them"
        )
    if what == "tracking":  # beside a stack's packages (a Neuron venv's protobuf, numpy): held to what is there
        return (
            f"{py} -m pip freeze --exclude-editable > /tmp/venv.txt && {py} -m pip install -c /tmp/venv.txt -e"
            f" {shlex.quote(str(REPO_ROOT))}'[tracking]'"
        )
    return f"{py} -m pip install -e {shlex.quote(str(REPO_ROOT))}'[{what}]'"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _matches(version: str, prefixes: tuple[str, ...]) -> bool:
    plain = version.split("+")[0] + "."  # 2.5.1+cpu -> "2.5.1.", which "2.5." and "2.5.1." both start
    return any(plain.startswith(p) for p in prefixes)


def stack_problems(recipe, python: str) -> tuple[list[str], list[str]]:
    """(problems, found 'name version' notes) for the Neuron stack's packages in this interpreter."""
    from trnrecipes.config.stacks import SDK_RELEASES, sdk_version

    sdk = recipe.cluster.neuron_sdk
    release = SDK_RELEASES[sdk_version(sdk)]
    problems, found, missing = [], [], []
    venv = release.venvs[0]
    for dist, prefixes in release.packages.items():
        version = _version(dist)
        wanted = " or ".join(f"{p}*" for p in prefixes)
        if version is None:
            missing.append(dist)
        elif not _matches(version, prefixes):
            shipped_by = [
                f"{a}.{b}" for (a, b), r in SDK_RELEASES.items() if _matches(version, r.packages.get(dist, ()))
            ]
            which = (
                f"that is Neuron SDK {' or '.join(shipped_by)}'s: set cluster.neuron_sdk {shipped_by[-1]}"
                if shipped_by
                else "no release in the stack table ships it"
            )
            problems.append(
                f"{dist} {version} in {python}, but cluster.neuron_sdk {sdk} ships {wanted}; {which}, or run the job"
                f" with SDK {sdk}'s {venv}/bin/python"
            )
        else:
            found.append(f"{dist} {version}")
    torch, neuronx = _version("torch"), _version("torch-neuronx")
    if torch and neuronx and not neuronx.startswith(".".join(torch.split("+")[0].split(".")[:2]) + "."):
        problems.append(f"torch-neuronx {neuronx} is built for another torch than the torch {torch} in {python}")
    if missing:
        problems.insert(
            0,
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed in {python}: not Neuron SDK"
            f" {sdk}'s environment; run the job with {venv}/bin/python (cluster.python or TRNRECIPES_PYTHON), or set"
            " cluster.neuron_sdk to the SDK installed",
        )
    if problems:
        return problems, found
    for dist in release.packages:
        if dist not in IMPORT_NAMES:
            continue
        try:
            importlib.import_module(IMPORT_NAMES[dist])
        except Exception as err:  # an install broken any way: name it, one line
            text = str(err).strip().splitlines()[-1:] or [type(err).__name__]
            problems.append(f"{dist} is installed in {python} but `import {IMPORT_NAMES[dist]}` fails: {text[0][:200]}")
    return problems, found


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a dotted name whose parent package is missing
        return False


def module_problems(modules: dict[str, str], python: str, extra: str) -> list[str]:
    missing = sorted({dist for module, dist in modules.items() if not _installed(module)})
    if not missing:
        return []
    return [f"{', '.join(missing)} not installed in {python} (trnrecipes needs them here): {_install(python, extra)}"]


def neuron_cores() -> tuple[int | None, str, str | None]:
    """(NeuronCores on this node, how it was found, what is wrong with neuron-ls's answer); cores None when nothing
    tells."""
    tool = next((t for t in (shutil.which(NEURON_LS[0]), NEURON_LS[1]) if t and os.access(t, os.X_OK)), None)
    if tool:
        try:
            done = subprocess.run([tool, "--json-output"], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as err:  # a hung driver: this node's, another may be fine
            return None, f"{tool} -j", f"{NODE_FAULT}{tool} -j could not be run ({err}); check this node's driver"
        if done.returncode != 0:  # "Failed to open /dev/neuron0": the node's devices or driver
            said = (done.stderr.strip().splitlines() or ["nothing"])[-1][:200]
            return None, f"{tool} -j", f"{NODE_FAULT}{tool} -j failed (exit {done.returncode}): {said}"
        cores = _count_cores(done.stdout)
        if cores is None:
            return (
                None,
                f"{tool} -j",
                (
                    f"{tool} -j printed {_shown(done.stdout)}, not its JSON list of devices with an nc_count each;"
                    " check aws-neuronx-tools on this node"
                ),
            )
        return cores, f"{tool} -j", None
    devices = sorted(Path("/dev").glob("neuron[0-9]*"))
    return (
        (None, "no neuron-ls", None)
        if not devices
        else (None, f"{len(devices)} /dev/neuron* device(s), no neuron-ls", None)
    )


def _count_cores(text: str) -> int | None:
    """The NeuronCores in neuron-ls's JSON (a list of devices, each with a whole nc_count), or None."""
    try:
        devices = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(devices, list) or not all(isinstance(d, dict) for d in devices):
        return None
    counts = [d.get("nc_count") for d in devices]
    if not all(type(c) is int and 0 <= c <= MAX_CORES_PER_DEVICE for c in counts):
        return None
    return sum(counts)


def _shown(text: str, limit: int = 80) -> str:
    text = text.strip()
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def _writable_ancestor(path: Path) -> tuple[Path, bool]:
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate, os.access(candidate, os.W_OK | os.X_OK)
    return Path(path.anchor), False


NODE_FAULT = "[node] "  # a problem of this node (devices, disk), which another node would not have
# A problem of this node's job Python (its packages, its Neuron stack): one node's, or every node's (the recipe's
# SDK is not the cluster's). With --node, exit NOT_READY; the job script tells the two apart across its nodes.
NODE_PYTHON = "[python] "
NOT_READY = 4
NOTE = "note: "  # a note printed on its own line: what could not be checked here


def check(
    recipe, job: str, run_dir: Path, node: bool, python: str | None = None, here: bool = True
) -> tuple[list[str], list[str]]:
    """(problems, notes) for this interpreter (`python`: its name as the job gives it, a venv's bin/python that may
    be a link or a wrapper) and host. `here` False: the job's Python is not on this host (a login node without the
    DLAMI): the files are checked from this Python, its packages are left to the nodes."""
    from trnrecipes.config.families import family_spec
    from trnrecipes.jobs.corpus_check import corpus_problems
    from trnrecipes.jobs.data_check import data_problems, eval_data_problem
    from trnrecipes.jobs.storage import run_dir_blocker, storage_report

    python = python or sys.executable
    stack = recipe.stack
    classify = family_spec(recipe.model.family).objective == "classification"
    problems, notes = [], [f"python {python}" if here else f"{NOTE}{not_here(recipe, python)}"]
    mine = NODE_PYTHON if node else ""  # on a job's node: this node's Python, perhaps not the others'
    if job in ("compile", "run"):
        if not here:
            pass
        elif recipe.cluster.backend == "neuron":
            found_problems, found = stack_problems(recipe, python)
            problems += [mine + p for p in found_problems]
            notes += found
        else:
            problems += [mine + p for p in module_problems({"torch": "torch"}, python, "train")]
        modules = dict(TRAIN_MODULES)
        if any(s.format == "megatron" for s in recipe.data.corpora()):
            modules["megatron.core"] = "megatron-core"
        lacking = module_problems(modules, python, _extra(stack)) if here else []
        if lacking and not node and (wheels := _wheelhouse(recipe)):  # each node installs them when the job starts
            notes.append(
                f"{NOTE}{lacking[0].split(' (')[0]}: each node installs them from {wheels} when the job starts"
            )
        else:
            problems += [mine + p for p in lacking]
        if here:  # monitor.trackers' packages (the tracking extra): missing, the run stops before it trains
            tracking = {m: dist for name in recipe.monitor.trackers for m, dist in TRACKER_PACKAGES.get(name, ())}
            problems += [mine + p for p in module_problems(tracking, python, "tracking")]
        from trnrecipes.config.tracking import tracker_setting_problems

        problems += tracker_setting_problems(recipe.monitor.trackers)
        problems += data_problems(recipe, REPO_ROOT)
        content, unchecked = corpus_problems(recipe, REPO_ROOT, scan=not node)  # a scan: once, not on every node
        problems += content
        notes += [f"{NOTE}{line}" for line in unchecked]
        if why := run_dir_blocker(run_dir):
            problems.append(f"run dir {run_dir}: {why}; set run_dir (or TRNRECIPES_RUNS) to storage you can write")
        elif (room := storage_report(recipe, run_dir)[2]) is not None:
            problems.append(room)  # not writable, or not room for keep_last checkpoints there
    elif here:
        modules = CLASSIFY_MODULES if classify or job == "infer" else EVAL_MODULES
        problems += module_problems(modules, python, "eval" if modules is EVAL_MODULES else "train")
    if job == "eval" and not classify and (missing := eval_data_problem(REPO_ROOT)):
        notes.append(f"{NOTE}{missing} (unless the job is given --data-dir)")  # its arguments are not seen here
    if job == "compile" and stack == "xla-nxd" and here:
        beside = Path(python).parent / "neuron_parallel_compile"
        if not (beside.is_file() or shutil.which("neuron_parallel_compile")):
            problems.append(
                f"{mine}neuron_parallel_compile is neither beside {python} nor on PATH: torch-neuronx provides it;"
                " use the Neuron SDK's venv (cluster.python)"
            )
    if node and recipe.cluster.backend == "neuron" and job in ("compile", "run"):
        cores, how, bad = neuron_cores()
        need = recipe.workers_per_node
        if bad:
            problems.append(bad)
        elif cores is None and "device(s)" not in how:
            problems.append(
                f"{NODE_FAULT}no Neuron devices ({how}, no /dev/neuron*): not a Trainium node? check the partition"
            )
        elif cores is not None and cores < need:
            problems.append(
                f"{NODE_FAULT}{cores} NeuronCores ({how}), the recipe runs {need} workers per node, one per core"
            )
        else:
            notes.append(f"{cores if cores is not None else '?'} NeuronCores ({how})")
        cache = os.environ.get("NEURON_COMPILE_CACHE_URL") or os.environ.get("TORCH_NEURONX_NEFF_CACHE_DIR")
        if cache and "://" not in cache and (room := cache_space_problem(cache, read_mountinfo(), cache_need(recipe))):
            problems.append(room)
    return problems, notes


def cache_need(recipe) -> int:
    """Free bytes the compile cache needs: less for a model under a billion parameters."""
    small = recipe.model.param_count() < SMALL_MODEL_PARAMS
    return SMALL_MODEL_CACHE_MIN_BYTES if small else COMPILE_CACHE_MIN_BYTES


def cache_space_problem(cache: str, mountinfo: str | None, need: int = COMPILE_CACHE_MIN_BYTES) -> str | None:
    """Too little room for the compile cache: this node's fault where the cache is on its own disk (another node
    has room), not on shared storage (trn2's JOB_DIR/neff-cache on FSx), where every node would fail the same way
    and excluding nodes, requeue after requeue, would not help."""
    anchor, _ = _writable_ancestor(Path(cache))
    free = shutil.disk_usage(anchor).free
    if free >= need:
        return None
    mount = mount_of(os.path.realpath(anchor), mountinfo) if mountinfo else None
    shared = mount is not None and mount[1] in SHARED_TYPES
    return (
        f"{'' if shared else NODE_FAULT}compile cache {cache}: {free / 2**30:.1f} GiB free at {anchor}"
        f"{f' (shared storage, {mount[1]}: every node)' if shared else ''}, under {need // 2**30} GiB: free space there"
    )


def _wheelhouse(recipe) -> str | None:
    """The job's wheelhouse when it is there and current (its nodes install from it what they lack), else None."""
    from trnrecipes.jobs.wheelhouse import RECORD, job_wheels, wheels_problem

    wheels = job_wheels(recipe, REPO_ROOT)
    if not wheels or wheels_problem(recipe, REPO_ROOT) or not (Path(wheels) / RECORD).is_file():
        return None
    return wheels


def _wheelhouse_of(recipe, dist: str) -> str | None:
    """The job's current wheelhouse where it holds a wheel of `dist` (its nodes install it from there)."""
    wheels = _wheelhouse(recipe)
    prefix = dist.lower().replace("-", "_") + "-"
    if wheels and any(w.name.lower().startswith(prefix) for w in Path(wheels).glob("*.whl")):
        return wheels
    return None


def _imports(python: str, module: str) -> bool:
    try:
        return subprocess.run([python, "-c", f"import {module}"], capture_output=True, timeout=300).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _job_dir_value(config: Path, name: str, job: str = "run") -> str | None:
    """NAME=... as rendered into the job dir's JOB.sbatch beside recipe.yaml (the run dir, the interpreter)."""
    script = config.parent / f"{job}.sbatch"
    if not script.is_file():
        return None
    for line in script.read_text(errors="replace").splitlines():
        if line.startswith(f"{name}="):
            try:
                words = shlex.split(line.split("=", 1)[1])
            except ValueError as err:  # a value with a newline (written before recipes refused one)
                raise ValueError(f"{script}: its {name}= line cannot be read ({err}); re-create the job dir") from None
            return words[0] if words else None
    return None


# Run by the job's Python in the checkout: what it is, and that it imports this trnrecipes.
PROBE = "import sys, trnrecipes; print('trnrecipes-python %d.%d' % sys.version_info[:2], trnrecipes.__file__)"


def python_problem(python: str) -> str | None:
    """Why `python` cannot run the job's trnrecipes (not a Python, older than 3.10, cannot import it), or None."""
    try:
        done = subprocess.run([python, "-c", PROBE], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"the job's Python {python} cannot be run ({err})"
    found = [line.split(" ", 1)[1] for line in done.stdout.splitlines() if line.startswith("trnrecipes-python ")]
    if not found:
        said = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:] or ["nothing"]
        return (
            f"the job's Python {python} is not a Python that imports trnrecipes from {REPO_ROOT} (exit"
            f" {done.returncode}, it printed {_shown(said[0])}); set cluster.python (or TRNRECIPES_PYTHON) to a"
            " Python 3.10+ interpreter"
        )
    version, imported = found[0].split(" ", 1) if " " in found[0] else (found[0], "")
    if imported and Path(imported).resolve().parent.parent != REPO_ROOT:
        return (
            f"the job's Python {python} imports trnrecipes from {Path(imported).parent}, not from the checkout"
            f" {REPO_ROOT}: uninstall that copy from it (pip uninstall trnrecipes)"
        )
    if tuple(int(x) for x in version.split(".")) < (3, 10):
        return (
            f"the job's Python {python} is Python {version}; trnrecipes needs 3.10 or newer: set cluster.python (or"
            " TRNRECIPES_PYTHON) to one"
        )
    return None


def main(argv: list[str] | None = None) -> int:
    """Exit 0 ready, 2 bad input (never requeued), 1 a fault of this node alone. A failure of the check itself is
    bad input's 2, never 1: run.sbatch would requeue the job into the same failure."""
    host = _host()
    try:
        return _preflight(argv, host)
    except Exception as err:
        text = (str(err).strip().splitlines() or [""])[0][:300]
        print(f"error: {host}: the pre-flight could not finish: {type(err).__name__}: {text}", flush=True)
        return 2


def _preflight(argv: list[str] | None, host: str) -> int:
    parser = argparse.ArgumentParser(prog="trnrecipes doctor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="a job dir's recipe.yaml")
    parser.add_argument("--job", choices=JOBS, default="run", help="which script's needs to check (default run)")
    parser.add_argument("--run-dir", help="the run dir (default: as the job dir's run.sbatch names it)")
    parser.add_argument("--node", action="store_true", help="also this node's devices and compile-cache space")
    parser.add_argument("--python", help="this interpreter as the job names it (the scripts pass it; then no re-run)")
    args = parser.parse_args(argv)
    # Every path from the caller's directory: the check may re-run itself in the checkout.
    config = Path(os.path.abspath(args.config))
    if importlib.util.find_spec("yaml") is None:  # what reading a recipe needs beyond the standard library
        named = args.python or sys.executable
        print(f"error: {host}: pyyaml not installed in {named}: {shlex.quote(named)} -m pip install 'pyyaml>=6'")
        return NOT_READY if args.node else 2
    from trnrecipes.config.recipe import read_recipe_file, recipe_from_dict
    from trnrecipes.config.sections import RecipeError
    from trnrecipes.config.stacks import default_python
    from trnrecipes.jobs.storage import run_dir_for, runs_root_from_env
    from trnrecipes.plan.layout import compute_layout

    try:
        recipe = recipe_from_dict(read_recipe_file(config), str(config))
        compute_layout(recipe)  # a batch the nodes cannot split: the recipe's error, not the check's crash
        given = os.environ.get("TRNRECIPES_PYTHON")  # the caller's: from the caller's directory
        python = given or _job_dir_value(config, "PYTHON", args.job)  # the scripts': from the checkout, where they run
        run_dir = args.run_dir or _job_dir_value(config, "RUN_DIR")
        checkout = _job_dir_value(config, "REPO")
    except (RecipeError, ValueError) as err:
        print(f"error: {host}: {err}")
        return 2
    if checkout and os.path.realpath(checkout) != os.path.realpath(REPO_ROOT):  # its data paths are relative to it
        print(
            f"error: {host}: {config.parent} was rendered from the checkout {checkout}, whose files its jobs read;"
            f" this doctor is {REPO_ROOT}'s: run {shlex.quote(str(Path(checkout) / '.venv/bin/trnrecipes'))} doctor"
            f" --config {shlex.quote(str(config))}"
        )
        return 2
    python = python or str(default_python(recipe, REPO_ROOT, scoring=args.job in ("eval", "infer")))
    if os.sep in python:  # the re-run below starts in the checkout
        python = os.path.abspath(python) if given else str(REPO_ROOT / python)
    run_dir = Path(os.path.abspath(run_dir)) if run_dir else run_dir_for(recipe, REPO_ROOT, runs_root_from_env())
    here, installs = True, None
    if args.python is None and os.path.abspath(python) != os.path.abspath(sys.executable):
        outside = REPO_ROOT not in Path(os.path.abspath(python)).parents  # the checkout's .venv is on every node
        if not os.access(python, os.X_OK) and not args.node and outside:
            here = False  # a login node without the DLAMI: the files from this Python, the rest on the nodes
        elif not os.access(python, os.X_OK):
            print(f"error: {host}: the job's Python {python} does not exist here; {_fix_python(recipe, python)}")
            return NOT_READY if args.node else 2
        elif problem := python_problem(python):
            print(f"error: {host}: {problem}")
            return NOT_READY if args.node else 2
        elif not args.node and not _imports(python, "yaml") and (wheels := _wheelhouse_of(recipe, "pyyaml")):
            # Its doctor cannot read a recipe without PyYAML, which each node installs from the wheelhouse before
            # its own pre-flight: the files are checked from this Python, the job's packages on the nodes.
            here, installs = False, f"pyyaml is not installed in {python}: each node installs it from {wheels}"
        argv = ["--config", str(config), "--job", args.job, "--run-dir", str(run_dir), "--python", python]
        argv += ["--node"] if args.node else []
        if here:
            code = subprocess.run([python, "-m", "trnrecipes.ops.doctor", *argv], cwd=REPO_ROOT).returncode
            if code not in (0, 1, 2, NOT_READY):
                print(f"error: {host}: the pre-flight under {python} ended with exit {code}, not a verdict")
                return 2
            return code
    problems, notes = check(recipe, args.job, run_dir, args.node, args.python or (python if not here else None), here)
    if installs:  # the job's Python is here but lacks what its doctor needs: not "not on this host"
        notes[0] = f"{NOTE}{installs} when the job starts, then checks the job's packages"
    for problem in problems:
        print(f"error: {host}: {problem.removeprefix(NODE_FAULT).removeprefix(NODE_PYTHON)}", flush=True)
    if problems and all(p.startswith(NODE_FAULT) for p in problems):  # this node's fault alone: 1, not bad input
        return 1
    if problems and all(p.startswith((NODE_FAULT, NODE_PYTHON)) for p in problems):
        return NOT_READY  # this node's Python: the script knows whether the other nodes' pass
    if problems:
        return 2
    for note in notes:
        if note.startswith(NOTE):
            print(f"{NOTE}{host}: {note.removeprefix(NOTE)}", flush=True)
    devices = "" if args.node else "; devices not checked off the nodes (each job checks its own)"
    found = ", ".join(n for n in notes if not n.startswith(NOTE)) or "data, tokenizer, run dir and checkpoint space"
    print(f"[doctor] {host}: {args.job} ok: {found}{devices}", flush=True)
    return 0


def not_here(recipe, python: str) -> str:
    """The note for a job Python that is not on this host: what only the job's nodes check, and where it comes from."""
    return (
        f"the job's Python {python} is not on this host ({_fix_python(recipe, python)}); its packages"
        + (", neuron_parallel_compile and the NeuronCores" if recipe.cluster.backend == "neuron" else "")
        + " are checked on every node when the job starts"
    )


def _fix_python(recipe, python: str | None = None) -> str:
    """What the job's Python is, for a message saying it is not here: which DLAMI's venv (the one `python` is, the
    release's default where it is none of them: cluster.python's own path is named as the recipe's)."""
    if recipe.cluster.backend == "neuron":
        from trnrecipes.config.stacks import SDK_RELEASES, sdk_version

        release = SDK_RELEASES[sdk_version(recipe.cluster.neuron_sdk)]
        here = [f"{v}/bin/python" for v in release.venvs[1:] if os.access(f"{v}/bin/python", os.X_OK)]
        if here and python != here[0]:  # the release's other DLAMI (Ubuntu 22.04 beside 24.04) is the one on this host
            return f"this host has SDK {recipe.cluster.neuron_sdk}'s other DLAMI venv: set cluster.python={here[0]}"
        ours = [i for i, v in enumerate(release.venvs) if python == f"{v}/bin/python"]
        if python and not ours:  # cluster.python (or TRNRECIPES_PYTHON) names another interpreter
            return (
                f"it is no DLAMI venv of Neuron SDK {recipe.cluster.neuron_sdk} but cluster.python's (or"
                f" TRNRECIPES_PYTHON's): every {recipe.cluster.instance} node needs it at that path; check for a typo"
            )
        ami = release.amis[ours[0] if ours else 0]
        return (
            f"it is the venv of the {ami} with Neuron SDK {recipe.cluster.neuron_sdk}, the AMI the job's"
            f" {recipe.cluster.instance} nodes need (trn1 trains on SDK 2.21-2.28, trn2/trn3 on 2.33); set"
            " cluster.python (or TRNRECIPES_PYTHON) if its interpreter is elsewhere"
        )
    return "make it with `make setup` in the checkout, or set cluster.python (or TRNRECIPES_PYTHON)"


if __name__ == "__main__":
    sys.exit(main())
