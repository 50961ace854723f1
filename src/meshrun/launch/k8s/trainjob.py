"""``meshrun k8s render --kind trainjob``: a Kubeflow Trainer v2 ``TrainJob`` (pure).

Trainer v2 (trainer.kubeflow.org/v1alpha1) replaces the training operator's PyTorchJob: a
``TrainJob`` names a ``ClusterTrainingRuntime`` (``torch-distributed`` by default), which holds
the JobSet template of the pods, and overrides only what the job decides: ``spec.trainer``'s
image, command, env, ``numNodes``, ``numProcPerNode`` and ``resourcesPerNode``. The runtime's
torch plugin gives the trainer container (named ``node``) torchrun's environment defaults:
``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK`` (the Job completion index),
``PET_MASTER_ADDR`` (pod 0, ``<name>-node-0-0.<name>``) and ``PET_MASTER_PORT`` (29500).

The pod runs ``meshrun launch``, which reads the ``PET_*`` variables as torchrun does (the node
count, processes per node and node rank); the command names the rendezvous itself, c10d at
``$(PET_MASTER_ADDR):$(PET_MASTER_PORT)``, because torchrun's reading of those two (a static
rendezvous) cannot restart the workers of one node without the others. The memory-backed
``/dev/shm`` and the config's ConfigMap cannot go in ``spec.trainer``: v1alpha1 takes pod
volumes only through ``spec.runtimePatches`` (a patch owned by a named manager, applied to the
runtime's JobSet template), so they go there, onto the ``node`` replicated job and container.
"""

from __future__ import annotations

import re

from meshrun.config import ConfigError
from meshrun.launch.k8s.job import (
    DEFAULT_RUNTIME,
    NODE_JOB,
    Doc,
    K8sJob,
    check_hostname,
    env_list,
    gpu_resources,
    jobset_host,
    labels,
    launch_command,
    metadata,
    volume_mounts,
    volumes,
)

API_GROUP = "trainer.kubeflow.org"
API_VERSION = f"{API_GROUP}/v1alpha1"
RUNTIME_KIND = "ClusterTrainingRuntime"
TRAINER_CONTAINER = "node"  # the torch plugin sets PET_* on this container of the runtime
PATCH_MANAGER = "meshrun"  # owns meshrun's entry in spec.runtimePatches
TRAINER_PORT = 29500  # the plugin's PET_MASTER_PORT, fixed (constants.ContainerTrainerPort)
# The variables the torch plugin sets; its admission webhook refuses a TrainJob that sets them.
PET_VARIABLES = (
    "PET_NNODES",
    "PET_NPROC_PER_NODE",
    "PET_NODE_RANK",
    "PET_MASTER_ADDR",
    "PET_MASTER_PORT",
)
ENDPOINT = "$(PET_MASTER_ADDR):$(PET_MASTER_PORT)"
_RUNTIME_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")


def check_trainjob(job: K8sJob) -> None:
    """What a TrainJob cannot express, each an error naming the flag (as typed) and the fix."""
    low, high = job.node_range
    if low != high:
        raise ConfigError(
            f"{job.nodes_flag} {job.nodes!r} is not allowed for a trainjob: a TrainJob has a "
            "fixed numNodes (Trainer v2 has no elastic jobs yet); give N, or use --kind "
            "pytorchjob for an elastic job"
        )
    check_hostname(job, "trainjob", jobset_host(job.name, high - 1))
    if job.port != TRAINER_PORT:
        raise ConfigError(
            f"--port {job.port} is not allowed for a trainjob: the {DEFAULT_RUNTIME} runtime "
            f"sets PET_MASTER_PORT={TRAINER_PORT} itself; drop --port"
        )
    if job.restart_policy != "OnFailure":
        raise ConfigError(
            f"--restart-policy {job.restart_policy!r} is not allowed for a trainjob: its pods "
            "take the runtime's JobSet template (OnFailure, JobSet's default), which a TrainJob "
            "cannot change; drop --restart-policy, or use --kind jobset"
        )
    if not _RUNTIME_NAME.match(job.runtime) or len(job.runtime) > 253:
        raise ConfigError(
            f"--runtime {job.runtime!r} is not allowed: the name of a ClusterTrainingRuntime "
            f"(lower-case letters, digits, '-' and '.'), e.g. {DEFAULT_RUNTIME}"
        )
    taken = [key for key in job.env if key in PET_VARIABLES]
    if taken:
        raise ConfigError(
            f"--env {taken[0]}: the TrainJob's torch runtime sets {', '.join(PET_VARIABLES)} "
            "itself (its webhook refuses a TrainJob that sets them); use --nnodes and "
            "--nproc-per-node instead"
        )


def render_trainjob(job: K8sJob) -> Doc:
    """The TrainJob: the trainer's image, command, env, size and GPUs; /dev/shm (and the
    config) as a runtime patch of the runtime's ``node`` pods."""
    topology = ["--rdzv-backend", "c10d", "--rdzv-endpoint", ENDPOINT]
    trainer: Doc = {
        "image": job.image,
        "command": launch_command(job, topology),
        "env": env_list(job),
        "numNodes": job.node_range[1],
        "numProcPerNode": job.procs,
    }
    if resources := gpu_resources(job):
        trainer["resourcesPerNode"] = resources
    return {
        "apiVersion": API_VERSION,
        "kind": "TrainJob",
        "metadata": metadata(job, job.name),
        "spec": {
            "runtimeRef": {"name": job.runtime, "apiGroup": API_GROUP, "kind": RUNTIME_KIND},
            "trainer": trainer,
            "runtimePatches": [_pod_patch(job)],
        },
    }


def _pod_patch(job: K8sJob) -> Doc:
    pod = {
        "metadata": {"labels": labels(job)},
        "spec": {
            "volumes": volumes(job),
            "containers": [{"name": TRAINER_CONTAINER, "volumeMounts": volume_mounts(job)}],
        },
    }
    replicated = {"name": NODE_JOB, "template": {"spec": {"template": pod}}}
    return {
        "manager": PATCH_MANAGER,
        "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [replicated]}}},
    }


def trainjob_header(job: K8sJob) -> list[str]:
    """The file's comment lines that say what the runtime adds."""
    return [
        f"meshrun k8s render: Kubeflow Trainer v2 TrainJob ({API_VERSION}) '{job.name}' in "
        f"namespace '{job.namespace}',",
        f"{job.nodes} nodes x {job.procs} processes, {job.gpus_per_node} GPUs per node, on the "
        f"{RUNTIME_KIND} '{job.runtime}'",
        "(it sets PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR, "
        "PET_MASTER_PORT, which meshrun launch reads).",
    ]
