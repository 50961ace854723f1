"""``meshrun slurm submit``: write an sbatch script next to the run and submit it."""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from meshrun.cliargs import add_set, add_target, default_config
from meshrun.config import Config, ConfigError, load_config, split_overrides, validate_for_world
from meshrun.launch.slurm import DEFAULT_SIGNAL_BEFORE_S, SubmitSpec, render_sbatch, submit


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
    out = Path(spec.output_dir)
    print(
        f"meshrun slurm: submitted job {job_id} | script {path} | output "
        f"{out / f'{spec.job_name}-{job_id}.out'} (batch script), "
        f"{out / f'{spec.job_name}-{job_id}-node<N>.out'} (one per node) | run dir {run_dir}"
    )
    return 0


def build_spec(a: argparse.Namespace) -> tuple[SubmitSpec, Path]:
    """The submit spec from the flags, and the run directory (from the script's config)."""
    if not a.target:
        raise ConfigError("meshrun slurm submit needs a script (train.py) or -m MODULE")
    if not a.module and not Path(a.target).is_file():
        raise ConfigError(f"script {a.target!r} does not exist")
    spec = SubmitSpec(
        target=a.target if a.module else os.path.abspath(a.target),
        module=a.module,
        script_args=list(a.args),
        nodes=a.nodes,
        nproc_per_node=a.nproc_per_node or a.gpus_per_node or 2,
        gpus_per_node=a.gpus_per_node,
        cpus_per_task=a.cpus_per_task,
        partition=a.partition or "",
        time=a.time or "",
        account=a.account or "",
        job_name=a.job_name or "meshrun",
        requeue=a.requeue,
        signal_before_s=a.signal_before,
        workdir=os.getcwd(),
        config=os.path.abspath(a.config) if a.config else "",
        sets=[f"{k}={v}" for k, v in a.set],
    )
    spec.validate()  # the flags first, then the config for the job's world size
    cfg = _checked_config(a, spec.nodes * spec.nproc_per_node)
    run_dir = cfg.resolved_run_dir()
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


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("slurm", help="write and submit SLURM batch jobs")
    ssub = p.add_subparsers(dest="slurm_cmd", required=True)
    s = ssub.add_parser(
        "submit",
        help="write an sbatch script running meshrun launch on each node and submit it",
        description="Write RUN_DIR/slurm/job.sbatch (one task per node running meshrun "
        "launch, which derives the topology from SLURM; output per node; SIGUSR1 before the "
        "time limit so the workers checkpoint) and submit it with sbatch.",
    )
    s.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    s.add_argument("--nproc-per-node", type=int, help="processes per node (default: GPUs, else 2)")
    s.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node (default 0)")
    s.add_argument("--cpus-per-task", type=int, default=0, help="CPUs per node (default: nproc)")
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
    s.add_argument("--dry-run", action="store_true", help="print the script, submit nothing")
    s.add_argument("--config", help="TOML config file for the job")
    add_set(s)
    add_target(s)
    s.set_defaults(fn=cmd_slurm_submit)
