"""One Kubernetes job to render (:class:`K8sJob`), the checks every kind shares, and the pod
pieces every kind is made of (pure: no cluster needed).

``launch/k8s/render.py`` renders a Kubeflow PyTorchJob and a JobSet from it and ``launch/k8s/trainjob.py``
a Kubeflow Trainer v2 TrainJob; both take their names, labels, ConfigMap, ``/dev/shm`` volume and
``meshrun launch`` command from here, so the kinds cannot drift apart. See docs/kubernetes.md.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from typing import Any

from meshrun.config import (
    ConfigError,
    load_config,
    resolve_global_batch,
    split_overrides,
    validate_for_world,
)
from meshrun.runtime.secret import SECRET_ENV

Doc = dict[str, Any]

CONFIG_DIR = "/etc/meshrun"
CONFIG_KEY = "config.toml"
NODE_RANK_ENV = "MESHRUN_NODE_RANK"  # elastic PyTorchJob: the pod's replica index
SHM_VOLUME = "dshm"
SECRET_KEY = "secret"  # the key of the job's Kubernetes Secret that holds MESHRUN_JOB_SECRET
CONFIG_VOLUME = "meshrun-config"
# The replicated job of meshrun's JobSet, and of Trainer v2's torch-distributed runtime (which
# names its container "node" too): pod i of both is <name>-node-0-<i>.
NODE_JOB = "node"
DEFAULT_RUNTIME = "torch-distributed"  # Trainer v2's ClusterTrainingRuntime for torchrun
SHM_NOTE = (
    "/dev/shm is a memory-backed emptyDir: the container runtime's 64 MB default breaks "
    "NCCL and DataLoader workers."
)

_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
_QUANTITY = re.compile(r"^([0-9]+(\.[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")
_DNS1123_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
MAX_LABEL = 63
MAX_NAME = 253


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
    runtime: str = DEFAULT_RUNTIME  # TrainJob only: the ClusterTrainingRuntime it runs on
    nodes_flag: str = "--nodes"  # the spelling the user typed (--nodes or --nnodes), for errors
    secret_name: str = ""  # the Kubernetes Secret with the job secret; "" = <name>-job-secret

    @property
    def node_range(self) -> tuple[int, int]:
        return parse_nodes(self.nodes, self.nodes_flag)

    @property
    def elastic(self) -> bool:
        low, high = self.node_range
        return low != high

    @property
    def procs(self) -> int:
        return self.nproc_per_node or max(self.gpus_per_node, 1)

    @property
    def job_secret(self) -> str:
        """The name of the Secret every pod reads ``MESHRUN_JOB_SECRET`` from."""
        return self.secret_name or f"{self.name}-job-secret"


# --- validation ------------------------------------------------------------------------------


def parse_nodes(text: str, flag: str = "--nodes") -> tuple[int, int]:
    """``"N"`` -> (N, N); ``"MIN:MAX"`` -> (MIN, MAX); errors name ``flag`` (as typed)."""
    parts = text.split(":")
    if len(parts) > 2 or not all(p.isascii() and p.isdigit() for p in parts):
        raise ConfigError(f"{flag} {text!r} is not allowed: expected N or MIN:MAX, e.g. 4 or 2:4")
    low, high = int(parts[0]), int(parts[-1])
    if low < 1:
        raise ConfigError(f"{flag} {text!r} is not allowed: a job needs at least 1 node")
    if low > high:
        raise ConfigError(f"{flag} {text!r} is not allowed: MIN {low} is larger than MAX {high}")
    return low, high


def check_common(job: K8sJob) -> None:
    """The checks every kind needs, each error naming the flag, the value and the fix."""
    _check_names(job)
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
        if key == SECRET_ENV:  # it would sit in the manifest, readable by all who read that
            raise ConfigError(
                f"--env {key}: every pod reads it from the Kubernetes Secret "
                f"{job.job_secret!r}; choose that Secret with --secret-name instead"
            )
        if key == NODE_RANK_ENV:
            raise ConfigError(f"--env {key}: meshrun sets this variable itself; use another name")
        if not _ENV_NAME.match(key):
            raise ConfigError(
                f"--env {key!r}: not a valid variable name (letters, digits, '_', '-', '.'; "
                "not starting with a digit)"
            )


def _check_names(job: K8sJob) -> None:
    # The name also names Services (the JobSet's, the operator's per-pod ones), which must be
    # DNS-1035 labels; the per-kind pod hostnames built from it are checked by each kind.
    if not _DNS1035.match(job.name):
        raise ConfigError(
            f"--name {job.name!r} is not allowed: lower-case letters, digits and '-', starting "
            "with a letter and not ending with '-' (a DNS-1035 label)"
        )
    if not _DNS1123_NAME.match(job.job_secret) or len(job.job_secret) > MAX_NAME:
        raise ConfigError(
            f"--secret-name {job.job_secret!r} is not allowed: lower-case letters, digits, '-' "
            "and '.', at most 253 characters (a DNS-1123 subdomain)"
        )
    if not _DNS1123.match(job.namespace) or len(job.namespace) > MAX_LABEL:
        raise ConfigError(
            f"--namespace {job.namespace!r} is not allowed: lower-case letters, digits and "
            "'-', at most 63 characters (a DNS-1123 label)"
        )


def check_hostname(job: K8sJob, kind: str, host: str) -> None:
    """A pod hostname derived from ``--name`` must fit in a 63-character DNS label."""
    if len(host) > MAX_LABEL:
        raise ConfigError(
            f"--name {job.name!r} is too long: the {kind} pod hostname {host!r} has "
            f"{len(host)} characters, Kubernetes allows 63; use a shorter name"
        )


def _check_numbers(job: K8sJob) -> None:
    parse_nodes(job.nodes, job.nodes_flag)
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


# --- the pieces every kind is made of ----------------------------------------------------------


def kubelet_literal(text: str) -> str:
    """``text`` as the kubelet passes it on: it expands ``$(VAR)`` in a container's command,
    args and env values and turns ``$$`` into ``$``, so every ``$`` doubled comes out as it
    was typed (``$(`` becomes ``$$(``)."""
    return text.replace("$", "$$")


def launch_command(job: K8sJob, topology: list[str]) -> list[str]:
    """``meshrun launch TOPOLOGY --rdzv-id NAME --max-restarts K [--config F] TARGET ARGS``.
    ``$(VAR)`` in TOPOLOGY is expanded by the kubelet from the container's env (no shell
    needed); what the user typed (the target and its arguments) reaches the pod as typed."""
    argv = [
        *("meshrun", "launch"),
        *topology,
        *("--rdzv-id", job.name),
        *("--max-restarts", str(job.max_restarts)),
    ]
    if job.config_text is not None:
        argv += ["--config", f"{CONFIG_DIR}/{CONFIG_KEY}"]
    target = ["-m", job.module] if job.module else [str(job.script)]
    return argv + [kubelet_literal(a) for a in [*target, *job.script_args]]


def volumes(job: K8sJob) -> list[Doc]:
    """The memory-backed ``/dev/shm`` and, with ``--config``, the ConfigMap."""
    found: list[Doc] = [
        {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": job.shm_size}}
    ]
    if job.config_text is not None:
        found.append({"name": CONFIG_VOLUME, "configMap": {"name": f"{job.name}-config"}})
    return found


def volume_mounts(job: K8sJob) -> list[Doc]:
    mounts: list[Doc] = [{"name": SHM_VOLUME, "mountPath": "/dev/shm"}]
    if job.config_text is not None:
        mounts.append({"name": CONFIG_VOLUME, "mountPath": CONFIG_DIR, "readOnly": True})
    return mounts


def env_list(job: K8sJob) -> list[Doc]:
    """``--env`` values, then the job secret from its Secret: the pod does not start without
    it (the kubelet reports the missing Secret by name), so no pod runs with another."""
    secret = {"secretKeyRef": {"name": job.job_secret, "key": SECRET_KEY}}
    return [
        *({"name": k, "value": kubelet_literal(v)} for k, v in job.env.items()),
        {"name": SECRET_ENV, "valueFrom": secret},
    ]


def secret_doc(job: K8sJob, value: str) -> Doc:
    """The job's Secret holding ``value`` (written to a file of mode 600, never printed)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata(job, job.job_secret),
        "type": "Opaque",
        "stringData": {SECRET_KEY: value},
    }


def gpu_resources(job: K8sJob) -> Doc | None:
    # Extended resources: the limit is also the request.
    return {"limits": {"nvidia.com/gpu": str(job.gpus_per_node)}} if job.gpus_per_node else None


def config_map(job: K8sJob) -> Doc:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(job, f"{job.name}-config"),
        "data": {CONFIG_KEY: job.config_text or ""},
    }


def metadata(job: K8sJob, name: str) -> Doc:
    return {"name": name, "namespace": job.namespace, "labels": labels(job)}


def labels(job: K8sJob) -> dict[str, str]:
    return {"app.kubernetes.io/name": "meshrun", "app.kubernetes.io/instance": job.name}


def jobset_host(name: str, index: int) -> str:
    """The hostname JobSet gives pod ``index``: <jobset>-<replicatedJob>-<job index>-<pod>."""
    return f"{name}-{NODE_JOB}-0-{index}"
