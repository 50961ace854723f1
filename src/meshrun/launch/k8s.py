"""``meshrun k8s render``: Kubernetes manifests for a multi-node job (pure: no cluster needed).

meshrun does not schedule pods; Kubernetes and its batch operators do. This module writes the
two common shapes, each running ``meshrun launch`` (the torchrun agent) once per pod:

* a Kubeflow ``PyTorchJob`` (kubeflow.org/v1, the training operator): a Master and N-1 Workers
  whose node rank and rendezvous address come from the operator's ``RANK``/``MASTER_ADDR``/
  ``MASTER_PORT``; or, for ``--nodes MIN:MAX``, Workers only with an ``elasticPolicy`` (c10d
  rendezvous on worker 0, endpoint in ``PET_RDZV_ENDPOINT``);
* a ``JobSet`` (jobset.x-k8s.io/v1alpha2) of one Indexed Job with a pod per node, plus the
  headless ``Service`` whose DNS name for pod 0 is the rendezvous endpoint; node rank =
  ``JOB_COMPLETION_INDEX``.

Both give every pod the image, GPUs (``nvidia.com/gpu`` limits), env, a memory-backed
``/dev/shm`` (the 64 MB container default breaks NCCL and DataLoader workers) and restart
settings; ``--config FILE`` travels as a ConfigMap mounted at ``/etc/meshrun`` and is passed to
``meshrun launch --config``, which validates it in the pod and hands the workers its resolved
copy as ``MESHRUN_CONFIG``. Everything is checked before anything is written. See
docs/kubernetes.md.
"""

from __future__ import annotations

import copy
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshrun.config import (
    ConfigError,
    load_config,
    resolve_global_batch,
    split_overrides,
    validate_for_world,
)
from meshrun.launch.yamlout import dump_documents

Doc = dict[str, Any]

KINDS = ("pytorchjob", "jobset")
# Kubeflow's ReplicaSpec takes all four; a Job's pods (JobSet) only OnFailure or Never.
RESTART_POLICIES = {
    "pytorchjob": ("OnFailure", "Never", "Always", "ExitCode"),
    "jobset": ("OnFailure", "Never"),
}
CONFIG_DIR = "/etc/meshrun"
CONFIG_KEY = "config.toml"
CONTAINER = "pytorch"  # the training operator finds the port and sets env on this container
PORT_NAME = "pytorchjob-port"  # ... and this port: MASTER_PORT / the elastic rendezvous port
REPLICA_INDEX_LABEL = "training.kubeflow.org/replica-index"
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
JOBSET_REPLICATED_JOB = "node"
NODE_RANK_ENV = "MESHRUN_NODE_RANK"  # elastic PyTorchJob: the pod's replica index
SHM_NOTE = (
    "/dev/shm is a memory-backed emptyDir: the container runtime's 64 MB default breaks "
    "NCCL and DataLoader workers."
)

_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
_QUANTITY = re.compile(r"^([0-9]+(\.[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")
_MAX_LABEL = 63


@dataclass
class K8sJob:
    """One multi-node job to render; the CLI builds it from its flags."""

    name: str
    image: str
    script: str | None = None  # a script path inside the image, or
    module: str | None = None  # a module to run with -m (exactly one of the two)
    script_args: list[str] = field(default_factory=list)
    nodes: str = "1"  # N, or MIN:MAX for an elastic job
    nproc_per_node: int = 0  # 0 = gpus_per_node, or 1 without GPUs
    gpus_per_node: int = 0
    namespace: str = "default"
    shm_size: str = "16Gi"
    env: dict[str, str] = field(default_factory=dict)
    restart_policy: str = "OnFailure"
    max_restarts: int = 3
    port: int = 29500
    config_text: str | None = None  # TOML shipped as a ConfigMap

    @property
    def node_range(self) -> tuple[int, int]:
        return parse_nodes(self.nodes)

    @property
    def elastic(self) -> bool:
        low, high = self.node_range
        return low != high

    @property
    def procs(self) -> int:
        return self.nproc_per_node or max(self.gpus_per_node, 1)


# --- validation ------------------------------------------------------------------------------


