"""Render a recipe as a Kubeflow PyTorchJob (kubeflow.org/v1) for Amazon EKS: the manifest, the pods' entrypoint and
a README. The same env table, pre-flight and torchrun launch as run.sbatch; the pods' exit codes follow the training
operator's ExitCode restart policy. No torch import, no Kubernetes client: plain dicts written as YAML.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from trnrecipes import REPO_ROOT
from trnrecipes.config.preemption import signal_seconds
from trnrecipes.config.sections import Recipe, RecipeError
from trnrecipes.config.stacks import sdk_version
from trnrecipes.jobs.neuron_env import JOB_USER, backend_env, local_cache_dir
from trnrecipes.jobs.render import Job, _environment, objective, render_job
from trnrecipes.jobs.storage import run_dir_for
from trnrecipes.jobs.wheelhouse import job_wheels
from trnrecipes.plan.layout import Layout
from trnrecipes.schema import shown

# The training operator's (kubeflow/training-operator v1.9.0, pkg/apis/kubeflow.org/v1/pytorch_types.go): the
# container it reads exit codes from, and the Master's port it hands every pod as MASTER_PORT.
CONTAINER = "pytorch"
MASTER_PORT = 23456
CONTAINER_USER = "root"  # AWS's Neuron training containers run as root: JOB_USER in the node-local cache path
CONTAINER_PYTHON = "/usr/local/bin/python"  # the containers' Python (their Dockerfile.neuronx links it there)


@dataclass(frozen=True)
class PodResources:
    neuron_devices: int  # aws.amazon.com/neuron: whole Neuron devices (chips), all of the node's
    efa: int  # vpc.amazonaws.com/efa: the node's EFA interfaces
    source: str


# What one pod (one node) requests. The Neuron device plugin registers aws.amazon.com/neuron (devices) and
# aws.amazon.com/neuroncore (cores) (AWS Neuron docs, containers/tutorials/k8s-neuron-device-plugin); a training pod
# takes the whole node's devices.
POD_RESOURCES: dict[str, PodResources] = {
    "trn1.32xlarge": PodResources(
        16,
        8,
        "16 Trainium chips (Neuron docs, trn1-arch); 8 EFA: AWS's awsome-distributed-training neuronx-distributed"
        " llama3 kubernetes/llama3_train.yaml-template and aws-neuron-eks-samples (all x8 EFA interfaces)",
    ),
    "trn1n.32xlarge": PodResources(
        16, 16, "16 Trainium chips (trn1-arch); 16 EFA (AWS Batch trn1 sample: trn1n uses 16 EFA devices)"
    ),
    # UNVERIFIED here: 16 EFA on trn2.48xlarge (its 3.2 Tbps EFAv3 over 16 network cards, AWS's Trn2 page); check
    # `kubectl describe node` (Allocatable) on the cluster.
    "trn2.48xlarge": PodResources(16, 16, "16 Trainium2 chips (trn2-arch); 16 EFA (unverified, see above)"),
}

# AWS's Neuron training containers (public ECR), one per Neuron SDK minor release: the newest patch listed in
# aws-neuron/deep-learning-containers README.md (its history up to 2be9ed1, "Updating README.md for 2.32.0 release").
# None is published for TorchNeuron (SDK 2.33): k8s.image is required there.
DLC_REPO = "public.ecr.aws/neuron/pytorch-training-neuronx"
DLC_TAGS: dict[tuple[int, int], str] = {
    (2, 21): "2.5.1-neuronx-py310-sdk2.21.1-ubuntu22.04",
    (2, 22): "2.5.1-neuronx-py310-sdk2.22.0-ubuntu22.04",
    (2, 23): "2.6.0-neuronx-py310-sdk2.23.0-ubuntu22.04",
    (2, 24): "2.7.0-neuronx-py310-sdk2.24.1-ubuntu22.04",
    (2, 25): "2.7.0-neuronx-py310-sdk2.25.0-ubuntu22.04",
    (2, 26): "2.8.0-neuronx-py311-sdk2.26.1-ubuntu22.04",
    (2, 27): "2.9.0-neuronx-py312-sdk2.27.1-ubuntu24.04",
    (2, 28): "2.9.0-neuronx-py312-sdk2.28.0-ubuntu24.04",
}


def default_image(r: Recipe) -> str | None:
    tag = DLC_TAGS.get(sdk_version(r.cluster.neuron_sdk))
    return f"{DLC_REPO}:{tag}" if tag else None


def k8s_dir(job_dir: Path) -> Path:
    return Path(job_dir) / "k8s"


def _image(r: Recipe) -> str:
    image = r.k8s.image or default_image(r)
    if not image:
        raise RecipeError(
            f"k8s.image is not set and AWS publishes no Neuron training container for cluster.neuron_sdk"
            f" {r.cluster.neuron_sdk} (known: {', '.join('.'.join(map(str, v)) for v in DLC_TAGS)}); set k8s.image"
            " to an image with this SDK's packages"
        )
    return image


def _check(r: Recipe, repo_root: Path, job_dir: Path, run_dir: Path) -> PodResources:
    resources = POD_RESOURCES.get(r.cluster.instance)
    if r.cluster.backend != "neuron" or resources is None:
        raise RecipeError(
            f"trnrecipes k8s renders Neuron training on {', '.join(POD_RESOURCES)}; cluster.instance is"
            f" {shown(r.cluster.instance)} with backend {r.cluster.backend}"
        )
    if not r.k8s.pvc:
        raise RecipeError(
            "k8s.pvc is not set: name the PersistentVolumeClaim (FSx for Lustre) that holds this checkout, e.g."
            " --overrides k8s.pvc=fsx-claim"
        )
    for path, what in ((repo_root, "the checkout"), (job_dir, "the job dir"), (run_dir, "the run dir")):
        if not Path(path).is_relative_to(r.k8s.mount):
            raise RecipeError(
                f"{what} {path} is not under k8s.mount {shown(r.k8s.mount)}, where the pods mount k8s.pvc; set"
                " k8s.mount to the file system's mount point here (e.g. /fsx), with the checkout and run dir on it"
            )
    return resources


def _env(r: Recipe, job_dir: Path) -> list[dict[str, str]]:
    """backend_env's rows as container env; ${JOB_USER} becomes Kubernetes' $(JOB_USER), defined first."""
    rows = [{"name": "JOB_USER", "value": CONTAINER_USER}]
    for name, value, _why in backend_env(r, job_dir):
        rows.append({"name": name, "value": value.replace(JOB_USER, "$(JOB_USER)")})
    return rows


def _pod_template(r: Recipe, resources: PodResources, image: str, job_dir: Path, master: bool) -> dict:
    cache = local_cache_dir(r).replace(JOB_USER, CONTAINER_USER)
    counts = {"aws.amazon.com/neuron": resources.neuron_devices, "vpc.amazonaws.com/efa": resources.efa}
    container = {
        "name": CONTAINER,
        "image": image,
        "command": ["bash", str(job_dir / "entrypoint.sh")],
        "env": [
            *_env(r, job_dir),
            {"name": "TRNRECIPES_JOB_NAME", "valueFrom": {"fieldRef": {"fieldPath": _label("job-name")}}},
            {"name": "TRNRECIPES_POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        ],
        "resources": {"requests": dict(counts), "limits": dict(counts)},
        "volumeMounts": [
            {"name": "shared", "mountPath": r.k8s.mount},
            {"name": "compile-cache", "mountPath": cache},
            {"name": "shm", "mountPath": "/dev/shm"},
        ],
    }
    if master:
        container["ports"] = [{"name": "pytorchjob-port", "containerPort": MASTER_PORT}]
    spec = {
        # The pre-timeout save's lead (slurm.signal_seconds or derived from the checkpoint size), after SIGTERM.
        "terminationGracePeriodSeconds": signal_seconds(r),
        "nodeSelector": {"node.kubernetes.io/instance-type": r.cluster.instance},
        "containers": [container],
        "volumes": [
            {"name": "shared", "persistentVolumeClaim": {"claimName": r.k8s.pvc}},
            {"name": "compile-cache", "hostPath": {"path": cache, "type": "DirectoryOrCreate"}},
            {"name": "shm", "emptyDir": {"medium": "Memory"}},
        ],
    }
    if r.k8s.service_account:
        spec["serviceAccountName"] = r.k8s.service_account
    return {"metadata": {"labels": {"trnrecipes/job": r.job_name}}, "spec": spec}


def job_name(r: Recipe) -> str:
    """The PyTorchJob's name: the job name as a DNS label (pods and services are named <name>-worker-<i>)."""
    name = r.job_name.lower().replace(".", "-").replace("_", "-")
    if not re.fullmatch(r"[a-z]([-a-z0-9]{0,40}[a-z0-9])?", name):
        raise RecipeError(
            f"slurm.job_name {shown(r.job_name)} does not make a Kubernetes name: letters, digits and - only,"
            " starting with a letter, at most 42 characters (pods are named <name>-worker-<i>)"
        )
    return name


