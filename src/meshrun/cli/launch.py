"""``meshrun k8s render`` and ``meshrun slurm submit``: their flags, turned into the typed inputs
of launch/k8s/render.py and launch/slurm/submit.py (pure rendering). ``meshrun launch
--hostfile``'s plan is launch/hostfile/plan.py's."""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Any

import meshrun.launch.slurm.submit as slurm_submit
from meshrun.cli.args import Subparsers, add_command, add_group, add_set, add_target
from meshrun.config import (
    Config,
    ConfigError,
    load_config,
    split_overrides,
    to_toml,
    validate_for_world,
)
from meshrun.launch.k8s.job import DEFAULT_RUNTIME
from meshrun.launch.k8s.render import (
    BOTH,
    KINDS,
    K8sJob,
    check_config,
    check_job,
    header,
    render,
    write_manifests,
    write_secret,
)
from meshrun.launch.k8s.yamlout import dump_documents
from meshrun.launch.slurm.submit import DEFAULT_SIGNAL_BEFORE_S, SubmitSpec, render_sbatch, submit
from meshrun.launch.target import default_config, require_script

# --- meshrun k8s render ----------------------------------------------------------------------


def cmd_k8s_render(a: argparse.Namespace) -> int:
    job = job_from_args(a)
    kinds = BOTH if a.kind == "both" else (a.kind,)
    check_job(job, kinds)
    check_config(job, a.config)
    if job.elastic and "jobset" in kinds:
        print(
            f"meshrun k8s render: JobSet has no elastic scaling; it starts {job.node_range[1]} "
            f"pods, and torchrun continues on {job.nodes} nodes after losing some",
            file=sys.stderr,
        )
    if a.output:
        paths = write_manifests(job, kinds, a.output)
        _say_secret(job, a.output if not a.secret_name else None)
        for path in paths:
            print(f"wrote {path}; apply with: kubectl apply -f {path}")
        return 0
    texts = [dump_documents(render(job, kind), header(job, kind)) for kind in kinds]
    sys.stdout.write("---\n".join(texts))
    _say_secret(job, None)
    return 0


def _say_secret(job: K8sJob, out_dir: str | None) -> None:
    """The job secret's Secret: written next to the manifests (``--output`` without
    ``--secret-name``), or said where it must come from; its key is never printed."""
    if out_dir is not None:
        path, new = write_secret(job, out_dir)
        what = "wrote" if new else "kept (from an earlier render)"
        print(f"{what} {path}, the job secret (mode 600); apply it first: kubectl apply -f {path}")
        return
    how = "" if job.secret_name else "; or render with --output DIR, which writes it"
    print(
        f"meshrun k8s render: every pod reads MESHRUN_JOB_SECRET from the Secret "
        f"{job.job_secret!r} (key 'secret'), which must exist in namespace {job.namespace!r} "
        f"before the job: docs/kubernetes.md says how to create it{how}",
        file=sys.stderr,
    )


def job_from_args(a: argparse.Namespace) -> K8sJob:
    # --image is checked here, not by argparse's required=True: an unknown flag before the
    # script makes argparse hand the rest of the line, --image too, to the script, and its
    # "required: --image" then hid the real error, the unknown flag (argparse names it now).
    if a.image is None:
        raise ConfigError("meshrun k8s render needs --image IMAGE (with meshrun and the script)")
    if not a.target:
        raise ConfigError("meshrun k8s render needs a script (train.py) or -m MODULE")
    config_text = None
    if a.config:
        path = Path(a.config)
        if not path.is_file():
            raise ConfigError(f"--config {a.config!r}: no such file")
        config_text = path.read_text()
    return K8sJob(
        name=a.name,
        image=a.image,
        script=None if a.module else a.target,
        module=a.target if a.module else None,
        script_args=list(a.args),
        nodes=a.nodes,
        nodes_flag=a.nodes_flag,
        nproc_per_node=a.nproc_per_node,
        gpus_per_node=a.gpus_per_node,
        namespace=a.namespace,
        shm_size=a.shm_size,
        env=parse_env(a.env),
        restart_policy=a.restart_policy,
        max_restarts=a.max_restarts,
        port=a.port,
        config_text=config_text,
        runtime=a.runtime,
        secret_name=a.secret_name or "",
    )


def parse_env(items: list[str]) -> dict[str, str]:
    """``["K=V", ...]`` -> dict; a missing ``=`` or a key given twice is an error."""
    env: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--env {item!r} is not allowed: expected KEY=VALUE")
        if key in env:
            raise ConfigError(f"--env {key} is given twice ({env[key]!r} and {value!r})")
        env[key] = value
    return env