def parse_nodes(text: str) -> tuple[int, int]:
    """``"N"`` -> (N, N); ``"MIN:MAX"`` -> (MIN, MAX); errors name ``--nodes``."""
    parts = text.split(":")
    if len(parts) > 2 or not all(p.isascii() and p.isdigit() for p in parts):
        raise ConfigError(f"--nodes {text!r} is not allowed: expected N or MIN:MAX, e.g. 4 or 2:4")
    low, high = int(parts[0]), int(parts[-1])
    if low < 1:
        raise ConfigError(f"--nodes {text!r} is not allowed: a job needs at least 1 node")
    if low > high:
        raise ConfigError(f"--nodes {text!r} is not allowed: MIN {low} is larger than MAX {high}")
    return low, high


def check_job(job: K8sJob, kinds: tuple[str, ...] = KINDS) -> None:
    """Every check that needs no cluster, each error naming the flag, the value and the fix."""
    _check_names(job, kinds)
    if not job.image or any(c.isspace() for c in job.image):
        raise ConfigError(f"--image {job.image!r} is not allowed: give an image reference")
    if (job.script is None) == (job.module is None):
        raise ConfigError("meshrun k8s render needs a script (train.py) or -m MODULE")
    _check_numbers(job)
    size = _QUANTITY.match(job.shm_size)
    if size is None or float(size[1]) == 0:
        raise ConfigError(
            f"--shm-size {job.shm_size!r} is not allowed: a Kubernetes quantity > 0, e.g. 16Gi"
        )
    for key in job.env:
        if key == NODE_RANK_ENV:
            raise ConfigError(f"--env {key}: meshrun sets this variable itself; use another name")
        if not _ENV_NAME.match(key):
            raise ConfigError(
                f"--env {key!r}: not a valid variable name (letters, digits, '_', '-', '.'; "
                "not starting with a digit)"
            )
    for kind in kinds:
        if job.restart_policy not in RESTART_POLICIES[kind]:
            raise ConfigError(
                f"--restart-policy {job.restart_policy!r} is not allowed for a {kind}: choose "
                f"one of {', '.join(RESTART_POLICIES[kind])}"
            )


def _check_names(job: K8sJob, kinds: tuple[str, ...]) -> None:
    # The name also names a Service (JobSet) and the operator's per-pod Services, which must
    # be DNS-1035 labels; the pods' hostnames built from it must fit in 63 characters.
    if not _DNS1035.match(job.name):
        raise ConfigError(
            f"--name {job.name!r} is not allowed: lower-case letters, digits and '-', starting "
            "with a letter and not ending with '-' (a DNS-1035 label)"
        )
    if not _DNS1123.match(job.namespace) or len(job.namespace) > _MAX_LABEL:
        raise ConfigError(
            f"--namespace {job.namespace!r} is not allowed: lower-case letters, digits and "
            "'-', at most 63 characters (a DNS-1123 label)"
        )
    last = parse_nodes(job.nodes)[1] - 1
    hosts = {"pytorchjob": f"{job.name}-worker-{last}", "jobset": _jobset_host(job.name, last)}
    for kind in kinds:
        if len(hosts[kind]) > _MAX_LABEL:
            raise ConfigError(
                f"--name {job.name!r} is too long: the {kind} pod hostname {hosts[kind]!r} "
                f"has {len(hosts[kind])} characters, Kubernetes allows 63; use a shorter name"
            )


def _check_numbers(job: K8sJob) -> None:
    parse_nodes(job.nodes)
    if job.gpus_per_node < 0:
        raise ConfigError(f"--gpus-per-node {job.gpus_per_node} is not allowed: must be >= 0")
    if job.nproc_per_node < 0:
        raise ConfigError(f"--nproc-per-node {job.nproc_per_node} is not allowed: must be >= 1")
    if job.gpus_per_node and job.procs > job.gpus_per_node:
        raise ConfigError(
            f"--nproc-per-node {job.procs} is larger than --gpus-per-node {job.gpus_per_node}: "
            "meshrun runs one process per GPU; lower --nproc-per-node or ask for more GPUs"
        )
    if job.max_restarts < 0:
        raise ConfigError(f"--max-restarts {job.max_restarts} is not allowed: must be >= 0")
    if not 1 <= job.port <= 65535:
        raise ConfigError(f"--port {job.port} is not allowed: a TCP port in 1..65535")