def _label(name: str) -> str:
    return f"metadata.labels['training.kubeflow.org/{name}']"


def pytorchjob(r: Recipe, layout: Layout, repo_root: Path, job_dir: Path, run_dir: Path) -> dict:
    """The PyTorchJob: a Master (node rank 0, hosting torchrun's static store) and N-1 Workers, one pod per node.
    The operator sets MASTER_ADDR/MASTER_PORT, RANK and PET_NODE_RANK only where a Master replica exists
    (pkg/controller.v1/pytorch/envvar.go, v1.9.0); a Worker-only job gets them only from an elasticPolicy."""
    resources = _check(r, repo_root, job_dir, run_dir)
    image = _image(r)
    replicas = {"Master": 1, "Worker": layout.nodes - 1}
    specs = {
        kind: {
            "replicas": count,
            "restartPolicy": "ExitCode",
            "template": _pod_template(r, resources, image, job_dir, master=kind == "Master"),
        }
        for kind, count in replicas.items()
        if count
    }
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": job_name(r), "namespace": r.k8s.namespace},
        "spec": {
            "nprocPerNode": str(layout.workers_per_node),
            "runPolicy": {"backoffLimit": r.slurm.max_restarts, "cleanPodPolicy": "None"},
            "pytorchReplicaSpecs": specs,
        },
    }


