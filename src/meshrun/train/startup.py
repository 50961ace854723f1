"""The steps of ``meshrun.init()``, in the order ``Run.__init__`` (train/run.py) calls them: the
config (file, launcher, argv overrides, the global batch); the process-wide effects (the
device, the process group and its mesh); the run directory and the seeds; the machinery (the
metrics logger, the train state, the step monitor, the checkpointer, ...: one frozen
``Machinery``, train/machinery.py, from which ``Run`` builds its step loop); and at the end
the teardown ``Run.close`` runs. Each is called once per process."""

from __future__ import annotations

import copy
import dataclasses
import ipaddress
import logging
import os
import random
import socket
import sys
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from meshrun.checkpoint import Checkpointer, RunFacts
from meshrun.checkpoint.resumed_batch import resume_global_batch
from meshrun.config import (
    CONFIG_ENV,
    Config,
    ConfigError,
    apply_overrides,
    load_config,
    resolve_global_batch,
    split_overrides,
    to_toml,
    validate_for_world,
)
from meshrun.monitor import MetricsLogger, StepMonitor
from meshrun.parallel.cp import cp_group
from meshrun.parallel.optim_params import FormerParams
from meshrun.runtime.agreement import StepAgreement
from meshrun.runtime.device import pick_device
from meshrun.runtime.hostmem import set_mmap_threshold
from meshrun.runtime.launcher_env import LauncherEnv
from meshrun.runtime.mesh import ParallelDims, build_mesh
from meshrun.runtime.runlock import claim_at_start, release_rank0
from meshrun.runtime.state import TrainState
from meshrun.runtime.storage import check_shared_run_dir
from meshrun.train.machinery import Machinery

if TYPE_CHECKING:  # loaded only under fault_tolerance.replica_groups > 1
    from meshrun.ft.diloco import DiLoCoSync
    from meshrun.ft.replica import ReplicaGroup

__all__ = [
    "Machinery",
    "build_machinery",
    "build_metrics",
    "checkpoint_facts",
    "init_process_group",
    "init_seeds",
    "mesh_text",
    "open_run_dir",
    "pick_device",
    "resolve_batch",
    "resolve_config",
    "shut_down",
    "start_process",
]


def init_process_group(env: LauncherEnv, backend: str, device: torch.device, cfg: Config) -> None:
    if dist.is_initialized():
        return
    if env.kind != "torchelastic":
        # SLURM/MPI give ranks but not torch's env:// variables: fill them in.
        os.environ.update(
            MASTER_ADDR=env.master_addr,
            MASTER_PORT=str(env.master_port),
            RANK=str(env.rank),
            WORLD_SIZE=str(env.world_size),
            LOCAL_RANK=str(env.local_rank),
        )
    timeout = timedelta(seconds=cfg.job.timeout_s)
    dist.init_process_group(
        backend=backend,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
        store=_worker_store(timeout, env.world_size > env.local_world_size),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
    )


def _worker_store(timeout: timedelta, spans_nodes: bool) -> dist.TCPStore:
    """The workers' store at MASTER_ADDR:MASTER_PORT. torch's env:// server listens on every
    interface; here rank 0 binds the socket itself, on MASTER_ADDR only, and hands it over."""
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    world = int(os.environ["WORLD_SIZE"])
    # The agent hosts it when the user shares the rendezvous store (torchrun's default).
    if os.environ["RANK"] != "0" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return dist.TCPStore(addr, port, world, is_master=False, timeout=timeout)
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    try:
        if spans_nodes and ipaddress.ip_address(socket.gethostbyname(addr)).is_loopback:
            # A hostname that /etc/hosts maps to 127.0.1.1: the other nodes could not connect.
            raise OSError(
                0,
                f"it resolves to {socket.gethostbyname(addr)} here, which the "
                "other nodes cannot reach; give rank 0's address on their network",
            )
        sock = socket.create_server((addr, port), family=family, backlog=1024)
    except OSError as err:
        raise RuntimeError(
            f"rank 0 cannot listen on MASTER_ADDR={addr} MASTER_PORT={port} ({err.strerror}): "
            "MASTER_ADDR must be an address of rank 0's node and the port free"
        ) from None
    return dist.TCPStore(
        addr,
        port,
        world,
        is_master=True,
        timeout=timeout,
        wait_for_workers=False,
        master_listen_fd=sock.detach(),
    )


def open_run_dir(cfg: Config, hostname: str) -> Path:
    """The run directory, made, and checked to be one directory for every node that shares
    it (runtime/storage.py) before anything relies on it."""
    run_dir = cfg.resolved_run_dir()
    run_dir.mkdir(parents=True, exist_ok=True)
    check_shared_run_dir(run_dir, hostname)
    return run_dir


