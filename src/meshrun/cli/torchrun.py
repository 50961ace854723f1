"""torchrun's flags on ``meshrun launch``'s command line: added to its parser, and what a parsed
set of them means for the launch (rendezvous, output streams, node count, what cannot go with
--hostfile). The table itself, and the pure value rules, are launch/torchrun_flags.py's.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from meshrun.config import Config, ConfigError, apply_overrides
from meshrun.launch.spec import parse_nnodes
from meshrun.launch.torchrun_flags import (
    BACKENDS,
    FLAGS,
    HOSTFILE_FLAGS,
    METAVARS,
    STATIC_DEFAULT_ADDR,
    STATIC_DEFAULT_PORT,
    Flag,
    flag_argv,
    output_streams,
    resolve_nproc,
    torchrun_nproc,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Every flag of the table on ``p`` (a group in --help); unset flags stay None."""
    group = p.add_argument_group(
        "torchrun's flags",
        "every torchrun flag, in both spellings (--nproc-per-node or --nproc_per_node), with "
        "torchrun's meaning (docs/launch.md: torchrun compatibility)",
    )
    add_replica_arguments(p)
    for flag in FLAGS:
        _add_flag(group, flag)


# The torchrun flags that place one node in a multi-node job (``meshrun bench`` takes them too).
NODE_FLAGS = ("nnodes", "node_rank", "rdzv_endpoint", "rdzv_id")


def add_node_arguments(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The table's :data:`NODE_FLAGS`, spelled and checked as on ``meshrun launch`` (unset:
    None); :func:`apply_launch_flags` turns them into ``[launch]`` keys."""
    group = p.add_argument_group("multi-node (as meshrun launch; docs/launch.md)")
    for flag in FLAGS:
        if flag.dest in NODE_FLAGS:
            _add_flag(group, flag)
    return group


def _add_flag(group: Any, flag: Flag) -> None:
    if flag.type is None:
        group.add_argument(
            *flag.options, dest=flag.dest, action="store_true", default=None, help=flag.help
        )
        return
    group.add_argument(
        *flag.options,
        dest=flag.dest,
        type=flag.type,
        choices=flag.choices,
        metavar=None if flag.choices else METAVARS.get(flag.dest, "NAME"),
        help=flag.help,
    )


def add_replica_arguments(p: argparse.ArgumentParser) -> None:
    """meshrun's own flags for replica-group fault tolerance (docs/fault_tolerance.md)."""
    group = p.add_argument_group(
        "replica groups (torchft)",
        "split the processes into groups that survive each other's failures "
        "(docs/fault_tolerance.md)",
    )
    group.add_argument(
        "--replica-groups",
        type=int,
        default=None,
        metavar="N",
        help="N replica groups of nproc-per-node / N processes each, each its "
        "own torchrun job (1 = off); without it, fault_tolerance.replica_groups > 1 makes "
        "this launch one group of that many (one launch per group)",
    )
    group.add_argument(
        "--lighthouse",
        default=None,
        metavar="HOST:PORT",
        help="torchft's lighthouse (`meshrun lighthouse`); default: meshrun "
        "starts one on loopback for this job",
    )


def given(a: argparse.Namespace) -> list[Flag]:
    """The table's flags set on the command line."""
    return [f for f in FLAGS if getattr(a, f.dest, None) is not None]


def passthrough_argv(a: argparse.Namespace) -> list[str]:
    """The passed-through flags the user gave, as torchrun argv."""
    return [arg for f in given(a) if f.passed for arg in flag_argv(f, getattr(a, f.dest))]


