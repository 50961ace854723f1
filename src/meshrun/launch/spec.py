"""One launch, typed: the ``[launch]`` text parsed once into values every backend reads.

``LaunchConfig`` keeps the config file's spelling (``nnodes = "2:4"``, ``rdzv_endpoint =
"10.0.0.1:29500"``, ``nproc_per_node = 0`` for auto); a :class:`LaunchSpec` is made from it
once, with the node range, the endpoint and the rendezvous options as typed values
(:class:`Rendezvous`) and the process count this launch resolved (``procs_per_node``, always a
count). The checks, the network plan, the run directory's lock, the handshake and torchrun's
arguments all read the spec; none of them parses the config's strings again.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from meshrun.config import LaunchConfig
from meshrun.config import launch_values as values
from meshrun.launch.multinode.records import JoinTarget


def parse_nnodes(text: str) -> JoinTarget:
    """``"2"`` or ``"2:3"`` (elastic MIN:MAX) as a JoinTarget; errors name the flag."""
    return JoinTarget(*values.nnodes_range(text))


@dataclass(frozen=True)
class Rendezvous:
    """A launch's rendezvous, its ``[launch]`` text parsed once into typed values (``nnodes``
    N or MIN:MAX, ``rdzv_endpoint`` HOST:PORT, ``rdzv_conf`` KEY=VALUE,...): what the checks,
    the network plan, the run directory's lock and torchrun's arguments read."""

    nodes: JoinTarget = field(default_factory=lambda: JoinTarget(1, 1))
    endpoint: tuple[str, int] | None = None  # None: one node on a free loopback port
    conf: tuple[tuple[str, str], ...] = ()  # the user's --rdzv-conf, in order
    rdzv_id: str = "meshrun"
    node_rank: int = 0

    @classmethod
    def of(cls, launch: LaunchConfig) -> Rendezvous:
        """Parse ``launch``'s values (errors name the flag and the key)."""
        text = launch.rdzv_endpoint
        endpoint = values.parse_endpoint(text) if text else None
        conf = tuple(values.parse_rdzv_conf(launch.rdzv_conf).items())
        return cls(parse_nnodes(launch.nnodes), endpoint, conf, launch.rdzv_id, launch.node_rank)

    @property
    def multinode(self) -> bool:
        """More than one node may join, or an endpoint was given (then it is used as is)."""
        return self.endpoint is not None or self.nodes.max_nodes > 1

    @property
    def endpoint_text(self) -> str:
        return "" if self.endpoint is None else f"{self.endpoint[0]}:{self.endpoint[1]}"


@dataclass(frozen=True)
class LaunchSpec:
    """What to launch and how; the CLI and tests build one (:meth:`of`), ``launch_local`` runs
    it and every backend reads it.

    Composed, not a LaunchConfig: the config's shaped text arrives parsed (``rendezvous``),
    its plain keys copied as they are, and the processes per node as the count this launch
    resolved (``procs_per_node`` >= 1; the config's ``nproc_per_node`` may be 0 = auto)."""

    procs_per_node: int = 0  # the resolved count; build_torchrun_args refuses < 1
    rendezvous: Rendezvous = field(default_factory=Rendezvous)
    # The plain [launch] keys (LaunchConfig checked them): restarts, threads, network, timeout.
    max_restarts: int = 0
    omp_num_threads: int = 0  # 0: cores / processes (launch/agent/environment.py)
    interface: str = ""
    join_timeout_s: float = 300.0
    script: str | None = None  # path of a Python script, or
    module: str | None = None  # a module to run with -m (exactly one of script/module)
    script_args: list[str] = field(default_factory=list)
    config_digest: str = ""  # multi-node: what the nodes compare (multinode.shared_digest)
    shared_config: dict[str, Any] = field(default_factory=dict)  # names the keys that differ
    config_path: str | None = None  # exported to the workers as MESHRUN_CONFIG
    run_dir: str = "runs/launch"  # the agent's per-rank logs go to RUN_DIR/logs
    extra_env: dict[str, str] = field(default_factory=dict)
    # torchrun's own flags as the user gave them (launch/front/torchrun.py's resolve):
    rdzv_backend: str = "c10d"  # or "static": torchrun's --master-addr/--master-port launch
    tee: str = ""  # torchrun's --tee; "" = stderr only ("2"), so stdout is torchrun's own
    redirects: str = ""  # torchrun's --redirects; "" = none
    log_dir_flag: str = ""  # torchrun's --log-dir; "" = RUN_DIR/logs
    local_addr: str = ""  # torchrun's --local-addr; "" = loopback, or the chosen interface's
    torchrun_args: list[str] = field(default_factory=list)  # the rest, handed to the agent
    # --replica-groups N (> 1: N torchrun jobs, launch/replicas.py) and --lighthouse HOST:PORT
    replica_groups: int = 0
    lighthouse: str = ""

    @classmethod
    def of(cls, launch: LaunchConfig, procs_per_node: int = 0, **fields: Any) -> LaunchSpec:
        """The spec of ``launch`` (its rendezvous text parsed here, once) and ``fields`` (what
        to run, torchrun's flags). ``procs_per_node``: the count this launch resolved; 0 takes
        the config's ``nproc_per_node`` as it is."""
        return cls(
            procs_per_node=procs_per_node or launch.nproc_per_node,
            rendezvous=Rendezvous.of(launch),
            max_restarts=launch.max_restarts,
            omp_num_threads=launch.omp_num_threads,
            interface=launch.interface,
            join_timeout_s=launch.join_timeout_s,
            **fields,
        )

    @property
    def log_dir(self) -> str:
        return self.log_dir_flag or os.path.join(self.run_dir, "logs")


@dataclass(frozen=True)
class LaunchKeys:
    """The flags of ``meshrun launch`` (and ``meshrun bench``) that override ``[launch]`` keys
    of the same name (None: not given, the config's value stays), in the order applied."""

    nproc_per_node: int | None = None
    nnodes: str | None = None
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    rdzv_conf: str | None = None
    max_restarts: int | None = None
    interface: str | None = None
    join_timeout: float | None = None  # the key is launch.join_timeout_s

    def over(self, base: LaunchKeys) -> LaunchKeys:
        """These values where set (not None), else ``base``'s."""
        mine = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return dataclasses.replace(base, **{k: v for k, v in mine.items() if v is not None})
