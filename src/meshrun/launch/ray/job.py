"""The driver side of ``meshrun ray launch``: Ray Train's ``TorchTrainer`` runs the script.

Ray (the ``ray`` extra) is imported here only, when a job starts. The job is Ray Train V2's
(the default of ray 2.60; ``RAY_TRAIN_V2_ENABLED=0`` selects V1, which has no elastic
``num_workers=(min, max)``): ``ScalingConfig`` places one process per worker,
``FailureConfig(max_failures)`` retries a failed worker group, and ``TorchConfig`` tells Ray
which backend to initialise the group with (the one ``meshrun.init()`` would choose). See
docs/ray.md.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from meshrun.config import ConfigError
from meshrun.launch.hostfile.plan import forwarded_env
from meshrun.launch.ray.failures import read_failures, summarize
from meshrun.launch.ray.worker import WorkerTask, train_fn

__all__ = ["RayLaunchSpec", "import_ray", "launch_ray"]

# Ray's defaults that do not fit a training launcher, set unless the user set them:
# every rank's lines (not "[repeated 2x across cluster]"), each line printed once (V2's print
# patch logs every print a second time), and minutes, not 60 s, for a worker group to start
# (measured here: 62 s for 2 workers importing torch on a loaded 2-core machine).
RAY_DEFAULTS = {
    "RAY_DEDUP_LOGS": "0",
    "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "600",
}


@dataclass(frozen=True)
class RayLaunchSpec:
    workers: int
    min_workers: int | None
    address: str | None  # None: a local Ray runtime for this job
    cpus_per_worker: float
    gpus_per_worker: float
    max_restarts: int
    script: str | None
    module: str | None
    script_args: list[str]
    config_path: str
    run_dir: str
    backend: str
    timeout_s: int

    @property
    def logs_dir(self) -> Path:
        return Path(self.run_dir) / "logs" / "ray"


def import_ray() -> ModuleType:
    try:
        import ray
        import ray.train.torch  # TorchTrainer: fails without ray[train]
    except ImportError as e:
        raise ConfigError(
            f"meshrun ray launch needs Ray Train, which is not installed ({e}): install the "
            "`ray` extra, pip install 'meshrun[ray]' (or pip install 'ray[train]')"
        ) from None
    return ray


def launch_ray(spec: RayLaunchSpec) -> int:
    """Run the job; the exit code (0, or the first failed rank's)."""
    for name, value in RAY_DEFAULTS.items():
        os.environ.setdefault(name, value)
    ray = import_ray()
    _start(ray, spec)
    try:
        return _fit(spec)
    finally:
        ray.shutdown()  # a local runtime stops with it; a cluster is only disconnected


def _start(ray: ModuleType, spec: RayLaunchSpec) -> None:
    env = forwarded_env(os.environ)  # what meshrun's hostfile launch forwards, no secrets
    env.update({k: os.environ[k] for k in RAY_DEFAULTS})
    runtime_env = {"env_vars": env}
    if spec.address:
        print(f"meshrun ray launch: joining the Ray cluster at {spec.address}", file=sys.stderr)
        try:
            ray.init(address=spec.address, runtime_env=runtime_env)
        except ConnectionError as e:
            raise ConfigError(
                f"--address {spec.address}: cannot join a Ray cluster there ({e}). Check the "
                "address (`ray status` on the head prints it); a cluster with token "
                "authentication (ray 2.5x's default for `ray start`) also needs "
                "RAY_AUTH_MODE=token here, with its token in ~/.ray/auth_token or "
                "RAY_AUTH_TOKEN_PATH"
            ) from None
        return
    _check_local_fit(spec)
    print("meshrun ray launch: starting a local Ray runtime for this job", file=sys.stderr)
    # address="local": a new runtime even if RAY_ADDRESS names a cluster (--address is the way).
    ray.init(address="local", include_dashboard=False, runtime_env=runtime_env)


def _check_local_fit(spec: RayLaunchSpec) -> None:
    """A local runtime offers this machine's cores: a job that cannot fit would wait forever."""
    cores = os.cpu_count() or 1
    least = spec.min_workers or spec.workers
    if least * spec.cpus_per_worker > cores:
        raise ConfigError(
            f"--workers {least} x --cpus-per-worker {spec.cpus_per_worker:g} needs "
            f"{least * spec.cpus_per_worker:g} CPUs, this machine has {cores}: lower "
            "--cpus-per-worker (e.g. 0.5), or join a cluster with --address"
        )


def _trainer(spec: RayLaunchSpec) -> Any:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from meshrun.launch.ray.callback import RestartAnnouncer

    task = WorkerTask(
        config_path=spec.config_path,
        script=spec.script,
        module=spec.module,
        script_args=spec.script_args,
        cwd=os.getcwd(),
        backend=spec.backend,
        workers=spec.workers,
        min_workers=spec.min_workers,
        logs_dir=str(spec.logs_dir),
    )
    resources = {"CPU": spec.cpus_per_worker}
    if spec.gpus_per_worker:
        resources["GPU"] = spec.gpus_per_worker
    # Any: mypy reads Ray Train V1's annotations, which know no (min, max) or V2 callbacks.
    workers: Any = (spec.min_workers, spec.workers) if spec.min_workers else spec.workers
    callbacks: list[Any] = [RestartAnnouncer(spec.max_restarts, str(spec.logs_dir))]
    return TorchTrainer(
        train_fn,
        train_loop_config=task.to_dict(),
        torch_config=TorchConfig(backend=spec.backend, timeout_s=spec.timeout_s),
        scaling_config=ScalingConfig(
            num_workers=workers,
            use_gpu=spec.gpus_per_worker > 0,
            resources_per_worker=resources,
        ),
        run_config=RunConfig(
            name="train",
            storage_path=str(Path(spec.run_dir) / "ray"),
            failure_config=FailureConfig(max_failures=spec.max_restarts),
            callbacks=callbacks,
        ),
    )


def _fit(spec: RayLaunchSpec) -> int:
    from ray.train import WorkerGroupError

    trainer = _trainer(spec)
    try:
        trainer.fit()
    except WorkerGroupError as e:
        text, code = summarize(read_failures(spec.logs_dir, e.worker_failures))
        print(text, file=sys.stderr)
        return code
    return 0
