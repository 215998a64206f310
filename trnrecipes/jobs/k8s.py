"""Render a recipe as Kubernetes jobs for Amazon EKS, the Slurm chain's three steps: a compile PyTorchJob, the
training PyTorchJob (kubeflow.org/v1) and an eval Job (batch/v1), one entrypoint for all pods (its mode argument),
and a README. The same env table, pre-flight and launches as the sbatch scripts; exit codes follow the training
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
from trnrecipes.config.recipe import time_limit_seconds
from trnrecipes.config.sections import Recipe, RecipeError
from trnrecipes.config.stacks import default_python, sdk_version
from trnrecipes.jobs.neuron_env import JOB_USER, backend_env, local_cache_dir
from trnrecipes.jobs.render import Job, _environment, cache_leader_nodes, objective, render_job
from trnrecipes.jobs.storage import run_dir_for
from trnrecipes.jobs.wheelhouse import job_wheels
from trnrecipes.plan.eval_cost import CPU_CORES as EVAL_CPU_CORES
from trnrecipes.plan.eval_cost import eval_estimate, eval_mem_gb
from trnrecipes.plan.layout import Layout
from trnrecipes.schema import shell_word, shown

# The training operator's (kubeflow/training-operator v1.9.0, pkg/apis/kubeflow.org/v1/pytorch_types.go): the
# container it reads exit codes from, and the Master's port it hands every pod as MASTER_PORT.
CONTAINER = "pytorch"
MASTER_PORT = 23456
CONTAINER_USER = "root"  # AWS's Neuron training containers run as root: JOB_USER in the node-local cache path
CONTAINER_PYTHON = "/usr/local/bin/python"  # the containers' Python (their Dockerfile.neuronx links it there)
RETRYABLE_EXIT = 129  # the entrypoint's exit for a node's or transient fault (the exit-code contract's 1)
# The three jobs of a k8s dir, in the order they run; each pod runs `entrypoint.sh <mode>`.
MANIFESTS = {"compile": "compile-pytorchjob.yaml", "run": "pytorchjob.yaml", "eval": "eval-job.yaml"}
# The label each kind of job puts on its pods with the job's name (training operator v1.9.0 constants.go
# JobNameLabel; Kubernetes' batch.kubernetes.io/job-name, set by the Job controller since 1.27).
JOB_NAME_LABEL = {"PyTorchJob": "training.kubeflow.org/job-name", "Job": "batch.kubernetes.io/job-name"}
# The NVIDIA device plugin's resource, for an eval on GPUs (eval.gpus; NVIDIA k8s-device-plugin README).
GPU_RESOURCE = "nvidia.com/gpu"
# The Neuron DRA driver's DeviceClass (Amazon EKS user guide, "Manage Neuron devices on Amazon EKS": the driver
# advertises Neuron devices as ResourceSlices of DeviceClass neuron.aws.com; Kubernetes 1.34 or later).
NEURON_DEVICE_CLASS = "neuron.aws.com"


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


def image_wheels_problem(r: Recipe, repo_root: Path = REPO_ROOT) -> str | None:
    """Why the pods could not be made ready from the checkout's wheelhouse, as wheels_problem says for the nodes; and
    where the image is AWS's container, whose Python (its tag's pyNNN) is not the one the wheel lock is for (2.26's
    container is Python 3.11, its DLAMI venv's 3.10): a pod lacking trnrecipes' packages stops with 2 on every pod."""
    from trnrecipes.jobs.wheelhouse import lock_header, lock_path, wheels_problem

    if r.cluster.python or (r.k8s.image and r.k8s.image != default_image(r)):
        return wheels_problem(r, repo_root)  # an interpreter or image of the user's: the nodes' rule
    tag = DLC_TAGS.get(sdk_version(r.cluster.neuron_sdk), "")
    lock = lock_path(r.cluster.neuron_sdk, repo_root)
    found = re.search(r"-py3(\d+)-", tag)
    locked = lock_header(lock, "python") if lock.is_file() else None
    if found and locked and f"3.{found[1]}" != locked:
        return (
            f"AWS's Neuron training container for SDK {r.cluster.neuron_sdk} ({tag}) runs Python 3.{found[1]}, and"
            f" the SDK's wheel lock is for its DLAMI venv's Python {locked}: a pod whose image lacks trnrecipes'"
            " packages cannot be made ready from the wheelhouse and stops with 2. Set k8s.image to an image with"
            " requirements/neuron.txt installed (docs/jobs.md, Amazon EKS)"
        )
    return wheels_problem(r, repo_root)


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


# Kubernetes' object names (its API conventions, "Object Names and IDs"): a namespace is a DNS-1123 label; a
# PersistentVolumeClaim or ServiceAccount a DNS-1123 subdomain name.
DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS_SUBDOMAIN = rf"{DNS_LABEL}(\.{DNS_LABEL})*"


def _check(r: Recipe, repo_root: Path, job_dir: Path, run_dir: Path) -> None:
    if r.cluster.backend != "neuron" or r.cluster.instance not in POD_RESOURCES:
        raise RecipeError(
            f"trnrecipes k8s renders Neuron training on {', '.join(POD_RESOURCES)}; cluster.instance is"
            f" {shown(r.cluster.instance)} with backend {r.cluster.backend}"
        )
    if not r.k8s.pvc:
        raise RecipeError(
            "k8s.pvc is not set: name the PersistentVolumeClaim (FSx for Lustre) that holds this checkout, e.g."
            " --overrides k8s.pvc=fsx-claim"
        )
    names = (("k8s.namespace", r.k8s.namespace, DNS_LABEL, 63, "a DNS label"),
             ("k8s.pvc", r.k8s.pvc, DNS_SUBDOMAIN, 253, "a DNS subdomain name"),
             ("k8s.service_account", r.k8s.service_account, DNS_SUBDOMAIN, 253, "a DNS subdomain name"))  # fmt: skip
    for key, name, rule, most, words in names:  # the API server refuses others, and they are pasted into commands
        if name is not None and (len(name) > most or not re.fullmatch(rule, name)):
            raise RecipeError(
                f"{key} {shown(name)} is not a Kubernetes name: {words} (lowercase letters, digits and '-'"
                f"{', dots between' if rule == DNS_SUBDOMAIN else ''}; starting and ending with a letter or digit, at"
                f" most {most} characters), e.g. ml-team"
            )
    if not r.checkpoint.resume:  # the operator recreates a failed pod: nothing tells the new one it is a restart
        raise RecipeError(
            "checkpoint.resume false on EKS: a pod the operator recreates would stop on (or, with force_fresh,"
            " archive) the run's own checkpoints; to start over, point run_dir at a new directory (or move the old"
            " one aside) and keep checkpoint.resume true"
        )
    for path, what in ((repo_root, "the checkout"), (job_dir, "the job dir"), (run_dir, "the run dir")):
        if not Path(path).is_relative_to(r.k8s.mount):
            raise RecipeError(
                f"{what} {path} is not under k8s.mount {shown(r.k8s.mount)}, where the pods mount k8s.pvc; set"
                " k8s.mount to the file system's mount point here (e.g. /fsx), with the checkout and run dir on it"
            )


def _env(r: Recipe, job_dir: Path) -> list[dict[str, str]]:
    """backend_env's rows as container env; ${JOB_USER} becomes Kubernetes' $(JOB_USER), defined first."""
    rows = [{"name": "JOB_USER", "value": CONTAINER_USER}]
    for name, value, _why in backend_env(r, job_dir):
        rows.append({"name": name, "value": value.replace(JOB_USER, "$(JOB_USER)")})
    return rows


def _training_resources(r: Recipe) -> dict:
    """A whole node of the instance: its Neuron devices and EFA interfaces (the device plugins' resources)."""
    pod = POD_RESOURCES[r.cluster.instance]
    counts = {"aws.amazon.com/neuron": pod.neuron_devices, "vpc.amazonaws.com/efa": pod.efa}
    return {"requests": dict(counts), "limits": dict(counts)}


def _eval_resources(r: Recipe) -> dict:
    """eval.sbatch's request in Kubernetes terms: eval.cpus (default CPU_CORES unless GPUs or the whole node are asked
    for, as its #SBATCH lines), the model's memory (eval.mem_gb; Slurm's G is GiB), eval.gpus of the NVIDIA device
    plugin. eval.exclusive, eval.partition and eval.account are Slurm's alone: no Kubernetes request stands for them."""
    requests, limits = {}, {}
    cpus = r.eval.cpus or (None if r.eval.gpus or r.eval.exclusive else EVAL_CPU_CORES)
    if cpus:
        requests["cpu"] = cpus
    if memory := eval_mem_gb(r):
        requests["memory"] = limits["memory"] = f"{memory}Gi"
    if r.eval.gpus:
        requests[GPU_RESOURCE] = limits[GPU_RESOURCE] = r.eval.gpus
    return {"requests": requests, "limits": limits} if limits else {"requests": requests}


def _pod_template(r: Recipe, image: str, job_dir: Path, mode: str, master: bool = False) -> dict:
    """The pod template of every manifest: the entrypoint in `mode` with the env table and the claim mounted. Compile
    and run pods take a whole node of cluster.instance and its node-local compile cache; the eval pod takes what
    eval.sbatch asks for; only the run pod's grace period leaves room for the save on SIGTERM."""
    training = mode != "eval"
    kind = "PyTorchJob" if training else "Job"
    cache = local_cache_dir(r).replace(JOB_USER, CONTAINER_USER)
    mounts = [{"name": "shared", "mountPath": r.k8s.mount}]
    volumes = [{"name": "shared", "persistentVolumeClaim": {"claimName": r.k8s.pvc}}]
    if training:
        mounts.append({"name": "compile-cache", "mountPath": cache})
        volumes.append({"name": "compile-cache", "hostPath": {"path": cache, "type": "DirectoryOrCreate"}})
    mounts.append({"name": "shm", "mountPath": "/dev/shm"})
    volumes.append({"name": "shm", "emptyDir": {"medium": "Memory"}})
    container = {
        "name": CONTAINER,
        "image": image,
        "command": ["bash", str(job_dir / "entrypoint.sh"), mode],
        "env": [
            *_env(r, job_dir),
            {"name": "TRNRECIPES_JOB_NAME", "valueFrom": {"fieldRef": {"fieldPath": _label(JOB_NAME_LABEL[kind])}}},
            {"name": "TRNRECIPES_POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        ],
        "resources": _training_resources(r) if training else _eval_resources(r),
        "volumeMounts": mounts,
    }
    if master:
        container["ports"] = [{"name": "pytorchjob-port", "containerPort": MASTER_PORT}]
    spec: dict = {}
    if mode == "run":  # the pre-timeout save's lead (slurm.signal_seconds or derived from the checkpoint size)
        spec["terminationGracePeriodSeconds"] = signal_seconds(r)
    if training:
        spec["nodeSelector"] = {"node.kubernetes.io/instance-type": r.cluster.instance}
    else:
        spec["restartPolicy"] = "Never"  # what a Job's podFailurePolicy requires
    spec |= {"containers": [container], "volumes": volumes}
    if r.k8s.service_account:
        spec["serviceAccountName"] = r.k8s.service_account
    return {"metadata": {"labels": {"trnrecipes/job": r.job_name}}, "spec": spec}


def job_name(r: Recipe, mode: str = "run") -> str:
    """A job's Kubernetes name: the job name as a DNS label, `-compile` / `-eval` for those jobs. The cap leaves room
    for the longest name made from it, the compile job's pods and services <name>-compile-worker-<i> (63 at most)."""
    name = r.job_name.lower().replace(".", "-").replace("_", "-")
    if not re.fullmatch(r"[a-z]([-a-z0-9]{0,40}[a-z0-9])?", name):
        raise RecipeError(
            f"slurm.job_name {shown(r.job_name)} does not make a Kubernetes name: letters, digits and - only,"
            " starting with a letter, at most 42 characters (the compile job's pods are named"
            " <name>-compile-worker-<i>, at most 63)"
        )
    return name if mode == "run" else f"{name}-{mode}"


def _label(name: str) -> str:
    return f"metadata.labels['{name}']"


def pytorchjob(r: Recipe, layout: Layout, image: str, job_dir: Path, mode: str = "run") -> dict:
    """A PyTorchJob of the training pods (mode run, or compile: the same launch through the compiler): a Master
    (node rank 0, hosting torchrun's static store) and N-1 Workers, one pod per node. The operator sets
    MASTER_ADDR/MASTER_PORT, RANK and PET_NODE_RANK only where a Master replica exists
    (pkg/controller.v1/pytorch/envvar.go, v1.9.0); a Worker-only job gets them only from an elasticPolicy."""
    replicas = {"Master": 1, "Worker": layout.nodes - 1}
    specs = {
        kind: {
            "replicas": count,
            "restartPolicy": "ExitCode",
            "template": _pod_template(r, image, job_dir, mode, master=kind == "Master"),
        }
        for kind, count in replicas.items()
        if count
    }
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": job_name(r, mode), "namespace": r.k8s.namespace},
        "spec": {
            "nprocPerNode": str(layout.workers_per_node),
            "runPolicy": {"backoffLimit": r.slurm.max_restarts, "cleanPodPolicy": "None"},
            "pytorchReplicaSpecs": specs,
        },
    }


def eval_job(r: Recipe, image: str, job_dir: Path) -> dict:
    """The eval Job (batch/v1): one pod scores the run dir's newest checkpoint, as eval.sbatch does. Its exit codes
    follow the PyTorchJobs': only the entrypoint's node fault (129) is retried, up to slurm.max_restarts times; any
    other failure fails the Job at once (podFailurePolicy, GA in Kubernetes 1.31), and an eviction (the pod's
    DisruptionTarget condition) is retried without counting."""
    spec: dict = {
        "backoffLimit": r.slurm.max_restarts,
        "podFailurePolicy": {
            "rules": [
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
                {
                    "action": "FailJob",
                    "onExitCodes": {"containerName": CONTAINER, "operator": "NotIn", "values": [RETRYABLE_EXIT]},
                },
            ]
        },
    }
    if r.eval.time_limit:  # eval.sbatch's --time
        spec["activeDeadlineSeconds"] = time_limit_seconds(r.eval.time_limit)
    spec["template"] = _pod_template(r, image, job_dir, "eval")
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": job_name(r, "eval"), "namespace": r.k8s.namespace},
        "spec": spec,
    }


def dra_claim_template(r: Recipe) -> dict:
    """The Neuron DRA driver's way to the node's devices, instead of the device plugin's aws.amazon.com/neuron: a
    ResourceClaimTemplate of every Neuron device of one cluster.instance node, as the Amazon EKS user guide's
    example ("Manage Neuron devices on Amazon EKS", Request Neuron devices in a Pod). The README shows it; no
    manifest uses it."""
    instance = f"device.attributes['{NEURON_DEVICE_CLASS}'].instanceType == '{r.cluster.instance}'"
    request = {"deviceClassName": NEURON_DEVICE_CLASS, "selectors": [{"cel": {"expression": instance}}],
               "allocationMode": "All"}  # fmt: skip
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": f"{job_name(r)}-neurons", "namespace": r.k8s.namespace},
        "spec": {"spec": {"devices": {"requests": [{"name": "neurons", "exactly": request}]}}},
    }


def kubectl_steps(r: Recipe, job_dir: Path) -> list[str]:
    """The commands that run the three jobs in order, each waiting for the one before (kubectl wait's -1s: a week,
    its longest)."""
    # The training operator's condition Succeeded (pkg/apis/kubeflow.org/v1 common_types.go), batch/v1's Complete.
    done = {"compile": "Succeeded pytorchjob", "run": "Succeeded pytorchjob", "eval": "complete job"}
    lines = []
    for mode, file_name in MANIFESTS.items():
        condition, kind = done[mode].split()
        wait = f"kubectl wait -n {r.k8s.namespace} --for=condition={condition} --timeout=-1s {kind}/{job_name(r, mode)}"
        if mode != "eval":  # a new job: the failure counts its pods left (killed, deleted) are not its own
            lines.append(f"rm -rf {shell_word(job_dir / 'logs' / job_name(r, mode) / 'failures')}")
        lines += [f"kubectl apply -f {shell_word(job_dir / file_name)}", wait]
    return lines


def render_k8s(recipe: Recipe, job_dir: Path, command: str, repo_root: Path = REPO_ROOT, **render_args) -> Job:
    """The k8s dir of a job dir (job_dir/k8s): the compile PyTorchJob, the training PyTorchJob, the eval Job, their
    entrypoint.sh, README.md and the resolved recipe.yaml the pods read. The layout and memory checks are
    render_job's."""
    if objective(recipe) != "causal_lm":
        raise RecipeError(f"trnrecipes k8s renders causal-LM training; {recipe.name} is {objective(recipe)}")
    out = Path(os.path.abspath(k8s_dir(job_dir)))
    job = render_job(recipe, out, command, repo_root, **render_args)
    run_dir = run_dir_for(recipe, repo_root, render_args.get("runs_root"))
    _check(recipe, repo_root, out, run_dir)
    image = _image(recipe)
    manifests = {mode: pytorchjob(recipe, job.layout, image, out, mode) for mode in ("compile", "run")}
    manifests["eval"] = eval_job(recipe, image, out)
    env = _environment()
    context = {"r": recipe, "layout": job.layout, "command": command, "job_dir": out, "repo_root": repo_root,
               "run_dir": run_dir, "image": image, "stack": recipe.stack, "names": MANIFESTS,
               "job_names": {mode: job_name(recipe, mode) for mode in MANIFESTS},
               "steps": kubectl_steps(recipe, out), "dra": yaml.safe_dump(dra_claim_template(recipe), sort_keys=False),
               "eval_python": default_python(recipe, repo_root, scoring=True),
               "eval_cpu_hours": eval_estimate(recipe)["cpu_hours"], "eval_cpus": EVAL_CPU_CORES}  # fmt: skip
    files = {
        MANIFESTS[mode]: f"# {_comment_line(command)}\n" + yaml.safe_dump(manifest, sort_keys=False)
        for mode, manifest in manifests.items()
    }
    files |= {
        "entrypoint.sh": entrypoint_script(recipe, job.layout, out, command, repo_root, run_dir),
        "README.md": env.get_template("k8s_README.md.j2").render(context),
        "recipe.yaml": job.files["recipe.yaml"],
    }
    return Job(recipe, job.layout, out, files)


def entrypoint_script(r: Recipe, layout: Layout, job_dir: Path, command: str, repo_root: Path, run_dir: Path) -> str:
    """The entrypoint.sh of every pod, `entrypoint.sh compile|run|eval`. Any recipe renders (the tests run it with the
    cpu backend); the manifests are Neuron's."""
    context = {
        "r": r,
        "layout": layout,
        "command": command,
        "job_dir": job_dir,
        "repo_root": repo_root,
        "run_dir": run_dir,
        "python": r.cluster.python or CONTAINER_PYTHON,
        "eval_python": default_python(r, repo_root, scoring=True),
        "stack": r.stack,
        "cache_leaders": " ".join(map(str, cache_leader_nodes(layout))),
        "retryable": RETRYABLE_EXIT,
        "wheels": job_wheels(r, repo_root),
        "megatron": any(c.format == "megatron" for c in r.data.corpora()),
        "signal_seconds": signal_seconds(r),
    }
    return _environment().get_template("k8s_entrypoint.sh.j2").render(context)


def _comment_line(command: str) -> str:
    return "Made by trnrecipes; re-create with: " + command.replace("\n", " ")
