"""`trnrecipes k8s`: the compile and training PyTorchJobs meet the training operator's CRD schema (vendored,
tests/k8s_schemas/), their pod templates and the eval Job Kubernetes' own schema (kubernetes-validate, strict); they
carry the recipe's resources, env table and restart limits, and equal their golden files; bad input writes nothing."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from golden import FAKE_REPO, GOLDEN_DIR, K8S_CASES, K8S_OVERRIDES, case_dir, render_k8s_case

from trnrecipes import REPO_ROOT
from trnrecipes.config.recipe import load_recipe
from trnrecipes.jobs.k8s import MANIFESTS, default_image, dra_claim_template, entrypoint_script
from trnrecipes.jobs.neuron_env import backend_env
from trnrecipes.plan.layout import compute_layout

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
# Kubernetes' own schema (kubernetes-validate, the dev extra) of 1.35: in Amazon EKS's standard support until 27 March
# 2027 (EKS release calendar, "Understand the Kubernetes version lifecycle on EKS"; 1.34's ends 2 December 2026), and
# at least 1.34, which the Neuron DRA driver needs. Strict: unknown fields refused, as above.
K8S_VERSION = "1.35"


def manifest(case, mode: str = "run") -> dict:
    return yaml.safe_load(render_k8s_case(*case)[MANIFESTS[mode]])


def kubernetes_objects(case) -> list[dict]:
    """What Kubernetes' own schema checks: the eval Job whole; each PyTorchJob pod template as a v1 PodTemplate (the
    CRD's schema checks the PyTorchJob around it)."""
    files = render_k8s_case(*case)
    jobs = {mode: yaml.safe_load(files[name]) for mode, name in MANIFESTS.items()}
    objects = [jobs["eval"]]
    for mode in ("compile", "run"):
        for kind, spec in jobs[mode]["spec"]["pytorchReplicaSpecs"].items():
            name = f"{mode}-{kind.lower()}"
            objects.append({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name},
                            "template": spec["template"]})  # fmt: skip
    return objects


def kubernetes_error(obj: dict) -> str | None:
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return f"{obj['kind']} {'.'.join(map(str, e.path))}: {e.message}"
    return None


@pytest.mark.parametrize("case", K8S_CASES, ids=IDS)
def test_k8s_files_equal_golden(case):
    name, nodes, _ = case
    for file_name, text in render_k8s_case(*case).items():
        golden = GOLDEN_DIR / case_dir(name, nodes) / "k8s" / file_name
        assert golden.exists() and text == golden.read_text(), f"{golden} differs; review, then `make golden`"


@pytest.mark.parametrize("case", K8S_CASES, ids=IDS)
def test_pytorchjobs_meet_the_crd_schema(case):
    for mode in ("compile", "run"):
        errors = [
            f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in VALIDATOR.iter_errors(manifest(case, mode))
        ]
        assert not errors, (mode, errors)


@pytest.mark.parametrize("case", K8S_CASES, ids=IDS)
def test_pods_and_the_eval_job_meet_kubernetes_own_schema(case):
    objects = kubernetes_objects(case)
    assert [o["kind"] for o in objects].count("PodTemplate") == 4  # compile and run: a Master and Workers each
    errors = [error for obj in objects if (error := kubernetes_error(obj))]
    assert not errors, errors


def test_kubernetes_schema_refuses_misspelt_fields():
    job, pod = kubernetes_objects(K8S_CASES[0])[:2]
    job["spec"]["template"]["spec"]["restartPolicyy"] = "Never"
    pod["template"]["spec"]["containers"][0]["volumeMount"] = []
    assert "'restartPolicyy' was unexpected" in kubernetes_error(job)
    assert "'volumeMount' was unexpected" in kubernetes_error(pod)


def test_the_dra_alternative_meets_kubernetes_schema():
    """The README's ResourceClaimTemplate, and a training pod changed as the README says, pass Kubernetes' schema."""
    recipe = load_recipe("llama2-7b-trn2", nodes=16, overrides=K8S_OVERRIDES)
    claim = dra_claim_template(recipe)
    assert kubernetes_error(claim) is None
    request = claim["spec"]["spec"]["devices"]["requests"][0]["exactly"]
    assert (
        request["deviceClassName"] == "neuron.aws.com"
        and "'trn2.48xlarge'" in request["selectors"][0]["cel"]["expression"]
    )
    pod = kubernetes_objects(K8S_CASES[2])[-1]
    resources = pod["template"]["spec"]["containers"][0]["resources"]
    for counts in (resources["requests"], resources["limits"]):
        del counts["aws.amazon.com/neuron"]
    resources["claims"] = [{"name": "neurons"}]
    pod["template"]["spec"]["resourceClaims"] = [
        {"name": "neurons", "resourceClaimTemplateName": claim["metadata"]["name"]}
    ]
    assert kubernetes_error(pod) is None


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
    compile_job = manifest(case, "compile")
    assert compile_job["metadata"]["name"] == job["metadata"]["name"] + "-compile"
    assert compile_job["spec"]["runPolicy"] == job["spec"]["runPolicy"]
    compile_specs = compile_job["spec"]["pytorchReplicaSpecs"].values()
    for mode, spec in [("run", s) for s in specs.values()] + [("compile", s) for s in compile_specs]:
        assert spec["restartPolicy"] == "ExitCode"
        pod = spec["template"]["spec"]
        (container,) = pod["containers"]
        assert container["name"] == "pytorch"  # the container whose exit code the operator reads
        assert container["command"] == ["bash", str(k8s_dir / "entrypoint.sh"), mode]
        want = {"aws.amazon.com/neuron": 16, "vpc.amazonaws.com/efa": efa}
        assert container["resources"] == {"requests": want, "limits": want}
        assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": recipe.cluster.instance}
        env = [(e["name"], e["value"]) for e in container["env"] if "value" in e]
        assert env == [("JOB_USER", "root"), *table]
        assert container["image"] == (recipe.k8s.image or default_image(recipe))
        # only training saves on SIGTERM: the compile pods keep Kubernetes' default grace period
        assert ("terminationGracePeriodSeconds" in pod) == (mode == "run")


