"""What a ``meshrun launch`` request's flags mean for the launch: torchrun's ``PET_<FLAG>``
environment defaults, the process count (auto, gpu, cpu, xpu counted as torchrun counts them),
the rendezvous they imply, the output streams, what cannot go with --hostfile, and the flags
over their ``[launch]`` keys. The table of flags is launch/torchrun_flags.py's; the request's
types are launch/front/request.py's.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from meshrun.config import Config, ConfigError, apply_overrides
from meshrun.launch.front.request import LaunchRequest, TorchrunFlags
from meshrun.launch.spec import LaunchKeys, parse_nnodes
from meshrun.launch.torchrun_flags import (
    BACKENDS,
    FLAGS,
    HOSTFILE_FLAGS,
    STATIC_DEFAULT_ADDR,
    STATIC_DEFAULT_PORT,
    Flag,
    flag_argv,
)

# torchrun's -r/--tee syntax: one Std value for all ranks (0-3), or LOCAL_RANK:VALUE,...
_STD_VALUE = re.compile(r"^(?:[0-3]|\d+:[0-3](?:,\d+:[0-3])*)$")
STDERR = 2  # torchrun's Std.ERR bit


def given(flags: TorchrunFlags) -> list[Flag]:
    """The table's flags set on the command line (or by a ``PET_`` default)."""
    return [f for f in FLAGS if flags.value(f) is not None]


def passthrough_argv(flags: TorchrunFlags) -> list[str]:
    """The passed-through flags the user gave, as torchrun argv."""
    return [arg for f in given(flags) if f.passed for arg in flag_argv(f, flags.value(f))]


def request_keys(
    request: LaunchRequest, nproc_per_node: int | None, implied: LaunchKeys | None = None
) -> LaunchKeys:
    """The flags that set ``[launch]`` keys, with ``nproc_per_node`` as resolved and the keys
    ``implied`` by the rendezvous flags (--standalone, --master-addr/port) over those given."""
    t, over = request.torchrun, implied or LaunchKeys()
    return LaunchKeys(
        nproc_per_node=nproc_per_node,
        nnodes=t.nnodes if over.nnodes is None else over.nnodes,
        node_rank=t.node_rank,
        rdzv_endpoint=t.rdzv_endpoint if over.rdzv_endpoint is None else over.rdzv_endpoint,
        rdzv_id=t.rdzv_id,
        rdzv_conf=t.rdzv_conf,
        max_restarts=t.max_restarts,
        interface=request.interface,
        join_timeout=request.join_timeout,
    )


# --- resolution: the flags as meshrun's launch settings ------------------------------------


@dataclass(frozen=True)
class Resolved:
    """What the torchrun flags mean for one ``meshrun launch``."""

    nproc_per_node: int | None  # None: not given (meshrun's default applies)
    launch_flags: LaunchKeys  # the [launch] keys they imply (nnodes, rdzv_endpoint)
    spec: dict[str, Any]  # LaunchSpec fields
    notes: list[str] = field(default_factory=list)  # printed on stderr, one line each
    keys: LaunchKeys = field(default_factory=LaunchKeys)  # the flags over the [launch] keys


def resolve(request: LaunchRequest, nproc_of: Callable[[str], int] | None = None) -> Resolved:
    """The launch settings the torchrun flags of ``request`` ask for; ConfigError for what
    cannot apply. ``nproc_of`` turns auto/gpu/cpu/xpu into a count (default: torchrun's rule)."""
    a = request.torchrun
    notes: list[str] = []
    nproc = resolve_nproc(a.nproc_per_node, nproc_of or torchrun_nproc, notes)
    backend, launch_flags = rendezvous(a, notes)
    tee, redirects = output_streams(a.tee, a.redirects, notes)
    _check_target_flags(request)
    spec = {
        "rdzv_backend": backend,
        "tee": tee,
        "redirects": redirects,
        "log_dir_flag": a.log_dir or "",
        "local_addr": a.local_addr or "",
        "torchrun_args": passthrough_argv(a),
        "replica_groups": request.replica_groups or 0,
        "lighthouse": request.lighthouse or "",
    }
    if a.logs_specs:
        notes.append(
            f"--logs-specs {a.logs_specs}: the failure summary reads torchrun's default log "
            "layout and may find no per-rank logs"
        )
    keys = request_keys(request, nproc, launch_flags)
    return Resolved(nproc, launch_flags, spec, notes, keys)


def rendezvous(a: TorchrunFlags, notes: list[str]) -> tuple[str, LaunchKeys]:
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
        return "c10d", LaunchKeys()
    return _static(a, notes)


def _standalone(a: TorchrunFlags, notes: list[str]) -> LaunchKeys:
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
    return LaunchKeys(nnodes="1", rdzv_endpoint="")


