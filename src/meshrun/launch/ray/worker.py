"""What each Ray Train worker runs: the user's script, unchanged, in the worker's own process.

Ray Train has set ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/``LOCAL_WORLD_SIZE``/``NODE_RANK`` and
``MASTER_ADDR``/``MASTER_PORT`` and initialised the process group before ``train_fn`` starts;
``meshrun.init()`` reads the ranks (as under torchrun) and keeps the group. This module adds
what ``meshrun launch`` gives a torchrun worker: the resolved config's path
(``MESHRUN_CONFIG``), the driver's working directory, ``sys.argv``, and an error file for the
failure summary (torch elastic's ``TORCHELASTIC_ERROR_FILE``, which ``@meshrun.main``'s
``record`` writes). Per rank it leaves ``RUN_DIR/logs/ray/rank<r>/{where,exit,error}.json``.
"""

from __future__ import annotations

import json
import os
import runpy
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NoReturn

from torch.distributed.elastic.multiprocessing.errors import record

from meshrun.config import CONFIG_ENV, dp_size_for_world, load_config, split_overrides

__all__ = ["WorkerTask", "rank_dir", "train_fn"]


@dataclass(frozen=True)
class WorkerTask:
    """What the driver sends every worker (Ray's ``train_loop_config``, a plain dict)."""

    config_path: str
    script: str | None
    module: str | None
    script_args: list[str]
    cwd: str
    backend: str  # the one Ray was told to use
    workers: int  # --workers: the largest world
    min_workers: int | None
    logs_dir: str  # RUN_DIR/logs/ray

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class ScriptExit(BaseException):
    """The script left through ``os._exit`` (as ``@meshrun.main`` does). In a Ray worker the
    process is Ray's actor: leaving it would make Ray see a dead worker after a clean run.
    A BaseException so that torch's ``record`` does not write it down as an error."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def rank_dir(logs_dir: str | Path, rank: int) -> Path:
    return Path(logs_dir) / f"rank{rank}"


def train_fn(config: dict[str, Any]) -> None:
    """Ray Train's per-worker function: run the script; a non-zero exit is an error Ray sees
    (and retries under FailureConfig)."""
    task = WorkerTask(**config)
    rank = int(os.environ["RANK"])
    files = rank_dir(task.logs_dir, rank)
    _start_files(files, rank)
    _set_env(task, files)
    _check_backend(task)
    if rank == 0:
        _announce_world(task)
    code = 1  # an exception escaping the script
    try:
        code = _run_script(task)
    finally:
        _write_json(files / "exit.json", {"code": code, "time": time.time()})
    if code != 0:
        host = socket.gethostname()
        raise RuntimeError(
            f"rank {rank} on {host}: the script exited with code {code} (error file, if any: "
            f"{files / 'error.json'})"
        )


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def _start_files(files: Path, rank: int) -> None:
    """A fresh record per attempt: where this rank runs; no error or exit of an older one."""
    files.mkdir(parents=True, exist_ok=True)
    for name in ("error.json", "exit.json"):
        (files / name).unlink(missing_ok=True)
    where = {
        "rank": rank,
        "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
        "node_rank": int(os.environ.get("NODE_RANK", "0")),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "time": time.time(),
    }
    _write_json(files / "where.json", where)


def _set_env(task: WorkerTask, files: Path) -> None:
    os.environ[CONFIG_ENV] = task.config_path
    os.environ["TORCHELASTIC_ERROR_FILE"] = str(files / "error.json")
    # launcher_env.detect reads the node's rank as torchrun names it; Ray names it NODE_RANK.
    os.environ.setdefault("GROUP_RANK", os.environ.get("NODE_RANK", "0"))
    if os.path.isdir(task.cwd):  # relative paths as on the driver (Ray starts elsewhere)
        os.chdir(task.cwd)
    else:
        print(
            f"meshrun ray launch: {task.cwd} (the driver's directory) does not exist on "
            f"{socket.gethostname()}: relative paths resolve against {os.getcwd()}",
            file=sys.stderr,
            flush=True,
        )


def _check_backend(task: WorkerTask) -> None:
    """Ray made the group; meshrun.init() keeps it: its backend must be the one meshrun
    would have chosen here, or the run would use another backend than its config says."""
    import torch.distributed as dist

    from meshrun.runtime.device import pick_device
    from meshrun.runtime.launcher_env import detect

    cfg = load_config(task.config_path, split_overrides(task.script_args)[0])
    _, want = pick_device(cfg, detect())
    got = dist.get_backend() if dist.is_initialized() else "none"
    if got != want:
        raise RuntimeError(
            f"Ray initialised the process group with backend {got!r}, but the config "
            f"(job.backend = {cfg.job.backend!r}, job.device = {cfg.job.device!r}) resolves "
            f"to {want!r} on {socket.gethostname()}: pass --gpus-per-worker to match the "
            "devices, or set --job.backend"
        )


def _announce_world(task: WorkerTask) -> None:
    """One line when the world is not the one asked for, or not the previous attempt's."""
    world = int(os.environ["WORLD_SIZE"])
    record_file = Path(task.logs_dir) / "world_size"
    last = int(record_file.read_text()) if record_file.is_file() else None
    record_file.write_text(str(world))
    if world == task.workers and last in (None, world):
        return
    cfg = load_config(task.config_path, split_overrides(task.script_args)[0])
    micro, batch = cfg.data.micro_batch, cfg.data.global_batch
    accum = batch // (micro * dp_size_for_world(cfg, world)) if batch else 0
    before = f"; the previous start had {last}" if last not in (None, world) else ""
    print(
        f"meshrun ray launch: world size {world} (--workers {task.workers}, --min-workers "
        f"{task.min_workers}{before}): the global batch {batch} is kept, accumulation "
        f"{accum} with micro-batch {micro}",
        file=sys.stderr,
        flush=True,
    )


def _run_script(task: WorkerTask) -> int:
    """Run the script as ``python SCRIPT ARGS`` (or ``-m MODULE``) would, in this thread; its
    exit code (0 when it returns)."""
    saved_argv, saved_path, real_exit = sys.argv, list(sys.path), os._exit
    here = threading.current_thread()

    def leave(code: int) -> NoReturn:
        if threading.current_thread() is here:
            raise ScriptExit(code)
        real_exit(code)

    setattr(os, "_exit", leave)  # noqa: B010 (mypy: a module attribute of another type)
    try:
        record(_run_target)(task)  # an exception escaping the script writes the error file
    except ScriptExit as done:
        return done.code
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    finally:
        setattr(os, "_exit", real_exit)  # noqa: B010
        sys.argv, sys.path[:] = saved_argv, saved_path
    return 0


def _run_target(task: WorkerTask) -> None:
    if task.module:
        sys.argv = [task.module, *task.script_args]
        runpy.run_module(task.module, run_name="__main__", alter_sys=True)
        return
    assert task.script is not None
    sys.argv = [task.script, *task.script_args]
    sys.path.insert(0, os.path.dirname(task.script))  # as `python SCRIPT` puts it first
    runpy.run_path(task.script, run_name="__main__")