def init_seeds(seed: int, rank: int) -> None:
    # Same torch seed everywhere: every rank builds identical initial weights. Dropout's
    # stream is made per data-parallel rank when run.steps begins (loop.seed_per_dp).
    torch.manual_seed(seed)
    # Rank-offset seeds for Python/NumPy: data augmentation differs per rank.
    random.seed(seed + rank)
    np.random.seed((seed + rank) % 2**32)


def resolve_config(
    config: Config | str | Path | None, argv: Sequence[str] | None, keep_argv: bool = False
) -> Config:
    """The config: ``config`` (a Config or a TOML path), else ``MESHRUN_CONFIG``'s file, else
    the defaults; then the ``--section.key=value`` overrides of ``argv`` (default
    ``sys.argv[1:]``). Overrides read from ``sys.argv`` are removed from it once applied
    (unless ``keep_argv``): a script's own strict parser (``parse_args()``, nanoGPT's
    configurator) would reject ``--optim.steps=...`` as unknown; so is the ``--`` that ends
    them, which leaves the arguments after it to the script as written."""
    if config is not None and not isinstance(config, (Config, str, Path)):
        raise ConfigError(
            f"meshrun.init(config={config!r}): a {type(config).__name__} is not a config; pass "
            "a meshrun.Config, the path of a TOML file, or nothing (the launcher's config)"
        )
    overrides, rest = split_overrides(sys.argv[1:] if argv is None else argv)
    if isinstance(config, Config):
        cfg = apply_overrides(copy.deepcopy(config), overrides)
    else:
        path = config if config is not None else os.environ.get(CONFIG_ENV)
        cfg = load_config(path, overrides)
    if argv is None and rest != sys.argv[1:] and not keep_argv:
        sys.argv[1:] = rest  # in place: a reference to sys.argv held elsewhere sees it too
    return cfg


def resolve_batch(cfg: Config, world_size: int) -> str:
    """Fill in an unset data.global_batch; return where it came from ("" when it was set)."""
    if resume_global_batch(cfg) is not None:
        validate_for_world(cfg, world_size)  # the saved batch must divide on this world too
        return "from the checkpoint it resumes"
    return "micro_batch x dp" if resolve_global_batch(cfg, [world_size]) else ""


def start_process(
    cfg: Config, env: LauncherEnv, dims: ParallelDims
) -> tuple[torch.device, str, DeviceMesh | None]:
    """The device, the process group (when launched distributed) and the mesh over it."""
    device, backend = pick_device(cfg, env)
    if device.type == "cpu":  # host memory holds the model: see meshrun/runtime/hostmem.py
        set_mmap_threshold(cfg.job.cpu_mmap_threshold_kib)
    if env.distributed:
        init_process_group(env, backend, device, cfg)
    # One job per run directory (runtime/runlock.py): before this process writes anything in it.
    claim_at_start(cfg.resolved_run_dir(), env.rank, os.environ)
    mesh = build_mesh(dims, device.type) if dist.is_initialized() else None
    return device, backend, mesh


def mesh_text(mesh: DeviceMesh | None) -> str:
    if mesh is None:
        return "none (one process)"
    names = mesh.mesh_dim_names or ()
    return " x ".join(f"{n}={s}" for n, s in zip(names, mesh.shape, strict=True))


def build_metrics(cfg: Config, run_dir: Path, is_main: bool, world_size: int) -> MetricsLogger:
    m = cfg.metrics
    return MetricsLogger(
        run_dir,
        is_main=is_main,
        jsonl=m.jsonl,
        log_every=m.log_every,
        total_steps=cfg.optim.steps,
        progress=m.progress,
        world_size=world_size,
        tensorboard=m.tensorboard,
    )


def build_machinery(
    cfg: Config,
    run_dir: Path,
    accum: int,
    device: torch.device,
    mesh: DeviceMesh | None,
    env: LauncherEnv,
) -> Machinery:
    """Every part ``Run`` drives, built once and in this order: the metrics logger, the train
    state, the one per-step agreement, this group's torchft Manager (replica groups), the step
    monitor, DiLoCo's synchronisation (``fault_tolerance.diloco``), the checkpointer.
    ``accum`` is over every replica group's data-parallel ranks already."""
    metrics = build_metrics(cfg, run_dir, env.rank == 0, env.world_size)
    # What is trained and where it is: the loop advances it, checkpoints save it.
    state = TrainState()
    # The one per-step collective: the loop exchanges it, the checkpoints read it.
    agreement = StepAgreement(device)
    replicas = _replica_group(cfg, mesh, metrics, state)
    monitor = StepMonitor(
        cfg.monitor,
        device=device,
        distributed=dist.is_initialized(),
        hostname=socket.gethostname(),
        metrics=metrics,
        agreement=agreement,
        models=state.models,  # DDP models get their all-reduce timed
    )
    diloco = _diloco(cfg, replicas)
    dp_coord, cp = _dp_coord(cfg, mesh, device), cp_group(mesh)
    facts = checkpoint_facts(cfg, run_dir, accum, device)
    checkpointer = Checkpointer(cfg.checkpoint, facts, state, metrics, agreement)
    if diloco is not None:  # the synchronised weights, the outer optimizer
        checkpointer.register_internal("meshrun_diloco", diloco)
    return Machinery(
        accum=accum,
        global_batch=cfg.data.global_batch,
        micro_batch=cfg.data.micro_batch,
        total_steps=cfg.optim.steps,
        grad_clip=cfg.optim.grad_clip,
        log_every=cfg.metrics.log_every,
        seed=cfg.job.seed,
        dp_coord=dp_coord,
        device=device,
        cp_group=cp,
        metrics=metrics,
        monitor=monitor,
        state=state,
        former=FormerParams(),
        checkpointer=checkpointer,
        replicas=replicas,
        diloco=diloco,
    )


