"""`trnrecipes k8s`: the PyTorchJob for EKS meets the training operator's CRD schema (vendored, tests/k8s_schemas/),
carries the recipe's resources, env table and restart limit, and equals its golden files; bad input writes nothing."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml
from golden import FAKE_REPO, GOLDEN_DIR, K8S_CASES, K8S_OVERRIDES, case_dir, render_k8s_case

from trnrecipes import REPO_ROOT
from trnrecipes.config.recipe import load_recipe
from trnrecipes.jobs.k8s import default_image
from trnrecipes.jobs.neuron_env import backend_env

SCHEMA = json.loads((Path(__file__).parent / "k8s_schemas" / "pytorchjob-v1.9.0.json").read_text())
IDS = [f"{n}-{k}n" for n, k, _ in K8S_CASES]


def closed(schema):
    """The schema with unknown fields refused: the API server prunes them silently (a misspelt field would vanish)."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) for k, v in schema.items()}
    open_ended = "additionalProperties" in out or out.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in out and not open_ended:
        out["additionalProperties"] = False
    return out


VALIDATOR = jsonschema.Draft7Validator(closed(SCHEMA))


def manifest(case) -> dict:
    return yaml.safe_load(render_k8s_case(*case)["pytorchjob.yaml"])


@pytest.mark.parametrize("case", K8S_CASES, ids=IDS)
def test_k8s_files_equal_golden(case):
    name, nodes, _ = case
    for file_name, text in render_k8s_case(*case).items():
        golden = GOLDEN_DIR / case_dir(name, nodes) / "k8s" / file_name
        assert golden.exists() and text == golden.read_text(), f"{golden} differs; review, then `make golden`"


@pytest.mark.parametrize("case", K8S_CASES, ids=IDS)
def test_manifest_meets_the_crd_schema(case):
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in VALIDATOR.iter_errors(manifest(case))]
    assert not errors, errors


def test_the_schema_check_catches_a_misspelt_field_and_a_wrong_type():
    job = manifest(K8S_CASES[0])
    job["spec"]["runPolicy"]["backofLimit"] = 3
    job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "x"
    assert len(list(VALIDATOR.iter_errors(job))) == 2


@pytest.mark.parametrize("case", K8S_CASES, ids=IDS)
def test_pods_carry_the_recipe(case):
    name, nodes, extra = case
    recipe = load_recipe(name, nodes=nodes, overrides=f"{K8S_OVERRIDES} {extra}")
    job = manifest(case)
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert {k: v["replicas"] for k, v in specs.items()} == {"Master": 1, "Worker": nodes - 1}
    assert job["spec"]["nprocPerNode"] == str(recipe.workers_per_node)
    assert job["spec"]["runPolicy"]["backoffLimit"] == recipe.slurm.max_restarts
    efa = {"trn1.32xlarge": 8, "trn2.48xlarge": 16}[recipe.cluster.instance]
    k8s_dir = FAKE_REPO / "jobs" / case_dir(name, nodes) / "k8s"
    table = [(n, v.replace("${JOB_USER}", "$(JOB_USER)")) for n, v, _ in backend_env(recipe, k8s_dir)]
    for spec in specs.values():
        assert spec["restartPolicy"] == "ExitCode"
        pod = spec["template"]["spec"]
        (container,) = pod["containers"]
        assert container["name"] == "pytorch"  # the container whose exit code the operator reads
        want = {"aws.amazon.com/neuron": 16, "vpc.amazonaws.com/efa": efa}
        assert container["resources"] == {"requests": want, "limits": want}
        assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": recipe.cluster.instance}
        env = [(e["name"], e["value"]) for e in container["env"] if "value" in e]
        assert env == [("JOB_USER", "root"), *table]
        assert container["image"] == (recipe.k8s.image or default_image(recipe))


def test_default_image_follows_the_sdk():
    tag = "2.8.0-neuronx-py311-sdk2.26.1-ubuntu22.04"  # aws-neuron/deep-learning-containers README
    assert default_image(load_recipe("llama2-7b", nodes=1)) == f"public.ecr.aws/neuron/pytorch-training-neuronx:{tag}"
    assert default_image(load_recipe("llama2-7b-trn2", nodes=1)) is None  # TorchNeuron 2.33: none published


def test_entrypoint_passes_shellcheck():
    shellcheck = shutil.which("shellcheck")
    assert shellcheck, "shellcheck is missing: `make setup` installs Debian's package"
    scripts = sorted(str(p) for p in GOLDEN_DIR.glob("*/k8s/entrypoint.sh"))
    assert len(scripts) == len(K8S_CASES)
    done = subprocess.run([shellcheck, "--severity=info", *scripts], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


@pytest.mark.parametrize(
    ("overrides", "nodes", "says"),
    [
        ("", 16, "k8s.pvc is not set"),
        ("k8s.pvc=fsx k8s.mount=/fsx", 16, "not under k8s.mount '/fsx'"),
        (
            "k8s.pvc=fsx cluster.neuron_sdk=2.33 cluster.instance=trn2.48xlarge compile.optlevel=1",
            16,
            "k8s.image is not",
        ),
        ("k8s.pvc=fsx cluster.instance=p5.48xlarge cluster.backend=cuda", 16, "renders Neuron training on"),
        ("k8s.pvc=fsx", 3, "valid node counts"),
        ("k8s.pvc=fsx k8s.colour=blue", 16, "k8s.colour: unknown key"),
    ],
)
def test_bad_input_is_one_error_and_writes_nothing(tmp_path, overrides, nodes, says):
    out = REPO_ROOT / "jobs" / f".k8s-test-{tmp_path.name}"
    argv = ["k8s", "--recipe", "llama2-7b", "--nodes", str(nodes), "--out", str(out), "--no-data-check"]
    done = subprocess.run(
        [sys.executable, "-m", "trnrecipes", *argv, "--overrides", f"k8s.mount={REPO_ROOT} {overrides}"],
        capture_output=True, text=True, cwd=REPO_ROOT,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert says in done.stderr and done.stderr.count("error:") == 1, done.stderr
    assert not out.exists()


def test_cli_writes_the_k8s_dir_of_a_job_dir(tmp_path):
    out = REPO_ROOT / "jobs" / f".k8s-test-{tmp_path.name}"
    argv = ["k8s", "--recipe", "llama2-smoke-trn1", "--nodes", "1", "--out", str(out), "--no-data-check"]
    overrides = f"k8s.mount={REPO_ROOT} k8s.pvc=fsx"
    try:
        done = subprocess.run([sys.executable, "-m", "trnrecipes", *argv, "--overrides", overrides],
                              capture_output=True, text=True, cwd=REPO_ROOT)  # fmt: skip
        assert done.returncode == 0, done.stderr
        written = {p.name for p in (out / "k8s").iterdir()}
        assert written == {"pytorchjob.yaml", "entrypoint.sh", "README.md", "recipe.yaml", "provenance.json", "logs"}
        job = yaml.safe_load((out / "k8s" / "pytorchjob.yaml").read_text())
        assert set(job["spec"]["pytorchReplicaSpecs"]) == {"Master"}  # one node: the Master alone
        assert not list(VALIDATOR.iter_errors(job))
        assert "kubectl apply -f" in (out / "k8s" / "README.md").read_text()
    finally:
        shutil.rmtree(out, ignore_errors=True)
