"""The SDK-versioned table of Neuron env vars and flags, and that both scripts export exactly it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from trnrecipes.config.recipe import load_recipe
from trnrecipes.jobs.neuron_env import backend_env, neuron_cc_flags
from trnrecipes.jobs.render import render_job


def env_of(recipe: str, overrides: str = "", job_dir: Path | None = None) -> dict[str, str]:
    """name -> value of the env block of a 1-node job dir (default: jobs/<job name>)."""
    return {name: value for name, value, _ in backend_env(load_recipe(recipe, nodes=1, overrides=overrides), job_dir)}


def test_compiler_flags_for_llm_training():
    overrides = "compile.optlevel=1 compile.mixed_precision_accumulation=true compile.extra_flags=[--verbose=35]"
    flags = neuron_cc_flags(load_recipe("llama2-7b", overrides=overrides))
    assert flags == (  # llama2-7b: bf16, SDK 2.26 (no --distribution-strategy from 2.22, as NxD's scripts)
        "--model-type transformer --optlevel=1 --enable-mixed-precision-accumulation --verbose=35"
    )
    flags = neuron_cc_flags(load_recipe("llama2-7b"))  # as AWS's Llama scripts: -O2, no accumulation flag
    assert flags == "--model-type transformer --optlevel=2"


@pytest.mark.parametrize(
    ("sdk", "on", "flag"),
    [("2.26", True, "--enable-mixed-precision-accumulation"), ("2.26", False, None), ("2.27", True, None),
     ("2.27", False, "--disable-mixed-precision-accumulation"),
     ("2.28", False, "--disable-mixed-precision-accumulation")],
)  # fmt: skip
def test_mixed_precision_accumulation_is_said_as_each_compiler_takes_it(sdk, on, flag):
    """neuronx-cc accumulates in mixed precision only when asked before SDK 2.27, and unless told not to from it."""
    recipe = load_recipe("pythia6.9b", overrides=f"cluster.neuron_sdk={sdk} compile.mixed_precision_accumulation={on}")
    got = [f for f in neuron_cc_flags(recipe).split() if "mixed-precision-accumulation" in f]
    assert got == ([flag] if flag else [])


@pytest.mark.parametrize(
    ("recipe", "instance", "saturate"),
    [("neox20b", "trn1.32xlarge", True), ("pythia6.9b", "trn1n.32xlarge", True), ("llama2-7b", "trn1.32xlarge", False),
     ("neox20b", "trn2.48xlarge", False)],
)  # fmt: skip
def test_saturate_infinity_for_neox_on_trn1_as_aws_neox_scripts(recipe, instance, saturate):
    flags = neuron_cc_flags(load_recipe(recipe, overrides=f"cluster.instance={instance}")).split()
    assert ("--enable-saturate-infinity" in flags) is saturate


@pytest.mark.parametrize(
    ("instance", "lnc"), [("trn1.32xlarge", None), ("trn1n.32xlarge", None), ("trn2.48xlarge", "2")]
)
def test_logical_neuroncore_size_is_set_on_trn2_only(instance, lnc):
    # NxD's TP-group layout depends on it (trnrecipes.parallel.nxd.initialize passes it on); trn1 has no LNC setting.
    assert env_of("llama2-7b", f"cluster.instance={instance}").get("NEURON_LOGICAL_NC_CONFIG") == lnc


@pytest.mark.parametrize("sdk", ["2.21", "2.28"])
def test_async_inflight_requests_on_every_supported_sdk(sdk):
    # pythia6.9b: no pipeline, which NxD runs from SDK 2.22 only (neox20b at 2.21 is refused)
    assert env_of("pythia6.9b", f"cluster.neuron_sdk={sdk}")["NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS"] == "3"


@pytest.mark.parametrize("sdk", ["2.21", "2.24", "2.26", "2.28"])
@pytest.mark.parametrize("dtype", ["bf16", "bf16-mixed", "fp32"])
def test_no_xla_bf16_variables_on_any_sdk(sdk, dtype):
    """The trainer casts (bf16) or autocasts (bf16-mixed) itself; XLA_USE_BF16 / XLA_DOWNCAST_BF16 on top would
    also store its fp32 optimizer state in bf16."""
    sr = "true" if dtype == "bf16" else "false"
    recipe = load_recipe(
        "pythia6.9b", overrides=f"cluster.neuron_sdk={sdk} precision.dtype={dtype} precision.stochastic_rounding={sr}"
    )
    assert not [n for n, _, _ in backend_env(recipe) if n in ("XLA_USE_BF16", "XLA_DOWNCAST_BF16")]


def test_stochastic_rounding_follows_the_recipe():
    assert env_of("llama2-7b")["NEURON_RT_STOCHASTIC_ROUNDING_EN"] == "1"
    off = "precision.stochastic_rounding=false"
    assert env_of("llama2-7b", off)["NEURON_RT_STOCHASTIC_ROUNDING_EN"] == "0"


def test_compile_cache_is_node_local_and_efa_is_on():
    env = env_of("pythia6.9b")
    assert env["NEURON_COMPILE_CACHE_URL"] == "/var/tmp/neuron-compile-cache-${JOB_USER}/pythia6.9b-1n"
    assert (env["FI_PROVIDER"], env["FI_EFA_USE_DEVICE_RDMA"], env["FI_EFA_FORK_SAFE"]) == ("efa", "1", "1")
    assert (env["NEURON_FUSE_SOFTMAX"], env["MALLOC_ARENA_MAX"]) == ("1", "64")


def test_no_neuron_variables_off_neuron():
    assert env_of("neox-tiny") == {}


def _exports(script: str) -> list[str]:
    return re.findall(r"^export (?:NEURON|XLA|FI|MALLOC)_[A-Z_]*=.*$", script, flags=re.M)


@pytest.mark.parametrize("name", ["neox20b", "pythia6.9b", "llama2-7b", "neox-tiny"])
def test_compile_and_run_scripts_export_the_same_environment(name):
    job = render_job(load_recipe(name, nodes=1), Path("/opt/x/jobs/j"), "cmd", Path("/opt/x"))
    run_env, compile_env = _exports(job.files["run.sbatch"]), _exports(job.files["compile.sbatch"])
    assert run_env == compile_env
    assert len([e for e in run_env if e.startswith("export NEURON_")]) == (6 if name != "neox-tiny" else 0)


def test_awss_pipeline_zero1_and_bf16_settings_follow_the_layout():
    """NxD's 70B TP+PP script: 7 in-flight requests with pipeline stages, functionalization kept with ZeRO-1; NxD's
    trainer (0.12 on): 65 MB ZeRO-1 buckets with fp32 master weights under autocast, else 130. Each only where its
    condition holds."""
    seventy = env_of("llama2-70b")  # TP8 PP16, ZeRO-1, bf16
    assert seventy["NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS"] == "7"
    assert seventy["XLA_DISABLE_FUNCTIONALIZATION"] == "0"
    assert seventy["ALL_GATHER_REDUCE_SCATTER_BUCKET_CAP_MB"] == "130"  # pure bf16: no fp32 master
    seven = env_of("llama2-7b")  # TP8 PP1, ZeRO-1, bf16
    assert seven["NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS"] == "3" and seven["XLA_DISABLE_FUNCTIONALIZATION"] == "0"
    mixed = env_of("llama2-7b", "precision.dtype=bf16-mixed precision.stochastic_rounding=false")
    assert mixed["ALL_GATHER_REDUCE_SCATTER_BUCKET_CAP_MB"] == "65"  # fp32 masters under autocast
    old = env_of("llama2-7b", "precision.dtype=bf16-mixed precision.stochastic_rounding=false cluster.neuron_sdk=2.22")
    assert old["ALL_GATHER_REDUCE_SCATTER_BUCKET_CAP_MB"] == "130"  # NxD 0.11: always 130
    no_zero1 = env_of("llama2-7b", "layout.zero1=false")
    assert "XLA_DISABLE_FUNCTIONALIZATION" not in no_zero1 and "ALL_GATHER_REDUCE_SCATTER_BUCKET_CAP_MB" not in no_zero1
    native = env_of("llama2-7b-trn2", "cluster.neuron_sdk=2.33")  # TorchNeuron reads none of torch-xla's
    assert not {"XLA_DISABLE_FUNCTIONALIZATION", "ALL_GATHER_REDUCE_SCATTER_BUCKET_CAP_MB"} & set(native)


def test_every_awss_value_cites_its_source():
    rows = backend_env(load_recipe("llama2-70b"))
    for name in ("NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS", "XLA_DISABLE_FUNCTIONALIZATION",
                 "ALL_GATHER_REDUCE_SCATTER_BUCKET_CAP_MB", "MALLOC_ARENA_MAX", "NEURON_CC_FLAGS"):  # fmt: skip
        (why,) = [w for n, _, w in rows if n == name]
        assert "(AWS: " in why and re.search(r"neuronx-(distributed|nemo-megatron)", why), (name, why)


def test_the_run_job_caps_lustres_dirty_cache_only_where_lustre_and_lctl_are():
    job = render_job(load_recipe("llama2-7b", nodes=16), Path("/opt/trnrecipes/jobs/x"), "cmd", Path("/opt/trnrecipes"))
    run = job.files["run.sbatch"]
    guard = 'if command -v lctl >/dev/null 2>&1 && grep -qs " lustre " /proc/mounts; then'
    assert guard in run and "lctl set_param 'osc.*.max_dirty_mb=64'" in run
    assert "sudo -n lctl" in run  # never a password prompt in a batch job
    assert "max_dirty_mb" not in job.files["compile.sbatch"] and "max_dirty_mb" not in job.files["eval.sbatch"]
    cpu = render_job(load_recipe("llama2-tiny"), Path("/opt/trnrecipes/jobs/y"), "cmd", Path("/opt/trnrecipes"))
    assert "max_dirty_mb" not in cpu.files["run.sbatch"]
