"""Neuron stacks (trnrecipes/config/stacks.py): which SDK x instance trains on xla-nxd or torchneuron, the render-time
errors for every other combination, the checks that depend on the stack, TorchNeuron's env table and job dirs, and
plans on an instance without a catalog price. Expected verdicts are derived here from the documented facts, not
from stack_problem."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO
from golden import FAKE_REPO, launch_lines, render_case
from test_neuron_env import env_of

from trnrecipes.config.cluster import INSTANCES
from trnrecipes.config.recipe import load_recipe
from trnrecipes.config.sections import RecipeError
from trnrecipes.config.stacks import SDK_RELEASES, STACKS, TORCHNEURON, XLA_NXD
from trnrecipes.jobs.render import render_job, render_warnings
from trnrecipes.plan.layout import compute_layout, plan
from trnrecipes.plan.report import format_plan

DLAMI = "/opt/aws_neuronx_venv_torch_neuronx_2_14_0/bin/python"

# The facts, written out: backends per instance, and the SDK ranges and instances of each Neuron stack.
BACKENDS = {
    "trn1.32xlarge": {"neuron"}, "trn1n.32xlarge": {"neuron"}, "trn2.48xlarge": {"neuron"},
    "trn3.48xlarge": {"neuron"}, "p4d.24xlarge": {"cuda", "xla"}, "p5.48xlarge": {"cuda", "xla"},
    "local-cpu": {"cpu", "xla"},
}  # fmt: skip
XLA_NXD_ON, XLA_NXD_SPAN = {"trn1.32xlarge", "trn1n.32xlarge", "trn2.48xlarge"}, "2.21 to 2.28"
NATIVE_ON, NATIVE_SPAN = {"trn2.48xlarge", "trn3.48xlarge"}, "2.33"
SDKS = ["2.9", "2.20", "2.21", "2.26", "2.28", "2.29", "2.30", "2.32", "2.33", "2.34", "x", "3.1"]
# pythia6.9b without TP: no pipeline, no FSDP, and a layout that divides on every instance at 1 node.
PLAIN = "layout.tp=1 layout.sequence_parallel=false"
NXD_TRN2 = "cluster.neuron_sdk=2.28 layout.fsdp=false"  # llama2-7b-trn2 on trn2 through torch-xla + NxD


def error_of(name: str, overrides: str = "", nodes: int = 1) -> str | None:
    try:
        load_recipe(name, nodes=nodes, overrides=overrides)
    except RecipeError as err:
        return str(err)
    return None


def expected_stack(instance: str, backend: str, sdk: str) -> str | None:
    """The stack that trains this combination, or None where it must be refused."""
    if backend not in BACKENDS[instance]:
        return None
    if backend != "neuron":
        return backend  # off Neuron the SDK means nothing
    minor = int(sdk[2:]) if re.fullmatch(r"2\.[0-9]+", sdk) else -1
    if 21 <= minor <= 28 and instance in XLA_NXD_ON:
        return "xla-nxd"
    if minor == 33 and instance in NATIVE_ON:
        return "torchneuron"
    return None


def test_the_fact_table_covers_the_catalog():
    assert set(BACKENDS) == set(INSTANCES)


@pytest.mark.parametrize("sdk", SDKS)
@pytest.mark.parametrize("backend", ["neuron", "xla", "cuda", "cpu"])
@pytest.mark.parametrize("instance", list(INSTANCES))
def test_every_instance_backend_sdk_combination(instance: str, backend: str, sdk: str):
    overrides = f"{PLAIN} cluster.instance={instance} cluster.backend={backend} cluster.neuron_sdk={sdk}"
    stack = expected_stack(instance, backend, sdk)
    if stack is not None:
        recipe = load_recipe("pythia6.9b", nodes=1, overrides=overrides)
        assert recipe.stack == stack
        assert compute_layout(recipe).world_size == INSTANCES[instance].workers_per_node
        return
    message = error_of("pythia6.9b", overrides)
    assert message is not None, "loaded, but this combination has no stack"
    if backend not in BACKENDS[instance]:
        valid = ", ".join(sorted(BACKENDS[instance]))
        assert f"cluster.backend {backend!r} does not run on {instance}; valid: {valid}" in message
        return
    _, _, valid = message.partition(f"valid on {instance}: cluster.neuron_sdk ")
    assert valid, message
    assert (XLA_NXD_SPAN in valid) is (instance in XLA_NXD_ON)
    assert (f"{NATIVE_SPAN} (TorchNeuron" in valid) is (instance in NATIVE_ON)


@pytest.mark.parametrize(
    ("instance", "sdk", "ok"),
    [("trn1.32xlarge", "2.26", False), ("trn1n.32xlarge", "2.21", False), ("trn2.48xlarge", "2.26", False),
     ("trn2.48xlarge", "2.33", True), ("trn3.48xlarge", "2.33", True)],
)  # fmt: skip
def test_fsdp_on_torchneuron_only(instance: str, sdk: str, ok: bool):
    message = error_of(
        "pythia6.9b", f"cluster.instance={instance} cluster.neuron_sdk={sdk} layout.fsdp=true layout.zero1=false"
    )
    if ok:
        assert message is None
    else:
        assert message is not None and "layout.fsdp true" in message
        assert "layout.zero1" in message and "cluster.neuron_sdk=2.33" in message


@pytest.mark.parametrize(
    ("name", "overrides", "refusal"),
    [("pythia6.9b", "", "train.compile true: backend neuron on Neuron SDK 2.26"),
     ("llama2-7b-trn2", f"{NXD_TRN2} layout.zero1=true", "backend neuron on Neuron SDK 2.28"),
     ("llama2-tiny", "cluster.backend=xla", "train.compile true: backend xla"),
     ("llama2-7b-trn2", f"{PLAIN}", None),
     ("llama2-7b-trn2", f"{PLAIN} cluster.instance=trn3.48xlarge", None),
     ("llama2-tiny", "", None)],
)  # fmt: skip
def test_train_compile_follows_the_stack(name: str, overrides: str, refusal: str | None):
    message = error_of(name, f"{overrides} train.compile=true")
    if refusal is None:
        assert message is None
    else:
        assert message is not None and refusal in message
        if "neuron" in refusal:
            assert "cluster.neuron_sdk=2.33" in message  # names where torch.compile does run


@pytest.mark.parametrize(("name", "tp"), [("llama2-7b-trn2", 4), ("llama2-tiny", 2)])
def test_train_compile_with_tensor_parallel_is_accepted(name: str, tp: int):
    """Compiled blocks under DTensor TP train as eager ones (tests/test_compiled_tp.py): no refusal on the native
    path, and on TorchNeuron with FSDP2 one warning that AWS documents SimpleFSDP, not fully_shard, under compile."""
    assert error_of(name, f"layout.tp={tp} train.compile=true") is None
    warned = render_warnings(load_recipe(name, nodes=2, overrides=f"layout.tp={tp} train.compile=true".split()))
    on_torchneuron_with_fsdp = [w for w in warned if "SimpleFSDP" in w]
    assert len(on_torchneuron_with_fsdp) == (1 if name == "llama2-7b-trn2" else 0), warned


def test_optlevel_is_fixed_on_torchneuron_only():
    message = error_of("llama2-7b-trn2", "compile.optlevel=2")
    assert message is not None and "compile.optlevel 2" in message and "compile.optlevel 1" in message
    assert error_of("pythia6.9b", "compile.optlevel=2") is None
    assert error_of("llama2-7b-trn2", f"compile.optlevel=2 {NXD_TRN2}") is None


@pytest.mark.parametrize(
    ("schedule", "refusal"),
    [("layout.pp_schedule=1f1b", None), ("layout.pp_schedule=gpipe", "layout.pp_schedule 'gpipe'"),
     ("layout.pp_schedule=interleaved_1f1b layout.pp_virtual_stages=2", "layout.pp_virtual_stages 2")],
)  # fmt: skip
def test_nxd_pipeline_restrictions_do_not_apply_to_torchneuron(schedule: str, refusal: str | None):
    assert error_of("llama2-70b-trn2", schedule) is None
    message = error_of("llama2-70b-trn2", f"{schedule} cluster.neuron_sdk=2.26")
    assert message is None if refusal is None else refusal in (message or "")


@pytest.mark.parametrize(("path", "ok"), [("neff-cache", False), ("'/fsx/a b'", False), ("/fsx/neff", True)])
def test_shared_cache_dir_is_absolute_and_plain(path: str, ok: bool):
    message = error_of("llama2-7b-trn2", f"compile.shared_cache_dir={path}")
    assert (message is None) is ok
    assert ok or "compile.shared_cache_dir" in (message or "")


@pytest.mark.parametrize("instance", ["trn2.48xlarge", "trn3.48xlarge"])
def test_torchneuron_env_table(instance: str):
    env = env_of("llama2-7b-trn2", f"cluster.instance={instance}", job_dir=Path("/fsx/jobs/j"))
    for name in ("NEURON_RT_VISIBLE_CORES", "NEURON_RT_ROOT_COMM_ID", "NEURON_COMPILE_CACHE_URL", "NEURON_FUSE_SOFTMAX",
                 "NEURON_RT_STOCHASTIC_ROUNDING_EN", "NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS"):  # fmt: skip
        assert name not in env
    assert not [n for n in env if n.startswith("XLA_")]
    assert env["TORCH_NEURONX_NEFF_CACHE_DIR"] == "/fsx/jobs/j/neff-cache"
    assert env["TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR"] == "/var/tmp/neuron-compile-cache-${JOB_USER}/llama2-7b-trn2-1n"
    assert env["NEURON_LOGICAL_NC_CONFIG"] == "2"
    assert (env["FI_PROVIDER"], env["FI_EFA_USE_DEVICE_RDMA"], env["FI_EFA_FORK_SAFE"]) == ("efa", "1", "1")
    assert "NEURON_CC_FLAGS" not in env  # 2.33: accumulation is the compiler's default, nothing else to add
    shared = env_of("llama2-7b-trn2", "compile.shared_cache_dir=/fsx/neff compile.cache_dir=/tmp/local")
    assert (shared["TORCH_NEURONX_NEFF_CACHE_DIR"], shared["TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR"]) == (
        "/fsx/neff",
        "/tmp/local",
    )


def test_torchneuron_compiler_flags():
    flags = env_of("llama2-7b-trn2", "compile.extra_flags=[--verbose=35]")["NEURON_CC_FLAGS"].split()
    assert flags == ["--verbose=35"]
    off = env_of("llama2-7b-trn2", "compile.mixed_precision_accumulation=false")["NEURON_CC_FLAGS"]
    assert off == "--disable-mixed-precision-accumulation"  # on by default from SDK 2.27


@pytest.mark.parametrize(("name", "overrides"), [("pythia6.9b", ""), ("llama2-7b-trn2", NXD_TRN2)])
def test_xla_nxd_env_table_unchanged(name: str, overrides: str):
    env = env_of(name, overrides)
    assert env["NEURON_COMPILE_CACHE_URL"].startswith("/var/tmp/neuron-compile-cache-${JOB_USER}/")
    assert env["NEURON_RT_STOCHASTIC_ROUNDING_EN"] == "1"
    assert env["NEURON_CC_FLAGS"].startswith("--model-type transformer")
    assert not [n for n in env if n.startswith("TORCH_NEURONX_")]


def code(text: str) -> str:
    """The script without its comments (full-line, and trailing `  # ...`)."""
    lines = (line.split("  # ")[0] for line in text.splitlines() if not line.lstrip().startswith("#"))
    return "\n".join(lines)


@pytest.mark.parametrize(("name", "nodes", "variant"), [("llama2-smoke-trn2", 1, ""), ("llama2-7b-trn2", 16, ""),
                                                         ("llama2-7b-trn2", 4, "trn3")])  # fmt: skip
def test_torchneuron_job_dir(name: str, nodes: int, variant: str):
    files = render_case(name, nodes, variant)
    compile_, run = code(files["compile.sbatch"]), code(files["run.sbatch"])
    assert "neuron_parallel_compile" not in compile_
    assert 'COMPILE=("${TRAIN[@]}" --compile)' in compile_
    assert launch_lines(compile_) == launch_lines(run)
    assert '--nproc-per-node="$WORKERS_PER_NODE"' in launch_lines(run)[0]
    assert "merge_dir_on_each_node" not in files["run.sbatch"]
    for script in ("compile.sbatch", "run.sbatch", "eval.sbatch"):
        text = code(files[script])
        assert not re.search(r"\bNEURON_RT_(VISIBLE_CORES|ROOT_COMM_ID)\b", text), script
        python = DLAMI if script != "eval.sbatch" else f"{FAKE_REPO}/.venv/bin/python"  # scoring runs on the host CPU
        assert f"\nPYTHON={python}\n" in text
        assert '\nPYTHON="${TRNRECIPES_PYTHON:-$PYTHON}"\n' in text
    assert "\nWORKERS_PER_NODE=64\n" in run


def test_cluster_python_overrides_the_dlami_and_trn1_runs_its_sdks_nxd_training_venv():
    recipe = load_recipe("llama2-smoke-trn2", nodes=1, overrides="cluster.python=/fsx/venv/bin/python")
    run = render_job(recipe, FAKE_REPO / "jobs" / "x", "cmd", FAKE_REPO).files["run.sbatch"]
    assert "\nPYTHON=/fsx/venv/bin/python\n" in run and DLAMI not in run
    assert '\nPYTHON="${TRNRECIPES_PYTHON:-$PYTHON}"\n' in run
    trn1 = render_case("pythia6.9b", 1)["run.sbatch"]  # Neuron SDK 2.26
    assert "\nPYTHON=/opt/aws_neuronx_venv_pytorch_2_8_nxd_training/bin/python\n" in trn1
    assert ".venv" not in trn1 and "merge_dir_on_each_node" in trn1
    old = render_job(load_recipe("pythia6.9b", nodes=1, overrides="cluster.neuron_sdk=2.21"), FAKE_REPO / "j", "c")
    assert "\nPYTHON=/opt/aws_neuronx_venv_pytorch_2_5_nxd_training/bin/python\n" in old.files["run.sbatch"]


@pytest.mark.parametrize("stack", [XLA_NXD, TORCHNEURON])
def test_every_sdk_of_a_neuron_stack_has_its_dlami_venv_and_package_versions(stack):
    (major, lo), (_, hi) = STACKS[stack].sdks
    for minor in range(lo, hi + 1):
        release = SDK_RELEASES[(major, minor)]
        assert release.venvs and all(v.startswith("/opt/aws_neuronx_venv_") for v in release.venvs)
        assert {"torch", "torch-neuronx", "neuronx-cc"} <= set(release.packages) and release.source
        assert ("neuronx-distributed" in release.packages) is (stack == XLA_NXD)


def test_rendering_does_not_import_torch():
    script = (
        "import sys\nfrom trnrecipes.config.recipe import load_recipe\nfrom trnrecipes.jobs.render import render_job\n"
        "job = render_job(load_recipe('llama2-7b-trn2', nodes=1), __import__('pathlib').Path('/tmp/j'), 'c')\n"
        "assert 'TORCH_NEURONX_NEFF_CACHE_DIR' in job.files['run.sbatch']\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_plan_on_trn3_without_a_catalog_price():
    trn3 = "cluster.instance=trn3.48xlarge"
    p = plan(load_recipe("llama2-7b-trn2", nodes=4, overrides=trn3), seq_per_s=10.0)
    assert INSTANCES["trn3.48xlarge"].price_per_hour is None
    assert p["price_per_hour"] is None and p["dollars_per_step"] is None and p["tokens_per_dollar"] is None
    text = format_plan(p)
    assert "no price known" in text and "$" not in text
    priced = plan(load_recipe("llama2-7b-trn2", nodes=4, overrides=f"{trn3} cluster.price_per_hour=50"), 10.0)
    assert priced["price_per_hour"] == 200.0
    assert priced["dollars_per_step"] == pytest.approx(200.0 * (1024 / 10.0) / 3600)
    assert "$200.00/h for the job" in format_plan(priced) and "no price known" not in format_plan(priced)


@pytest.mark.parametrize(
    ("name", "stack", "shown"),
    [("llama2-7b-trn2", "torchneuron", "(neuron: torchneuron)"), ("pythia6.9b", "xla-nxd", "(neuron: xla-nxd)"),
     ("pythia-tiny", "cpu", "(cpu)")],
)  # fmt: skip
def test_plan_names_the_stack(name: str, stack: str, shown: str):
    p = plan(load_recipe(name, nodes=1))
    assert p["stack"] == stack
    assert shown in format_plan(p).splitlines()[0]


@pytest.mark.parametrize(
    ("name", "overrides", "message"),
    [
        ("llama2-7b", "compile.shared_cache_dir=/fsx/neff", "compile.shared_cache_dir is TorchNeuron's NEFF cache"),
        ("llama2-7b", "cluster.workers_per_node=64", "trn1.32xlarge has 32 (logical) NeuronCores"),
        ("llama2-7b-trn2", "cluster.workers_per_node=128", "trn2.48xlarge has 64 (logical) NeuronCores"),
    ],
)
def test_settings_a_stack_cannot_use_are_refused(name, overrides, message):
    assert message in (error_of(name, overrides) or "")


def test_neuron_on_a_gpu_instance_gets_the_backend_error_only():
    text = error_of("llama2-7b", "cluster.instance=p5.48xlarge") or ""
    assert "cluster.backend 'neuron' does not run on p5.48xlarge; valid: cuda, xla" in text
    assert "neuron_sdk" not in text  # no SDK advice for an instance without NeuronCores


def test_no_neuron_job_dir_runs_the_checkouts_venv():
    """Every shipped Neuron recipe at every golden node count, and the golden job dirs themselves: the training scripts
    name the stack's DLAMI venv, never the checkout's .venv (PyPI's CPU torch: no torch-xla, no
    neuron_parallel_compile); eval.sbatch scores on the host CPU in the checkout's .venv, which has lm-eval."""
    from golden import CASES, GOLDEN_DIR, case_dir

    neuron = [c for c in CASES if load_recipe(c[0], nodes=c[1]).cluster.backend == "neuron"]
    assert len(neuron) >= 10
    for case in neuron:
        for name in ("compile.sbatch", "run.sbatch"):
            script = (GOLDEN_DIR / case_dir(*case) / name).read_text()
            python = re.search(r"^PYTHON=(.*)$", script, re.M)[1]
            assert python.startswith("/opt/aws_neuronx_venv_") and python.endswith("/bin/python"), (case, python)
        evaluation = (GOLDEN_DIR / case_dir(*case) / "eval.sbatch").read_text()
        assert re.search(r"^PYTHON=(.*)$", evaluation, re.M)[1] == "/opt/trnrecipes/.venv/bin/python", case
