"""``meshrun launch --hostfile``: the typed request and its loaded config turned into the
:class:`HostfilePlan` launch/hostfile/remote.py runs, every conflict refused before any ssh."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Mapping

from meshrun.config import Config, validate_for_world
from meshrun.launch.front.request import LaunchRequest
from meshrun.launch.hostfile.hosts import (
    HostfileError,
    HostfilePlan,
    forwarded_env,
    nproc_for,
    parse_hostfile,
    ssh_options,
)
from meshrun.launch.spec import parse_nnodes


def launch_from_request(request: LaunchRequest, cfg: Config, environ: Mapping[str, str]) -> int:
    """Build the plan, check the hosts, run."""
    from meshrun.launch.hostfile.remote import (  # threads, ssh: on use
        EXIT_INTERRUPTED,
        launch_hostfile,
    )

    plan = plan_from_request(request, cfg, environ, os.getcwd(), sys.executable)
    try:
        return launch_hostfile(plan)
    except KeyboardInterrupt:  # during the host check: nothing was started yet
        print("meshrun launch --hostfile: interrupted; nothing started", file=sys.stderr)
        return EXIT_INTERRUPTED


def plan_from_request(
    request: LaunchRequest, cfg: Config, environ: Mapping[str, str], cwd: str, python: str
) -> HostfilePlan:
    """The plan for ``meshrun launch --hostfile`` from its request and loaded config; every
    conflict is an error here, before any ssh."""
    source = request.hostfile or ""
    hosts = parse_hostfile(source)
    flags = request.torchrun
    if flags.node_rank is not None:  # the hostfile decides it: host i is node rank i
        raise HostfileError(
            "--node-rank cannot go with --hostfile: host i of the file is node rank i"
        )
    nodes = parse_nnodes(flags.nnodes) if flags.nnodes is not None else None
    if nodes is not None and (nodes.elastic or nodes.max_nodes != len(hosts)):
        raise HostfileError(
            f"--nnodes {flags.nnodes!r} does not match --hostfile {source!r}, which lists "
            f"{len(hosts)} hosts; drop --nnodes (elastic MIN:MAX is not available with a hostfile)"
        )
    nproc_flag = flags.nproc_per_node if isinstance(flags.nproc_per_node, int) else None
    default = nproc_flag or cfg.launch.nproc_per_node or None
    nproc = nproc_for(hosts, default, source)
    if nproc is not None:
        validate_for_world(cfg, nproc * len(hosts))
    return HostfilePlan(
        hosts=hosts,
        nproc_per_node=nproc,
        launch_args=forward_flags(request),
        cwd=cwd,
        python=python,
        rdzv_endpoint=flags.rdzv_endpoint or cfg.launch.rdzv_endpoint,
        rdzv_id=flags.rdzv_id or f"meshrun-{uuid.uuid4().hex[:8]}",
        env=forwarded_env(environ),
        ssh_args=ssh_options(list(request.ssh_opts), environ),
        source=source,
    )


def forward_flags(request: LaunchRequest) -> list[str]:
    """The launch flags every host's ``meshrun launch`` gets as given, then the target."""
    forwarded = (
        ("--config", request.config),
        ("--max-restarts", request.torchrun.max_restarts),
        ("--interface", request.interface),
        ("--join-timeout", request.join_timeout),
    )
    flags = []
    for flag, value in forwarded:
        if value is not None:
            flags += [flag, str(value)]
    for key, value in request.sets:
        flags += ["--set", f"{key}={value}"]
    return [*flags, *(["-m"] if request.module else []), request.target or "", *request.args]
