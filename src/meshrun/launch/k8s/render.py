"""``meshrun k8s render``: Kubernetes manifests for a multi-node job (pure: no cluster needed).

meshrun does not schedule pods; Kubernetes and its batch operators do. This module writes the
shapes clusters run, each running ``meshrun launch`` (the torchrun agent) once per pod:

* a Kubeflow ``PyTorchJob`` (kubeflow.org/v1, the training operator): a Master and N-1 Workers
  whose node rank and rendezvous address come from the operator's ``RANK``/``MASTER_ADDR``/
  ``MASTER_PORT``; or, for ``--nodes MIN:MAX``, Workers only with an ``elasticPolicy`` (c10d
  rendezvous on worker 0, endpoint in ``PET_RDZV_ENDPOINT``);
* a ``JobSet`` (jobset.x-k8s.io/v1alpha2) of one Indexed Job with a pod per node, plus the
  headless ``Service`` whose DNS name for pod 0 is the rendezvous endpoint; node rank =
  ``JOB_COMPLETION_INDEX``;
* a Kubeflow Trainer v2 ``TrainJob`` (trainer.kubeflow.org/v1alpha1) on the ``torch-distributed``
  runtime, whose ``PET_*`` variables ``meshrun launch`` reads as torchrun does
  (launch/k8s/trainjob.py).

All give every pod the image, GPUs (``nvidia.com/gpu`` limits), env, a memory-backed
``/dev/shm`` (the 64 MB container default breaks NCCL and DataLoader workers) and restart
settings; ``--config FILE`` travels as a ConfigMap mounted at ``/etc/meshrun`` and is passed to
``meshrun launch --config``, which validates it in the pod and hands the workers its resolved
copy as ``MESHRUN_CONFIG``. Everything is checked before anything is written. The job, the
checks and the pod pieces the kinds share are in launch/k8s/job.py. See docs/kubernetes.md.
"""

from __future__ import annotations

import copy
import os
import secrets
from pathlib import Path

from meshrun.config import ConfigError
from meshrun.launch.k8s.job import (
    DEFAULT_RUNTIME,
    NODE_JOB,
    NODE_RANK_ENV,
    SECRET_KEY,
    SHM_NOTE,
    Doc,
    K8sJob,
    check_common,
    check_config,
    check_hostname,
    config_map,
    env_list,
    gpu_resources,
    jobset_host,
    labels,
    launch_command,
    metadata,
    parse_nodes,
    secret_doc,
    volume_mounts,
    volumes,
)
from meshrun.launch.k8s.trainjob import check_trainjob, render_trainjob, trainjob_header
from meshrun.launch.k8s.yamlout import dump_documents

# Importable from here as before; the job and its shared checks live in launch/k8s/job.py.
__all__ = ["K8sJob", "check_config", "check_job", "header", "parse_nodes", "render"]
__all__ += ["render_jobset", "render_pytorchjob", "write_manifests", "write_secret"]

KINDS = ("pytorchjob", "jobset", "trainjob")
BOTH = ("pytorchjob", "jobset")  # --kind both: the two kinds of the training operator's era
# Kubeflow's ReplicaSpec takes all four; a Job's pods (JobSet) only OnFailure or Never. A
# TrainJob takes none (its runtime decides): check_trainjob says so.
RESTART_POLICIES = {
    "pytorchjob": ("OnFailure", "Never", "Always", "ExitCode"),
    "jobset": ("OnFailure", "Never"),
}
CONTAINER = "pytorch"  # the training operator finds the port and sets env on this container
PORT_NAME = "pytorchjob-port"  # ... and this port: MASTER_PORT / the elastic rendezvous port
REPLICA_INDEX_LABEL = "training.kubeflow.org/replica-index"
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"


def check_job(job: K8sJob, kinds: tuple[str, ...] = BOTH) -> None:
    """Every check that needs no cluster, each error naming the flag, the value and the fix."""
    check_common(job)
    last = job.node_range[1] - 1
    for kind in kinds:
        if kind == "trainjob":
            check_trainjob(job)
            continue
        host = f"{job.name}-worker-{last}" if kind == "pytorchjob" else jobset_host(job.name, last)
        check_hostname(job, kind, host)
        if job.restart_policy not in RESTART_POLICIES[kind]:
            raise ConfigError(
                f"--restart-policy {job.restart_policy!r} is not allowed for a {kind}: choose "
                f"one of {', '.join(RESTART_POLICIES[kind])}"
            )
        if job.runtime != DEFAULT_RUNTIME:
            raise ConfigError(
                f"--runtime {job.runtime!r} applies to a TrainJob only, not a {kind}: drop it, "
                "or use --kind trainjob"
            )


# --- rendering -------------------------------------------------------------------------------


