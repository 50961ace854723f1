"""``meshrun launch --hostfile``: the typed request and its loaded config turned into the
:class:`HostfilePlan` launch/hostfile/remote.py runs, every conflict refused before any ssh."""

from __future__ import annotations

import os
import re
import shlex
import sys
import uuid
from collections.abc import Mapping, Sequence

from meshrun.config import Config, validate_for_world
from meshrun.launch.front.request import LaunchRequest
from meshrun.launch.hostfile.hosts import HostEntry, HostfileError, HostfilePlan, parse_hostfile
from meshrun.launch.spec import parse_nnodes

SSH_ENV = "MESHRUN_SSH"  # extra ssh arguments, shell-quoted, e.g. "-i ~/.ssh/cluster_key"

# What reaches the remote meshrun launch: what configures meshrun, threads, the collective
# libraries and the import path. Never names that look like credentials, whatever the prefix.
FORWARD_NAMES = ("OMP_NUM_THREADS", "PYTHONPATH")
FORWARD_PREFIXES = ("MESHRUN_", "NCCL_", "GLOO_", "TORCH_")
_LAUNCHER_ONLY = {SSH_ENV, "MESHRUN_CONFIG"}  # the remote launch writes its own config path
_SECRET = re.compile(r"TOKEN|SECRET|PASSW|CREDENTIAL|KEY", re.IGNORECASE)


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


def nproc_for(hosts: Sequence[HostEntry], default: int | None, source: str) -> int | None:
    """The processes per host: every host must run the same number (see the error)."""
    counts = {h.slots or default for h in hosts}
    if len(counts) > 1:
        listing = ", ".join(f"{h.label}={h.slots or default}" for h in hosts)
        raise HostfileError(
            f"{source}: hosts have different process counts ({listing}); meshrun validates "
            "the layout for nproc x nnodes, so give every host the same slots=N (or none and "
            "--nproc-per-node)"
        )
    return counts.pop()


def ssh_options(opts: Sequence[str], environ: Mapping[str, str]) -> list[str]:
    """``--ssh-opt KEY=VALUE`` flags as ``-o KEY=VALUE``, then ``$MESHRUN_SSH`` (shell words)."""
    args = []
    for opt in opts:
        if "=" not in opt or opt.startswith("-"):
            raise HostfileError(
                f"--ssh-opt {opt!r}: expected an ssh option as KEY=VALUE (ssh -o), e.g. "
                "IdentityFile=~/.ssh/cluster; other ssh arguments go in $MESHRUN_SSH"
            )
        args += ["-o", opt]
    try:
        return args + shlex.split(environ.get(SSH_ENV, ""))
    except ValueError as err:
        raise HostfileError(f"${SSH_ENV} is not valid shell words: {err}") from None


def forwarded_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The launcher's variables that the remote launch gets (docs/hostfile.md lists them)."""
    env = {
        name: value
        for name, value in environ.items()
        if (name in FORWARD_NAMES or name.startswith(FORWARD_PREFIXES))
        and name not in _LAUNCHER_ONLY
        and not _SECRET.search(name)
    }
    # Remote output goes through a pipe: unbuffered, so it streams line by line.
    env["PYTHONUNBUFFERED"] = "1"
    return dict(sorted(env.items()))