def _replica_group(
    cfg: Config, mesh: DeviceMesh | None, metrics: MetricsLogger, state: TrainState
) -> ReplicaGroup | None:
    """This group's torchft Manager under ``fault_tolerance.replica_groups > 1``, else None."""
    if not cfg.fault_tolerance.enabled:
        return None
    from meshrun.ft.replica import ReplicaGroup

    dp = mesh.get_group("dp").size() if mesh is not None else 1
    return ReplicaGroup(
        cfg.fault_tolerance,
        state,
        metrics,
        dp,
        global_batch=cfg.data.global_batch,
        lr_scaling=cfg.optim.lr_scaling,
    )


def _diloco(cfg: Config, replicas: ReplicaGroup | None) -> DiLoCoSync | None:
    """DiLoCo's synchronisation every H steps (``fault_tolerance.diloco``), else None."""
    if replicas is None or not cfg.fault_tolerance.diloco:
        return None
    from meshrun.ft.diloco import DiLoCoSync

    return DiLoCoSync(cfg.fault_tolerance, replicas)


def _dp_coord(cfg: Config, mesh: DeviceMesh | None, device: torch.device) -> int:
    """This rank's data-parallel coordinate over every replica group (its dropout stream)."""
    if mesh is None:
        return 0
    dp = mesh.get_group("dp")
    if device.type == "cuda":
        # DTensor's first random op would broadcast rank 0's CUDA RNG state over the world
        # (run_state_sync): its tracker is made now without that, so the per-coordinate
        # streams stay (torch.distributed.tensor._random; torchtitan does the same).
        from torch.distributed.tensor import _random as dtensor_random

        if dtensor_random._rng_tracker is None:
            dtensor_random._rng_tracker = dtensor_random.OffsetBasedRNGTracker(
                mesh, run_state_sync=False
            )
    group = cfg.fault_tolerance.group_index if cfg.fault_tolerance.enabled else 0
    return group * dp.size() + dp.rank()


def checkpoint_facts(cfg: Config, run_dir: Path, accum: int, device: torch.device) -> RunFacts:
    """What the checkpoints record and check besides ``[checkpoint]``: the resolved figures."""
    distributed = dist.is_initialized()
    return RunFacts(
        root=Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints",
        rank=dist.get_rank() if distributed else 0,
        world=dist.get_world_size() if distributed else 1,
        device=device,
        accum=accum,
        global_batch=cfg.data.global_batch,
        micro_batch=cfg.data.micro_batch,
        seed=cfg.job.seed,
        lr_scaling=cfg.optim.lr_scaling,
        config_toml=to_toml(cfg),
        config_digest=run_digest(cfg),
    )


def run_digest(cfg: Config) -> str:
    """The config digest the checkpoints record and key node-local snapshots by: the config
    without the lighthouse's address, which is no part of what is trained. A local launch of
    replica groups starts its lighthouse on a new port each time; with the port in it, a new
    launch of the same run could not find its own node-local snapshots."""
    ft = dataclasses.replace(cfg.fault_tolerance, lighthouse="")
    return dataclasses.replace(cfg, fault_tolerance=ft).digest()


def shut_down(parts: Machinery, run_dir: Path, failed: bool) -> None:
    """``Run.close``: the loop's end, the last checkpoint committed (on success), the summary,
    a final barrier (on success) and ``destroy_process_group``, the run directory released."""
    parts.monitor.loop_ends()
    if not failed:
        # An async checkpoint still being written is committed; node-local snapshots go.
        parts.checkpointer.finish()
    parts.metrics.close()
    if dist.is_initialized():
        if not failed:
            # A barrier after a failure would wait for ranks that may never arrive.
            dist.barrier()
        dist.destroy_process_group()
    release_rank0(run_dir)  # this job is over: the directory is free for the next
    for h in logging.getLogger("meshrun").handlers:
        h.flush()