def render_k8s(recipe: Recipe, job_dir: Path, command: str, repo_root: Path = REPO_ROOT, **render_args) -> Job:
    """The k8s dir of a job dir (job_dir/k8s): pytorchjob.yaml, entrypoint.sh, README.md and the resolved recipe.yaml
    the pods train from. The layout and memory checks are render_job's."""
    if objective(recipe) != "causal_lm":
        raise RecipeError(f"trnrecipes k8s renders causal-LM training; {recipe.name} is {objective(recipe)}")
    out = Path(os.path.abspath(k8s_dir(job_dir)))
    job = render_job(recipe, out, command, repo_root, **render_args)
    run_dir = run_dir_for(recipe, repo_root, render_args.get("runs_root"))
    manifest = pytorchjob(recipe, job.layout, repo_root, out, run_dir)
    env = _environment()
    context = {"r": recipe, "layout": job.layout, "command": command, "job_dir": out, "repo_root": repo_root,
               "run_dir": run_dir, "manifest": manifest}  # fmt: skip
    files = {
        "pytorchjob.yaml": f"# {_comment_line(command)}\n" + yaml.safe_dump(manifest, sort_keys=False),
        "entrypoint.sh": entrypoint_script(recipe, job.layout, out, command, repo_root, run_dir),
        "README.md": env.get_template("k8s_README.md.j2").render(context),
        "recipe.yaml": job.files["recipe.yaml"],
    }
    return Job(recipe, job.layout, out, files)


def entrypoint_script(r: Recipe, layout: Layout, job_dir: Path, command: str, repo_root: Path, run_dir: Path) -> str:
    """The pods' entrypoint.sh. Any recipe renders (the tests run it with the cpu backend); the manifest is Neuron's."""
    context = {
        "r": r,
        "layout": layout,
        "command": command,
        "job_dir": job_dir,
        "repo_root": repo_root,
        "run_dir": run_dir,
        "python": r.cluster.python or CONTAINER_PYTHON,
        "wheels": job_wheels(r, repo_root),
        "megatron": any(c.format == "megatron" for c in r.data.corpora()),
        "signal_seconds": signal_seconds(r),
    }
    return _environment().get_template("k8s_entrypoint.sh.j2").render(context)


def _comment_line(command: str) -> str:
    return "Made by trnrecipes; re-create with: " + command.replace("\n", " ")