def add_k8s_parser(sub: Subparsers) -> None:
    ksub = add_group(
        sub, "k8s", "render Kubernetes manifests (Kubeflow TrainJob, PyTorchJob, JobSet)"
    )
    r = add_command(
        ksub,
        "render",
        cmd_k8s_render,
        help="write TrainJob, PyTorchJob or JobSet manifests that run meshrun launch in every pod",
        description="Write manifests for a multi-node job: a Kubeflow Trainer v2 TrainJob, a "
        "Kubeflow PyTorchJob and/or a JobSet with a headless Service. Each pod runs `meshrun "
        "launch` on SCRIPT (or -m MODULE); arguments after it go to the script. Inputs and the "
        "config are checked before anything is written. See docs/kubernetes.md.",
    )
    _add_k8s_pod_flags(r)
    _add_k8s_job_flags(r)
    add_target(r, "script path in the image, or module name with -m")


def _add_k8s_pod_flags(r: argparse.ArgumentParser) -> None:
    r.add_argument(
        "--kind",
        choices=[*KINDS, "both"],
        default="both",
        help="what to write; both = pytorchjob and jobset (default both)",
    )
    r.add_argument("--image", help="container image with meshrun and the script (required)")
    add_node_count(
        r, default="1", metavar="N|MIN:MAX", help="pods: N, or MIN:MAX for elastic (default 1)"
    )
    r.add_argument(
        "--nproc-per-node",
        type=int,
        default=0,
        metavar="P",
        help="processes per pod (default: GPUs, else 1)",
    )
    r.add_argument(
        "--gpus-per-node",
        type=int,
        default=0,
        metavar="G",
        help="nvidia.com/gpu per pod (default 0)",
    )


def _add_k8s_job_flags(r: argparse.ArgumentParser) -> None:
    r.add_argument("--name", default="meshrun", help="job name, a DNS-1035 label (default meshrun)")
    r.add_argument(
        "--namespace", default="default", metavar="NS", help="namespace (default default)"
    )
    r.add_argument(
        "--shm-size",
        default="16Gi",
        metavar="SIZE",
        help="size of the in-memory /dev/shm (default 16Gi)",
    )
    r.add_argument(
        "--env", action="append", default=[], metavar="K=V", help="container env (repeat)"
    )
    r.add_argument(
        "--restart-policy",
        default="OnFailure",
        metavar="POLICY",
        help="OnFailure (default), Never; PyTorchJob also Always, ExitCode; TrainJob: the "
        "runtime's (OnFailure)",
    )
    r.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        metavar="K",
        help="restarts after a failure, in the pod and by the operator (default 3)",
    )
    r.add_argument(
        "--port", type=int, default=29500, metavar="PORT", help="rendezvous port (default 29500)"
    )
    r.add_argument("--config", metavar="FILE", help="TOML config, shipped as a ConfigMap")
    r.add_argument(
        "--runtime",
        default=DEFAULT_RUNTIME,
        metavar="NAME",
        help=f"TrainJob: the ClusterTrainingRuntime it runs on (default {DEFAULT_RUNTIME})",
    )
    r.add_argument(
        "--output",
        metavar="DIR",
        help="directory for <kind>.yaml and the job secret's Secret (default: print the "
        "manifests to stdout)",
    )
    r.add_argument(
        "--secret-name",
        metavar="NAME",
        help="the Secret (key 'secret') the pods read MESHRUN_JOB_SECRET from, which you "
        "create; default <name>-job-secret, written by --output",
    )


