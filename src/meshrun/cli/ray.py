"""``meshrun ray launch``: the same script on a Ray cluster, started by Ray Train's TorchTrainer.

The command checks and writes the resolved config exactly as ``meshrun launch`` does
(launch/prepare.py), then hands the job to ``ray_job.launch_ray``. Ray itself is imported only
there, lazily: ``meshrun --help`` and ``import meshrun`` never pay for it. See docs/ray.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from meshrun.cli.args import Subparsers, add_set, add_target
from meshrun.config import Config, ConfigError, load_config, split_overrides
from meshrun.launch.multinode.records import JoinTarget
from meshrun.launch.prepare import prepare
from meshrun.launch.target import default_config, require_script

__all__ = ["add_parser"]


def _check_flags(a: argparse.Namespace) -> None:
    """Every flag's range, before a config is read or Ray is imported."""
    if a.workers < 1:
        raise ConfigError(f"--workers {a.workers} is not allowed: must be >= 1")
    low = a.min_workers
    if low is not None and not 1 <= low <= a.workers:
        raise ConfigError(
            f"--min-workers {low} is not allowed: must be between 1 and --workers {a.workers}; "
            "leave it out for a fixed number of workers"
        )
    if a.cpus_per_worker <= 0:
        raise ConfigError(f"--cpus-per-worker {a.cpus_per_worker} is not allowed: must be > 0")
    if a.gpus_per_worker < 0:
        raise ConfigError(f"--gpus-per-worker {a.gpus_per_worker} is not allowed: must be >= 0")
    if a.max_restarts < 0:
        raise ConfigError(f"--max-restarts {a.max_restarts} is not allowed: must be >= 0")


def ray_backend(cfg: Config, gpus_per_worker: float) -> str:
    """The backend Ray must initialise the process group with: the one ``meshrun.init()``
    would choose on these workers (nccl with GPUs, gloo without), checked before Ray starts."""
    job = cfg.job
    if gpus_per_worker == 0 and (job.backend == "nccl" or job.device == "cuda"):
        key = "job.backend = 'nccl'" if job.backend == "nccl" else "job.device = 'cuda'"
        raise ConfigError(
            f"{key} needs GPUs, but --gpus-per-worker is 0: pass --gpus-per-worker 1 "
            "(one GPU per worker), or set job.backend=gloo / job.device=cpu"
        )
    if job.backend != "auto":
        return job.backend
    if job.device == "cpu":
        return "gloo"
    return "nccl" if gpus_per_worker > 0 else "gloo"


def _warn_limits(cfg: Config, max_restarts: int) -> None:
    # Said, never silent: what a Ray worker cannot do that a torchrun worker does.
    if max_restarts and cfg.checkpoint.resume != "auto":
        print(
            f"meshrun ray launch: checkpoint.resume = {cfg.checkpoint.resume!r}: a retried "
            "worker group does not resume from the newest checkpoint (set "
            "--checkpoint.resume=auto for that)",
            file=sys.stderr,
        )
    if cfg.checkpoint.on_signal:
        print(
            "meshrun ray launch: checkpoint.on_signal has no effect under Ray: the script runs "
            "in a Ray worker's thread, where Python installs no signal handler; Ray's own "
            "failure handling and the checkpoint interval apply",
            file=sys.stderr,
        )


def _cmd_launch(a: argparse.Namespace) -> int:
    from meshrun.launch.ray.job import RayLaunchSpec, launch_ray

    require_script("ray launch", a.target, a.module)
    module = a.target if a.module else None
    _check_flags(a)
    overrides, _ = split_overrides(list(a.args))
    cfg = load_config(a.config or default_config(module), [*a.set, *overrides])
    backend = ray_backend(cfg, a.gpus_per_worker)
    # One Ray worker is one process: a --min-workers job is meshrun launch's MIN:MAX of
    # one-process nodes, so the batch is resolved over every world it may take.
    nodes = JoinTarget(a.min_workers or a.workers, a.workers)
    config_path = prepare(cfg, 1, nodes).resolve()
    _warn_limits(cfg, a.max_restarts)
    spec = RayLaunchSpec(
        workers=a.workers,
        min_workers=a.min_workers,
        address=a.address,
        cpus_per_worker=a.cpus_per_worker,
        gpus_per_worker=a.gpus_per_worker,
        max_restarts=a.max_restarts,
        script=None if module else str(Path(a.target).resolve()),
        module=module,
        script_args=list(a.args),
        config_path=str(config_path),
        run_dir=str(cfg.resolved_run_dir().resolve()),
        backend=backend,
        timeout_s=int(cfg.job.timeout_s),
    )
    return launch_ray(spec)


def add_parser(sub: Subparsers) -> None:
    """``meshrun ray launch``."""
    p = sub.add_parser("ray", help="run a training script on a Ray cluster (the `ray` extra)")
    rsub = p.add_subparsers(dest="ray_cmd", required=True)
    launch = rsub.add_parser(
        "launch",
        help="start the script in Ray Train workers (TorchTrainer)",
        description="Run SCRIPT (or -m MODULE) in N Ray Train workers, one process each; Ray "
        "sets the ranks and initialises the process group, meshrun.init() uses it. Arguments "
        "after the script go to it; --section.key=value among them override the config, "
        "which is validated before Ray starts. See docs/ray.md.",
    )
    launch.add_argument("--workers", type=int, required=True, help="Ray workers (processes)")
    launch.add_argument(
        "--address",
        help="Ray cluster to join (ray://HOST:10001, HOST:6379 or auto); default: start a "
        "local Ray runtime and stop it after",
    )
    launch.add_argument(
        "--cpus-per-worker", type=float, default=1.0, help="CPUs Ray reserves per worker (1)"
    )
    launch.add_argument(
        "--gpus-per-worker", type=float, default=0.0, help="GPUs per worker (0: CPU and Gloo)"
    )
    launch.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="times Ray retries a failed worker group (FailureConfig(max_failures)); the "
        "script resumes from the newest checkpoint",
    )
    launch.add_argument(
        "--min-workers",
        type=int,
        help="elastic: start with as few as M workers when no more fit (the global batch is "
        "kept; accumulation absorbs it)",
    )
    launch.add_argument("--config", help="TOML config file")
    add_set(launch)
    add_target(launch)
    launch.set_defaults(fn=_cmd_launch)