def check_config(job: K8sJob, config_path: str | None) -> None:
    """The config file and the ``--section.key=value`` overrides among the script's arguments
    must hold on every world size the job can take (each node count in MIN..MAX)."""
    overrides, _ = split_overrides(job.script_args)
    cfg = load_config(config_path, overrides)
    low, high = job.node_range
    for nodes in range(low, high + 1):
        try:
            validate_for_world(cfg, nodes * job.procs)
        except ConfigError as err:
            world = nodes * job.procs
            hint = (
                ""
                if config_path
                else "; pass --config FILE, or --section.key=VALUE after the script"
            )
            raise ConfigError(
                f"{err} (with {nodes} nodes x {job.procs} = {world} processes){hint}"
            ) from None
    # An unset global batch: each pod's meshrun launch derives one number for the node range
    # (the same function); it divides at every world by construction, so this only says it.
    if note := resolve_global_batch(cfg, [n * job.procs for n in range(low, high + 1)]):
        print(f"meshrun k8s render: {note} (each pod's meshrun launch derives it)", file=sys.stderr)


# --- rendering -------------------------------------------------------------------------------


def render(job: K8sJob, kind: str) -> list[Doc]:
    """The documents of one kind, in the order ``kubectl apply`` should create them."""
    if kind not in KINDS:
        raise ConfigError(f"--kind {kind!r} is not allowed: choose pytorchjob, jobset or both")
    check_job(job, (kind,))
    docs = [_config_map(job)] if job.config_text is not None else []
    if kind == "pytorchjob":
        return [*docs, render_pytorchjob(job)]
    return [*docs, _headless_service(job), render_jobset(job)]


def render_pytorchjob(job: K8sJob) -> Doc:
    """Kubeflow PyTorchJob: Master + Workers, or Workers with an elasticPolicy for MIN:MAX."""
    low, high = job.node_range
    # ExitCode is the operator's own policy (restart on retryable exit codes); it runs the
    # pods themselves with Never.
    restart = "Never" if job.restart_policy == "ExitCode" else job.restart_policy
    spec: Doc = {"nprocPerNode": str(job.procs), "runPolicy": {"backoffLimit": job.max_restarts}}
    if job.elastic:
        spec["elasticPolicy"] = {
            "minReplicas": low,
            "maxReplicas": high,
            "rdzvBackend": "c10d",
            "rdzvId": job.name,
            "rdzvPort": job.port,
            "maxRestarts": job.max_restarts,
        }
        # The operator sets PET_RDZV_ENDPOINT (worker 0); each pod's rank is its replica index.
        command = _launch_command(job, f"$({NODE_RANK_ENV})", "$(PET_RDZV_ENDPOINT)")
        index = {"fieldRef": {"fieldPath": f"metadata.labels['{REPLICA_INDEX_LABEL}']"}}
        pod = _pod_template(job, command, PORT_NAME, [_env_from(NODE_RANK_ENV, index)], restart)
        replicas = {"Worker": _replica(job, high, pod)}
    else:
        # The operator sets RANK (master 0, worker i -> i+1) and MASTER_ADDR/MASTER_PORT.
        command = _launch_command(job, "$(RANK)", "$(MASTER_ADDR):$(MASTER_PORT)")
        pod = _pod_template(job, command, PORT_NAME, [], restart)
        replicas = {"Master": _replica(job, 1, pod)}
        if high > 1:
            replicas["Worker"] = _replica(job, high - 1, copy.deepcopy(pod))
    spec["pytorchReplicaSpecs"] = replicas
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": _metadata(job, job.name),
        "spec": spec,
    }


def render_jobset(job: K8sJob) -> Doc:
    """JobSet: one Indexed Job with a pod per node (MAX pods for MIN:MAX)."""
    high = job.node_range[1]
    endpoint = f"{_jobset_host(job.name, 0)}.{job.name}:{job.port}"
    command = _launch_command(job, "$(JOB_COMPLETION_INDEX)", endpoint)
    pod = _pod_template(job, command, "rdzv", [], job.restart_policy)
    job_spec: Doc = {
        "parallelism": high,
        "completions": high,
        "completionMode": "Indexed",
        "backoffLimit": job.max_restarts,
        "template": pod,
    }
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": _metadata(job, job.name),
        "spec": {
            # Pods get <name>-node-0-<i>.<name> DNS names through the headless Service.
            "network": {
                "enableDNSHostnames": True,
                "subdomain": job.name,
                "publishNotReadyAddresses": True,
            },
            "failurePolicy": {"maxRestarts": job.max_restarts},
            "replicatedJobs": [
                {
                    "name": JOBSET_REPLICATED_JOB,
                    "replicas": 1,
                    "template": {"spec": job_spec},
                }
            ],
        },
    }