def _static(a: TorchrunFlags, notes: list[str]) -> tuple[str, LaunchKeys]:
    """torchrun's static rendezvous: at --rdzv-endpoint, else MASTER_ADDR:MASTER_PORT. On one
    node without a port torchrun runs a local c10d rendezvous instead, and so does meshrun."""
    if a.rdzv_endpoint:
        return "static", LaunchKeys()
    max_nodes = parse_nnodes(a.nnodes).max_nodes if a.nnodes else 1
    if a.master_port is None and max_nodes == 1:
        if a.master_addr is not None:
            notes.append(
                f"--master-addr {a.master_addr} ignored: one node without --master-port runs "
                "a local rendezvous on a free port (as in torchrun)"
            )
        return "c10d", LaunchKeys()  # meshrun's single node: loopback c10d on a free port
    if a.master_addr is None and a.master_port is None:
        # No address at all: meshrun's "--nnodes N needs an endpoint" error, not torchrun's
        # silent 127.0.0.1:29500 that no other host can reach.
        return "static", LaunchKeys()
    addr = a.master_addr or STATIC_DEFAULT_ADDR
    port = a.master_port if a.master_port is not None else STATIC_DEFAULT_PORT
    if not 1 <= port <= 65535:
        raise ConfigError(f"--master-port {port} is not allowed: expected 1..65535")
    return "static", LaunchKeys(rdzv_endpoint=f"{addr}:{port}")


def _check_target_flags(request: LaunchRequest) -> None:
    if request.torchrun.no_python and request.module:
        raise ConfigError(
            "--no-python cannot go with -m/--module (torchrun refuses it too): a module needs "
            "Python; drop one of them"
        )


def hostfile_refusal(a: TorchrunFlags) -> str | None:
    """Why the torchrun flags ``a`` cannot go with --hostfile, or None."""
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


def resolve_nproc(
    text: str | int | None, nproc_of: Callable[[str], int], notes: list[str]
) -> int | None:
    """``--nproc-per-node`` as a count: N as given, auto/gpu/cpu/xpu as torchrun counts them."""
    if text is None:
        return None
    if isinstance(text, int) or text.strip().lstrip("-").isdigit():
        n = int(text)
    else:
        try:
            n = nproc_of(text)
        except ValueError as err:
            raise ConfigError(
                f"--nproc-per-node {text!r} is not allowed here: {err} Use a number, auto "
                "(accelerators if any, else CPU cores), cpu, gpu or xpu"
            ) from None
        notes.append(f"--nproc-per-node {text}: {n} processes (torchrun's rule)")
    if n < 1:
        raise ConfigError(f"--nproc-per-node {text} is not allowed: must be >= 1")
    return n


def torchrun_nproc(text: str) -> int:
    """torchrun's own count for auto/gpu/cpu/xpu (``determine_local_world_size``): on a CPU
    machine auto and cpu mean the usable CPU cores, as in torchrun."""
    from torch.distributed.run import determine_local_world_size

    return int(determine_local_world_size(text))


def output_streams(tee: str | None, redirects: str | None, notes: list[str]) -> tuple[str, str]:
    """``--tee`` and ``--redirects`` as given ("" = not given), checked; a note when stderr
    is not kept in the log files the failure summary reads."""
    for flag, value in (("--tee", tee), ("--redirects", redirects)):
        if value is not None and not _STD_VALUE.match(value):
            raise ConfigError(
                f"{flag} {value!r} is not allowed: expected 0 (none), 1 (stdout), 2 (stderr), "
                "3 (both) for every rank, or LOCAL_RANK:VALUE,... e.g. 0:3,1:2"
            )
    if tee is None and redirects is None:
        return "", ""
    if not any(_all_ranks_have(v, STDERR) for v in (tee, redirects)):
        notes.append(
            "stderr of some ranks is not kept in log files (--tee/--redirects without 2): the "
            "failure summary cannot show their last lines (error.json from @record still works)"
        )
    return tee or "", redirects or ""


def _all_ranks_have(value: str | None, bit: int) -> bool:
    return value is not None and value.isdigit() and bool(int(value) & bit)


# --- the flags over their [launch] keys --------------------------------------------------


def launch_flag_overrides(keys: LaunchKeys) -> list[tuple[str, str, str]]:
    """The flags given, as ``(flag, section.key, text)`` overrides."""
    found = []
    for f in dataclasses.fields(keys):
        value = getattr(keys, f.name)
        if value is not None:
            key = "join_timeout_s" if f.name == "join_timeout" else f.name
            found.append((f"--{f.name.replace('_', '-')}", f"launch.{key}", str(value)))
    return found


def apply_launch_flags(cfg: Config, keys: LaunchKeys, topology: bool = True) -> None:
    """Flags over config keys, as ``--launch.KEY=VALUE`` overrides whose errors name the flag
    (each key gets the check it gets in a file), then (``topology``) the multi-node checks
    that need more than one key (before anything starts)."""
    from meshrun.launch.multinode import nodes as multinode

    for flag, key, text in launch_flag_overrides(keys):
        apply_overrides(cfg, [(key, text)], source=f"{flag} {text}")
    if not topology:
        return
    multinode.validate(multinode.Rendezvous.of(cfg.launch))