def render(job: K8sJob, kind: str) -> list[Doc]:
    """The documents of one kind, in the order ``kubectl apply`` should create them."""
    if kind not in KINDS:
        raise ConfigError(
            f"--kind {kind!r} is not allowed: choose {', '.join(KINDS)} or both (the first two)"
        )
    check_job(job, (kind,))
    docs = [config_map(job)] if job.config_text is not None else []
    if kind == "pytorchjob":
        return [*docs, render_pytorchjob(job)]
    if kind == "trainjob":
        return [*docs, render_trainjob(job)]
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
        command = _command(job, f"$({NODE_RANK_ENV})", "$(PET_RDZV_ENDPOINT)")
        index = {"fieldRef": {"fieldPath": f"metadata.labels['{REPLICA_INDEX_LABEL}']"}}
        pod = _pod_template(job, command, PORT_NAME, [_env_from(NODE_RANK_ENV, index)], restart)
        replicas = {"Worker": _replica(job, high, pod)}
    else:
        # The operator sets RANK (master 0, worker i -> i+1) and MASTER_ADDR/MASTER_PORT.
        command = _command(job, "$(RANK)", "$(MASTER_ADDR):$(MASTER_PORT)")
        pod = _pod_template(job, command, PORT_NAME, [], restart)
        replicas = {"Master": _replica(job, 1, pod)}
        if high > 1:
            replicas["Worker"] = _replica(job, high - 1, copy.deepcopy(pod))
    spec["pytorchReplicaSpecs"] = replicas
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": metadata(job, job.name),
        "spec": spec,
    }


def render_jobset(job: K8sJob) -> Doc:
    """JobSet: one Indexed Job with a pod per node (MAX pods for MIN:MAX)."""
    high = job.node_range[1]
    endpoint = f"{jobset_host(job.name, 0)}.{job.name}:{job.port}"
    command = _command(job, "$(JOB_COMPLETION_INDEX)", endpoint)
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
        "metadata": metadata(job, job.name),
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
                    "name": NODE_JOB,
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
        "metadata": metadata(job, job.name),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {JOBSET_NAME_LABEL: job.name},
            "ports": [{"name": "rdzv", "port": job.port, "targetPort": job.port}],
        },
    }


def _command(job: K8sJob, node_rank: str, endpoint: str) -> list[str]:
    topology = ["--nnodes", job.nodes, "--nproc-per-node", str(job.procs)]
    return launch_command(job, [*topology, "--node-rank", node_rank, "--rdzv-endpoint", endpoint])


def _pod_template(
    job: K8sJob, command: list[str], port_name: str, env: list[Doc], restart: str
) -> Doc:
    container: Doc = {
        "name": CONTAINER,
        "image": job.image,
        "command": command,
        "env": env_list(job) + env,
        "ports": [{"name": port_name, "containerPort": job.port, "protocol": "TCP"}],
        "volumeMounts": volume_mounts(job),
    }
    if resources := gpu_resources(job):
        container["resources"] = resources
    return {
        "metadata": {"labels": labels(job)},
        "spec": {
            "restartPolicy": restart,
            "containers": [container],
            "volumes": volumes(job),
        },
    }


def _replica(job: K8sJob, replicas: int, pod: Doc) -> Doc:
    # The operator restarts replicas by this policy (and rewrites the pods' own to match).
    return {"replicas": replicas, "restartPolicy": job.restart_policy, "template": pod}


def _env_from(name: str, source: Doc) -> Doc:
    return {"name": name, "valueFrom": source}


# --- files -----------------------------------------------------------------------------------


def header(job: K8sJob, kind: str) -> str:
    """The comment block at the top of a rendered file."""
    low, high = job.node_range
    what = {"pytorchjob": "Kubeflow PyTorchJob (kubeflow.org/v1)", "jobset": "JobSet + Service"}
    lines = (
        trainjob_header(job)
        if kind == "trainjob"
        else [
            f"meshrun k8s render: {what[kind]} '{job.name}' in namespace '{job.namespace}',",
            f"{job.nodes} nodes x {job.procs} processes, {job.gpus_per_node} GPUs per node.",
        ]
    )
    lines.append(SHM_NOTE)
    lines.append(
        f"Every pod reads MESHRUN_JOB_SECRET from the Secret '{job.job_secret}' (key "
        f"'{SECRET_KEY}'): create it before this job (docs/kubernetes.md)."
    )
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


def write_secret(job: K8sJob, out_dir: str | Path) -> tuple[Path, bool]:
    """``OUT/<secret name>.yaml``: the job's Secret with a fresh random key, mode 600 from the
    start; and whether it was written now. An existing file is kept: rendering again must not
    change the key under pods already running (a restarted pod would then be refused)."""
    path = Path(out_dir) / f"{job.job_secret}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path, False
    note = (
        f"meshrun k8s render: the job secret of '{job.name}', a random key every pod reads as "
        f"MESHRUN_JOB_SECRET.\nApply it before the job; keep this file private (a render "
        "again keeps it; delete it for a new key)."
    )
    with os.fdopen(fd, "w") as out:
        out.write(dump_documents([secret_doc(job, secrets.token_hex(32))], note))
    return path, True