class _NodeCount(argparse.Action):
    """Store the value and the spelling typed (``a.nodes_flag``), so errors name that one."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, values)
        setattr(namespace, f"{self.dest}_flag", option_string or "--nodes")


def add_node_count(p: argparse.ArgumentParser, **kwargs: Any) -> None:
    """``--nodes N``, also spelled ``--nnodes N`` as in ``meshrun launch`` and torchrun."""
    p.add_argument("--nodes", "--nnodes", action=_NodeCount, **kwargs)
    p.set_defaults(nodes_flag="--nodes")


# --- meshrun slurm submit --------------------------------------------------------------------


def cmd_slurm_submit(a: argparse.Namespace) -> int:
    spec, run_dir = build_spec(a)
    text = render_sbatch(spec)  # validates every flag before anything is written
    if a.dry_run:
        sys.stdout.write(text)
        return 0
    path = run_dir / "slurm" / "job.sbatch"
    path.parent.mkdir(parents=True, exist_ok=True)
    Path(spec.output_dir).mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    job_id = submit(path)
    print(
        f"meshrun slurm: submitted job {job_id} | script {path} | output "
        f"{slurm_submit.output_files(spec, job_id)} | run dir {run_dir}"
    )
    return 0


def _check_counts(a: argparse.Namespace) -> None:
    """The counts as typed, before defaults fill them in: `--gpus-per-node -1` would otherwise
    surface as a bad --nproc-per-node, and `--cpus-per-task 0` as the default."""
    if a.gpus_per_node < 0:
        raise ConfigError(
            f"--gpus-per-node {a.gpus_per_node} is not allowed: must be >= 0 (0 = CPU nodes)"
        )
    for flag, value in (
        ("--nproc-per-node", a.nproc_per_node),
        ("--cpus-per-task", a.cpus_per_task),
    ):
        if value is not None and value < 1:
            raise ConfigError(
                f"{flag} {value} is not allowed: must be >= 1 (leave it out for the default)"
            )


def build_spec(a: argparse.Namespace) -> tuple[SubmitSpec, Path]:
    """The submit spec from the flags, and the run directory (from the script's config)."""
    require_script("slurm submit", a.target, a.module)
    if a.nodes < 1:  # here, not only in SubmitSpec.validate, to name the spelling typed
        raise ConfigError(f"{a.nodes_flag} {a.nodes} is not allowed: must be >= 1")
    _check_counts(a)
    spec = SubmitSpec(
        target=a.target if a.module else os.path.abspath(a.target),
        module=a.module,
        script_args=list(a.args),
        nodes=a.nodes,
        nproc_per_node=a.nproc_per_node or a.gpus_per_node or 2,
        gpus_per_node=a.gpus_per_node,
        cpus_per_task=a.cpus_per_task or 0,
        partition=a.partition or "",
        time=a.time or "",
        account=a.account or "",
        job_name=a.job_name or "meshrun",
        requeue=a.requeue,
        signal_before_s=a.signal_before,
        workdir=os.getcwd(),
        config=os.path.abspath(a.config) if a.config else "",
        sets=[f"{k}={v}" for k, v in a.set],
        launcher=a.launcher,
    )
    spec.validate()  # the flags first, then the config for the job's world size
    cfg = _checked_config(a, spec.nodes * spec.nproc_per_node)
    run_dir = cfg.resolved_run_dir()
    if spec.direct:  # mpirun/srun: no meshrun launch on the node resolves the config
        max_restarts, groups = cfg.launch.max_restarts, cfg.fault_tolerance.replica_groups
        slurm_submit.check_direct_config(spec.launcher, max_restarts, groups)
        spec.config_toml = to_toml(cfg)
        spec.config_path = str(run_dir.absolute() / "slurm" / "config.toml")
    if spec.signal_before_s and not cfg.checkpoint.on_signal:
        print(
            "meshrun slurm: warning: checkpoint.on_signal = false, so the workers install no "
            f"handler for the SIGUSR1 sent {spec.signal_before_s} s before the time limit and "
            "it stops them without a checkpoint; pass --checkpoint.on_signal=true (save at the "
            "next step, then exit 0) or --signal-before 0",
            file=sys.stderr,
        )
    spec.output_dir = os.path.abspath(a.output or run_dir / "slurm")
    if not a.job_name:
        spec.job_name = "meshrun-" + re.sub(r"[^\w.+-]", "_", run_dir.name)
    return spec, run_dir.absolute()


def _checked_config(a: argparse.Namespace, world: int) -> Config:
    """The config the job will run with, validated for its world size now, not on the nodes."""
    overrides, _ = split_overrides(list(a.args))
    module = a.target if a.module else None
    cfg = load_config(a.config or default_config(module), [*a.set, *overrides])
    validate_for_world(cfg, world)
    return cfg


def add_slurm_parser(sub: Subparsers) -> None:
    ssub = add_group(sub, "slurm", "write and submit SLURM batch jobs")
    s = add_command(
        ssub,
        "submit",
        cmd_slurm_submit,
        help="write an sbatch script running meshrun launch on each node and submit it",
        description="Write RUN_DIR/slurm/job.sbatch (one task per node running meshrun "
        "launch, which derives the topology from SLURM; output per node; SIGUSR1 before the "
        "time limit so the workers checkpoint) and submit it with sbatch.",
    )
    add_node_count(s, type=int, default=1, help="nodes (default 1)")
    s.add_argument("--nproc-per-node", type=int, help="processes per node (default: GPUs, else 2)")
    s.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node (default 0)")
    s.add_argument("--cpus-per-task", type=int, help="CPUs per node (default: nproc)")
    s.add_argument("--partition", help="SLURM partition")
    s.add_argument("--time", help="time limit: MINUTES, HH:MM:SS, D-HH:MM, ...")
    s.add_argument("--account", help="SLURM account")
    s.add_argument("--job-name", help="job name (default meshrun-<run dir name>)")
    s.add_argument("--requeue", action="store_true", help="requeue after a preemption signal")
    s.add_argument(
        "--signal-before",
        type=int,
        default=DEFAULT_SIGNAL_BEFORE_S,
        metavar="S",
        help=f"SIGUSR1 S seconds before the time limit; 0 = none (default "
        f"{DEFAULT_SIGNAL_BEFORE_S})",
    )
    s.add_argument("--output", metavar="DIR", help="output files (default RUN_DIR/slurm)")
    s.add_argument(
        "--launcher",
        choices=slurm_submit.LAUNCHERS,
        default="meshrun",
        help="what starts the workers: meshrun launch per node (default), mpirun, or srun "
        "--mpi=pmix (one task per process; docs/slurm.md)",
    )
    s.add_argument("--dry-run", action="store_true", help="print the script, submit nothing")
    s.add_argument("--config", help="TOML config file for the job")
    add_set(s)
    add_target(s)