@pytest.mark.parametrize(
    ("overrides", "requests", "limits", "deadline"),
    [
        ("", {"cpu": 32, "memory": "35Gi"}, {"memory": "35Gi"}, None),  # llama2-7b: 6.7B x 4 B + 8 GB, eval.sbatch's
        ("eval.cpus=8 eval.mem_gb=0 eval.time_limit=1-02:00:00", {"cpu": 8}, None, 93600),
        (
            "eval.gpus=2 eval.mem_gb=64",
            {"memory": "64Gi", "nvidia.com/gpu": 2},
            {"memory": "64Gi", "nvidia.com/gpu": 2},
            None,
        ),
    ],
)
def test_the_eval_job_asks_for_what_eval_sbatch_does(overrides, requests, limits, deadline):
    case = ("llama2-7b", 16, overrides)
    job = manifest(case, "eval")
    recipe = load_recipe("llama2-7b", nodes=16, overrides=f"{K8S_OVERRIDES} {overrides}")
    assert (job["apiVersion"], job["kind"], job["metadata"]["name"]) == ("batch/v1", "Job", "llama2-7b-16n-eval")
    assert job["spec"].get("activeDeadlineSeconds") == deadline
    assert job["spec"]["backoffLimit"] == recipe.slurm.max_restarts
    disrupted, failed = job["spec"]["podFailurePolicy"]["rules"]
    assert disrupted["action"] == "Ignore" and failed["action"] == "FailJob"
    assert failed["onExitCodes"] == {"containerName": "pytorch", "operator": "NotIn", "values": [129]}
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"][-1] == "eval" and pod["restartPolicy"] == "Never"
    assert container["resources"] == ({"requests": requests, "limits": limits} if limits else {"requests": requests})
    assert "nodeSelector" not in pod and all(v.get("hostPath") is None for v in pod["volumes"])
    assert (
        container["env"][-2]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['batch.kubernetes.io/job-name']"
    )


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
        # names the API server refuses, and text pasted into the kubectl commands printed
        ("k8s.pvc=fsx k8s.namespace='a; rm -rf ~'", 16, "k8s.namespace 'a; rm -rf ~' is not a Kubernetes name"),
        ("k8s.pvc=fsx k8s.namespace=Team_A", 16, "k8s.namespace 'Team_A' is not a Kubernetes name: a DNS label"),
        ("k8s.pvc=fsx k8s.service_account='a b'", 16, "k8s.service_account 'a b' is not a Kubernetes name"),
        ("k8s.pvc=Fsx", 16, "k8s.pvc 'Fsx' is not a Kubernetes name: a DNS subdomain name"),
        # a recreated pod would archive (force_fresh) or stop on the run's own checkpoints
        ("k8s.pvc=fsx checkpoint.resume=false checkpoint.force_fresh=true", 16, "checkpoint.resume false on EKS"),
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
        # 2.26's container is Python 3.11, its lock the DLAMI venv's 3.10: every pod stopped with 2, without a word
        assert "warning: AWS's Neuron training container for SDK 2.26 (2.8.0-neuronx-py311-" in done.stderr
        assert "runs Python 3.11, and the SDK's wheel lock is for its DLAMI venv's Python 3.10" in done.stderr
        written = {p.name for p in (out / "k8s").iterdir()}
        assert written == {*MANIFESTS.values(), "entrypoint.sh", "README.md", "recipe.yaml", "provenance.json", "logs"}
        job = yaml.safe_load((out / "k8s" / "pytorchjob.yaml").read_text())
        assert set(job["spec"]["pytorchReplicaSpecs"]) == {"Master"}  # one node: the Master alone
        assert not list(VALIDATOR.iter_errors(job))
        # the three jobs in order, each after the one before succeeded; the README gives the same commands
        steps = [line.strip() for line in done.stdout.splitlines() if line.startswith("  kubectl")]
        name = "llama2-smoke-trn1-1n"
        assert [s.split()[1] for s in steps] == ["apply", "wait"] * 3
        assert [s.split()[-1] for s in steps] == [
            str(out / "k8s" / "compile-pytorchjob.yaml"), f"pytorchjob/{name}-compile",
            str(out / "k8s" / "pytorchjob.yaml"), f"pytorchjob/{name}",
            str(out / "k8s" / "eval-job.yaml"), f"job/{name}-eval",
        ]  # fmt: skip
        readme = (out / "k8s" / "README.md").read_text()
        assert all(f"    {step}\n" in readme for step in steps)
    finally:
        shutil.rmtree(out, ignore_errors=True)


@pytest.mark.parametrize("argv", [[], ["train"]])
def test_the_entrypoint_refuses_a_missing_or_unknown_mode_in_one_line(tmp_path, argv):
    recipe = load_recipe("pythia-tiny", nodes=2, overrides="cluster.workers_per_node=1")
    script = tmp_path / "entrypoint.sh"
    script.write_text(entrypoint_script(recipe, compute_layout(recipe), tmp_path, "test", REPO_ROOT, tmp_path / "run"))
    done = subprocess.run(["bash", str(script), *argv], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert f"compile, run or eval (got '{''.join(argv)}')" in done.stderr and done.stderr.count("error:") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entrypoint.sh"]  # no logs, no run dir