def _headless_service(job: K8sJob) -> Doc:
    # publishNotReadyAddresses: pod 0's name must resolve while the pods are still starting,
    # since the rendezvous happens before anything could report ready.
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(job, job.name),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {JOBSET_NAME_LABEL: job.name},
            "ports": [{"name": "rdzv", "port": job.port, "targetPort": job.port}],
        },
    }


def _config_map(job: K8sJob) -> Doc:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(job, f"{job.name}-config"),
        "data": {CONFIG_KEY: job.config_text or ""},
    }


def _launch_command(job: K8sJob, node_rank: str, endpoint: str) -> list[str]:
    # $(VAR) is expanded by the kubelet from the container's env (no shell needed).
    argv = [
        *("meshrun", "launch"),
        *("--nnodes", job.nodes),
        *("--nproc-per-node", str(job.procs)),
        *("--node-rank", node_rank),
        *("--rdzv-endpoint", endpoint),
        *("--rdzv-id", job.name),
        *("--max-restarts", str(job.max_restarts)),
    ]
    if job.config_text is not None:
        argv += ["--config", f"{CONFIG_DIR}/{CONFIG_KEY}"]
    argv += ["-m", job.module] if job.module else [str(job.script)]
    return argv + list(job.script_args)


def _pod_template(
    job: K8sJob, command: list[str], port_name: str, env: list[Doc], restart: str
) -> Doc:
    container: Doc = {
        "name": CONTAINER,
        "image": job.image,
        "command": command,
        "env": [{"name": k, "value": v} for k, v in job.env.items()] + env,
        "ports": [{"name": port_name, "containerPort": job.port, "protocol": "TCP"}],
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }
    if not container["env"]:
        del container["env"]
    if job.gpus_per_node:
        # Extended resources: the limit is also the request.
        container["resources"] = {"limits": {"nvidia.com/gpu": str(job.gpus_per_node)}}
    volumes: list[Doc] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": job.shm_size}}
    ]
    if job.config_text is not None:
        volumes.append({"name": "meshrun-config", "configMap": {"name": f"{job.name}-config"}})
        container["volumeMounts"].append(
            {"name": "meshrun-config", "mountPath": CONFIG_DIR, "readOnly": True}
        )
    return {
        "metadata": {"labels": _labels(job)},
        "spec": {
            "restartPolicy": restart,
            "containers": [container],
            "volumes": volumes,
        },
    }


def _replica(job: K8sJob, replicas: int, pod: Doc) -> Doc:
    # The operator restarts replicas by this policy (and rewrites the pods' own to match).
    return {"replicas": replicas, "restartPolicy": job.restart_policy, "template": pod}


def _env_from(name: str, source: Doc) -> Doc:
    return {"name": name, "valueFrom": source}


def _metadata(job: K8sJob, name: str) -> Doc:
    return {"name": name, "namespace": job.namespace, "labels": _labels(job)}


def _labels(job: K8sJob) -> dict[str, str]:
    return {"app.kubernetes.io/name": "meshrun", "app.kubernetes.io/instance": job.name}


def _jobset_host(name: str, index: int) -> str:
    """The hostname JobSet gives pod ``index``: <jobset>-<replicatedJob>-<job index>-<pod>."""
    return f"{name}-{JOBSET_REPLICATED_JOB}-0-{index}"


# --- files -----------------------------------------------------------------------------------


def header(job: K8sJob, kind: str) -> str:
    """The comment block at the top of a rendered file."""
    low, high = job.node_range
    what = {"pytorchjob": "Kubeflow PyTorchJob (kubeflow.org/v1)", "jobset": "JobSet + Service"}
    lines = [
        f"meshrun k8s render: {what[kind]} '{job.name}' in namespace '{job.namespace}',",
        f"{job.nodes} nodes x {job.procs} processes, {job.gpus_per_node} GPUs per node.",
        SHM_NOTE,
    ]
    if kind == "jobset" and low != high:
        lines.append(
            f"JobSet has no elastic scaling: it starts {high} pods; the torchrun agent accepts "
            f"{low}..{high} nodes when some are lost and the job restarts."
        )
    return "\n".join(lines)


def write_manifests(job: K8sJob, kinds: tuple[str, ...], out_dir: str | Path) -> list[Path]:
    """Render every kind first (so an error writes nothing), then ``OUT/<kind>.yaml``."""
    texts = {kind: dump_documents(render(job, kind), header(job, kind)) for kind in kinds}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for kind, text in texts.items():
        path = out / f"{kind}.yaml"
        path.write_text(text)
        paths.append(path)
    return paths