def env_defaults(a: argparse.Namespace, environ: Mapping[str, str]) -> list[str]:
    """torchrun's ``PET_<FLAG>`` environment defaults (Kubeflow's PyTorchJob sets them) for
    the flags not given on the command line; a note for each one taken."""
    notes = []
    for flag in FLAGS:
        env_name = f"PET_{flag.dest.upper()}"
        text = environ.get(env_name)
        if text is None or getattr(a, flag.dest, None) is not None:
            continue
        try:  # torchrun's reading: a switch is an int (0/1), a value its flag's type
            value = bool(int(text)) if flag.type is None else flag.type(text)
        except ValueError:
            kind = "0 or 1" if flag.type is None else getattr(flag.type, "__name__", "a value")
            raise ConfigError(
                f"{env_name}={text!r} (torchrun's default for {flag.name}) "
                f"is not allowed: expected {kind}"
            ) from None
        if flag.choices and value not in flag.choices:
            raise ConfigError(
                f"{env_name}={text!r} is not allowed: expected one of {', '.join(flag.choices)}"
            )
        if value is not False:  # PET_STANDALONE=0 is the switch left off
            setattr(a, flag.dest, value)
            notes.append(f"{flag.name} {text} from {env_name} (torchrun's environment default)")
    return notes


# --- resolution: the flags as meshrun's launch settings ------------------------------------


@dataclass
class Resolved:
    """What the torchrun flags mean for one ``meshrun launch``."""

    nproc_per_node: int | None  # None: not given (meshrun's default applies)
    launch_flags: dict[str, Any]  # argparse attributes to set before the [launch] keys apply
    spec: dict[str, Any]  # LaunchSpec fields
    notes: list[str] = field(default_factory=list)  # printed on stderr, one line each


def resolve(a: argparse.Namespace, nproc_of: Callable[[str], int] | None = None) -> Resolved:
    """The launch settings the torchrun flags of ``a`` ask for; ConfigError for what cannot
    apply. ``nproc_of`` turns auto/gpu/cpu/xpu into a count (default: torchrun's own rule)."""
    notes: list[str] = []
    nproc = resolve_nproc(a.nproc_per_node, nproc_of or torchrun_nproc, notes)
    backend, launch_flags = rendezvous(a, notes)
    tee, redirects = output_streams(a.tee, a.redirects, notes)
    _check_target_flags(a)
    spec = {
        "rdzv_backend": backend,
        "tee": tee,
        "redirects": redirects,
        "log_dir_flag": a.log_dir or "",
        "local_addr": a.local_addr or "",
        "torchrun_args": passthrough_argv(a),
        "replica_groups": getattr(a, "replica_groups", None) or 0,
        "lighthouse": getattr(a, "lighthouse", None) or "",
    }
    if a.logs_specs:
        notes.append(
            f"--logs-specs {a.logs_specs}: the failure summary reads torchrun's default log "
            "layout and may find no per-rank logs"
        )
    return Resolved(nproc, launch_flags, spec, notes)


def rendezvous(a: argparse.Namespace, notes: list[str]) -> tuple[str, dict[str, Any]]:
    """The rendezvous backend and the launch flags it implies (``--standalone``, torchrun's
    static ``--master-addr/--master-port``)."""
    if a.standalone:
        return "c10d", _standalone(a, notes)
    backend = a.rdzv_backend
    if backend is not None and backend not in BACKENDS:
        raise ConfigError(
            f"--rdzv-backend {backend!r} is not available in meshrun launch: it runs torchrun's "
            "c10d or static rendezvous (its node handshake uses their TCP store). Use "
            "--rdzv-backend c10d --rdzv-endpoint HOST:PORT, or plain torchrun for this backend"
        )
    static_given = a.master_addr is not None or a.master_port is not None
    if backend is None:
        # --rdzv-endpoint alone keeps meshrun's c10d (torchrun would read it as static).
        backend = "static" if static_given and not a.rdzv_endpoint else "c10d"
    if backend == "c10d":
        if static_given:
            notes.append(
                "--master-addr/--master-port ignored: they apply to static rendezvous only "
                "(as in torchrun); this launch uses c10d at --rdzv-endpoint"
            )
        return "c10d", {}
    return _static(a, notes)


def _standalone(a: argparse.Namespace, notes: list[str]) -> dict[str, Any]:
    if a.nnodes is not None and parse_nnodes(a.nnodes).max_nodes != 1:
        raise ConfigError(
            f"--standalone runs one node, but --nnodes is {a.nnodes!r}: drop --nnodes, or drop "
            "--standalone and give --rdzv-endpoint HOST:PORT for a multi-node job"
        )
    ignored = [
        f"{flag} {value}"
        for flag, value in (
            ("--rdzv-backend", a.rdzv_backend),
            ("--rdzv-endpoint", a.rdzv_endpoint),
            ("--master-addr", a.master_addr),
            ("--master-port", a.master_port),
        )
        if value is not None
    ]
    if ignored:
        notes.append(
            f"--standalone: {', '.join(ignored)} ignored: one node on a free local port "
            "(as in torchrun)"
        )
    return {"nnodes": "1", "rdzv_endpoint": ""}


