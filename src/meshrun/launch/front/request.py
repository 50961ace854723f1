"""One ``meshrun launch`` as its command line asked for it, typed and frozen: what the command
line builds from its parsed flags and hands to :func:`meshrun.launch.front.run`.

:class:`TorchrunFlags` holds torchrun's flags (one field per row of launch/torchrun_flags.py's
table, None = not given). Plain data: what the flags mean is launch/front/torchrun.py's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from meshrun.launch.torchrun_flags import FLAGS, Flag


@dataclass(frozen=True)
class TorchrunFlags:
    """torchrun's flags on ``meshrun launch`` as parsed (None: not given); the field names are
    the table's ``dest`` names (a unit test keeps the two equal)."""

    nproc_per_node: int | str | None = None  # a count, or a device word (auto, gpu, ...)
    nnodes: str | None = None  # N or MIN:MAX as typed; read through launch/spec.parse_nnodes
    max_restarts: int | None = None
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    rdzv_conf: str | None = None
    rdzv_backend: str | None = None
    standalone: bool | None = None
    master_addr: str | None = None
    master_port: int | None = None
    local_addr: str | None = None
    log_dir: str | None = None
    redirects: str | None = None
    tee: str | None = None
    monitor_interval: float | None = None
    start_method: str | None = None
    event_log_handler: str | None = None
    role: str | None = None
    no_python: bool | None = None
    run_path: bool | None = None
    local_ranks_filter: str | None = None
    duplicate_stdout_filters: str | None = None
    duplicate_stderr_filters: str | None = None
    logs_specs: str | None = None
    numa_binding: str | None = None
    signals_to_handle: str | None = None
    shutdown_timeout: int | None = None
    virtual_local_rank: bool | None = None

    @classmethod
    def of(cls, parsed: Mapping[str, Any]) -> TorchrunFlags:
        """The table's flags out of ``parsed`` (a parser's values by ``dest``; absent = None)."""
        return cls(**{f.dest: parsed.get(f.dest) for f in FLAGS})

    def value(self, flag: Flag) -> Any:
        return getattr(self, flag.dest)


@dataclass(frozen=True)
class LaunchRequest:
    """Everything ``meshrun launch`` was asked: what to run, the config and its overrides, how
    to reach other hosts, torchrun's flags and meshrun's own (replica groups)."""

    target: str | None = None  # a script (or program, --no-python), or a module with -m
    module: bool = False  # -m: ``target`` is a module
    args: tuple[str, ...] = ()  # the script's: --section.key=value overrides and its own
    config: str | None = None  # --config FILE
    sets: tuple[tuple[str, str], ...] = ()  # --set SECTION.KEY=VALUE, in order
    secret_file: str | None = None
    hostfile: str | None = None
    ssh_opts: tuple[str, ...] = ()  # --ssh-opt KEY=VALUE (with --hostfile)
    interface: str | None = None
    join_timeout: float | None = None
    replica_groups: int | None = None
    lighthouse: str | None = None
    torchrun: TorchrunFlags = field(default_factory=TorchrunFlags)

    @property
    def module_name(self) -> str | None:
        return self.target if self.module else None