def _static(a: argparse.Namespace, notes: list[str]) -> tuple[str, dict[str, Any]]:
    """torchrun's static rendezvous: at --rdzv-endpoint, else MASTER_ADDR:MASTER_PORT. On one
    node without a port torchrun runs a local c10d rendezvous instead, and so does meshrun."""
    if a.rdzv_endpoint:
        return "static", {}
    max_nodes = parse_nnodes(a.nnodes).max_nodes if a.nnodes else 1
    if a.master_port is None and max_nodes == 1:
        if a.master_addr is not None:
            notes.append(
                f"--master-addr {a.master_addr} ignored: one node without --master-port runs "
                "a local rendezvous on a free port (as in torchrun)"
            )
        return "c10d", {}  # meshrun's single node: loopback c10d on a free port
    if a.master_addr is None and a.master_port is None:
        # No address at all: meshrun's "--nnodes N needs an endpoint" error, not torchrun's
        # silent 127.0.0.1:29500 that no other host can reach.
        return "static", {}
    addr = a.master_addr or STATIC_DEFAULT_ADDR
    port = a.master_port if a.master_port is not None else STATIC_DEFAULT_PORT
    if not 1 <= port <= 65535:
        raise ConfigError(f"--master-port {port} is not allowed: expected 1..65535")
    return "static", {"rdzv_endpoint": f"{addr}:{port}"}


def _check_target_flags(a: argparse.Namespace) -> None:
    if a.no_python and a.module:
        raise ConfigError(
            "--no-python cannot go with -m/--module (torchrun refuses it too): a module needs "
            "Python; drop one of them"
        )


def hostfile_refusal(a: argparse.Namespace) -> str | None:
    """Why the torchrun flags of ``a`` cannot go with --hostfile, or None."""
    nproc = a.nproc_per_node
    if isinstance(nproc, str):  # a device word: nproc_value keeps numbers as ints
        return (
            f"--nproc-per-node {nproc} cannot go with --hostfile: this machine cannot count "
            "another host's devices; give a number, or slots=N per host in the hostfile"
        )
    lost = [f.name for f in given(a) if f.dest not in HOSTFILE_FLAGS]
    if not lost:
        return None
    return (
        f"{', '.join(lost)} cannot go with --hostfile yet: the hosts' launches would not get "
        "them. Drop them, or run meshrun launch on each host with them"
    )


# `meshrun launch` flags that override [launch] keys of the same name (flag given = wins).
LAUNCH_FLAGS = (
    "nproc_per_node",
    "nnodes",
    "node_rank",
    "rdzv_endpoint",
    "rdzv_id",
    "rdzv_conf",
    "max_restarts",
    "interface",
    ("join_timeout", "join_timeout_s"),
)


def launch_flag_overrides(a: argparse.Namespace) -> list[tuple[str, str, str]]:
    """The ``meshrun launch`` flags given, as ``(flag, section.key, text)`` overrides."""
    found = []
    for entry in LAUNCH_FLAGS:
        dest, key = entry if isinstance(entry, tuple) else (entry, entry)
        value = getattr(a, dest, None)
        if value is not None:
            found.append((f"--{dest.replace('_', '-')}", f"launch.{key}", str(value)))
    return found


def apply_launch_flags(cfg: Config, a: argparse.Namespace, topology: bool = True) -> None:
    """Flags over config keys, as ``--launch.KEY=VALUE`` overrides whose errors name the flag
    (each key gets the check it gets in a file), then (``topology``) the multi-node checks
    that need more than one key (before anything starts)."""
    from meshrun.launch.multinode import nodes as multinode

    for flag, key, text in launch_flag_overrides(a):
        apply_overrides(cfg, [(key, text)], source=f"{flag} {text}")
    if not topology:
        return
    multinode.validate(multinode.Rendezvous.of(cfg.launch))
