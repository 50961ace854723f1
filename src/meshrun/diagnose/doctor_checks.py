"""The checks of ``meshrun doctor``: each a small function returning a :class:`Check`.

Each check takes what it judges as arguments (sizes, environment, interface list) where that
is cheap, so unit tests drive it with made-up values; the ``*_here`` helpers read this node.
No process group here: the launch-wide checks (clock skew, all-reduce) are in
``doctor_worker.py``.
"""

from __future__ import annotations

import errno
import platform
import shutil
import socket
import threading
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from meshrun.config import ConfigError
from meshrun.config.launch_values import parse_endpoint
from meshrun.launch.multinode.netif import (
    Interface,
    NetworkError,
    choose_interface,
    is_local_address,
)

Status = Literal["PASS", "WARN", "FAIL"]
GiB = 2**30
MiB = 2**20
# /dev/shm: NCCL's intra-node transport and DataLoader workers pass data through it; Docker's
# default (64 MiB) makes them crash minutes into a run ("bus error", "unhandled system error").
SHM_MIN = 1 * GiB
# Free disk for checkpoints when there is no earlier checkpoint to size them from.
DISK_FAIL = 1 * GiB
DISK_WARN = 10 * GiB
CONNECT_TIMEOUT_S = 3.0
RESOLVE_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str
    fix: str = ""

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


def _ok(name: str, detail: str) -> Check:
    return Check(name, "PASS", detail)


# --- versions and devices ------------------------------------------------------------------


def check_versions() -> Check:
    """Python, torch, meshrun, CUDA and NCCL versions (compared across nodes by the worker)."""
    import torch

    from meshrun._version import __version__

    cuda = torch.version.cuda or "none"
    nccl = "none"
    if torch.cuda.is_available() and torch.distributed.is_nccl_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    return _ok(
        "versions",
        f"python {platform.python_version()}, torch {torch.__version__}, meshrun {__version__}, "
        f"CUDA {cuda}, NCCL {nccl}",
    )


def check_gpus(gpus: int, nproc: int) -> Check:
    """GPUs visible against processes per node (one process drives one GPU)."""
    if gpus == 0:
        return _ok("gpus", f"none visible: {nproc} process(es) on CPU with the Gloo backend")
    if nproc > gpus:
        return Check(
            "gpus",
            "FAIL",
            f"{gpus} GPU(s) visible for {nproc} processes per node",
            f"start at most {gpus} processes per node (--nproc-per-node {gpus}), or check "
            "CUDA_VISIBLE_DEVICES",
        )
    if nproc < gpus:
        return Check(
            "gpus",
            "WARN",
            f"{gpus} GPU(s) visible, {nproc} processes per node: {gpus - nproc} GPU(s) idle",
            f"--nproc-per-node {gpus} uses them all",
        )
    return _ok("gpus", f"{gpus} GPU(s) for {nproc} processes per node")


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# --- network -------------------------------------------------------------------------------


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``host:port`` -> (host, port), the syntax ``meshrun launch`` reads (one parser:
    config/launch_values.py); a ValueError in the doctor's words names what is wrong."""
    try:
        return parse_endpoint(endpoint)
    except ConfigError:
        raise ValueError(
            f"--rdzv-endpoint {endpoint!r}: expected HOST:PORT (e.g. 10.0.0.1:29400)"
        ) from None


def check_interface(rdzv_host: str, requested: str, multi_host: bool) -> Check:
    """The interface the job would use (as ``meshrun launch`` chooses it) and the route."""
    try:
        iface, warnings = choose_interface(rdzv_host, requested, multi_host=multi_host)
    except NetworkError as err:
        return Check("interface", "FAIL", str(err), _interface_fix(requested))
    how = "requested" if requested else f"routes to {rdzv_host}"
    if not multi_host and iface.is_loopback:
        return _ok("interface", f"{iface} ({how}; one node: loopback is fine)")
    if warnings:
        return Check("interface", "WARN", f"{iface} ({how}); " + "; ".join(warnings))
    return _ok("interface", f"{iface} ({how})")


def _interface_fix(requested: str) -> str:
    if requested:
        return "pass --interface with one of the interfaces listed (names differ across nodes)"
    return "check the rendezvous address, or pass --interface NAME"


def check_port(host: str, port: int, *, bind: bool, timeout: float = CONNECT_TIMEOUT_S) -> Check:
    """The rendezvous port: the node that hosts the store must be able to bind it; the others
    must reach it (connect, at most ``timeout`` seconds)."""
    where = f"{host}:{port}"
    if bind:
        return _check_bind(host, port)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return _ok("port", f"{where} accepts connections")
    except ConnectionRefusedError:
        return Check(
            "port",
            "FAIL",
            f"{where}: connection refused (the host answers; nothing listens on the port)",
            "start the node that owns the rendezvous endpoint first (it hosts the store), and "
            "check that the port matches on every node",
        )
    except TimeoutError:
        return Check(
            "port",
            "FAIL",
            f"{where}: no answer within {timeout:.0f} s",
            "check the address (it must be the endpoint node's address on the network all "
            "nodes share) and that no firewall drops the port",
        )
    except OSError as err:
        return Check("port", "FAIL", f"{where}: {err}", "check the address and the route to it")


def _check_bind(host: str, port: int) -> Check:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError as err:
            in_use = err.errno == errno.EADDRINUSE
            return Check(
                "port",
                "FAIL",
                f"{host}:{port} cannot be bound on this node: {err.strerror}",
                "another job (or a stale one) holds the port: choose another port in "
                "--rdzv-endpoint, or stop that process"
                if in_use
                else "use an address of this node in --rdzv-endpoint",
            )
    return _ok("port", f"{host}:{port} is free to host the rendezvous on this node")


def rendezvous_is_here(host: str, interfaces: list[Interface] | None = None) -> bool:
    try:
        return is_local_address(socket.gethostbyname(host), interfaces)
    except OSError:
        return False


def check_hostname(multi_host: bool, timeout: float = RESOLVE_TIMEOUT_S) -> Check:
    """This node's hostname resolves (bounded: a dead DNS server must not hang the doctor)."""
    name = socket.gethostname()
    found: list[str] = []
    lookup = threading.Thread(target=_resolve_into, args=(name, found), daemon=True)
    lookup.start()
    lookup.join(timeout)
    if not found or found[0].startswith("!"):
        why = found[0][1:] if found else f"no answer within {timeout:.0f} s"
        return Check(
            "hostname",
            "WARN",
            f"{name!r} does not resolve ({why})",
            "add it to /etc/hosts or DNS: meshrun launch passes --local-addr and "
            "GLOO_SOCKET_IFNAME itself, but plain torchrun, NCCL's fallback and log tools use it",
        )
    address = found[0]
    if multi_host and address.startswith("127."):
        return _ok(
            "hostname",
            f"{name} -> {address} (loopback: plain torchrun would advertise it; meshrun launch "
            "advertises the chosen interface's address instead)",
        )
    return _ok("hostname", f"{name} -> {address}")


def _resolve_into(name: str, out: list[str]) -> None:
    try:
        out.append(socket.gethostbyname(name))
    except OSError as err:
        out.append(f"!{err}")


# --- environment ---------------------------------------------------------------------------


def check_socket_ifname(var: str, environ: Mapping[str, str], names: list[str]) -> Check | None:
    """GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, if set, must name interfaces that exist.
    Gloo takes exact names (comma-separated); NCCL takes prefixes, ``=name`` (exact) and
    ``^name`` (exclude: nothing to check)."""
    value = environ.get(var, "")
    if not value:
        return None
    if value.startswith("^"):
        return _ok(var, f"{var}={value} (excludes interfaces)")
    exact = var.startswith("GLOO") or value.startswith("=")
    wanted = [w for w in value.lstrip("=").split(",") if w]
    missing = [
        w for w in wanted if not any(n == w or (not exact and n.startswith(w)) for n in names)
    ]
    if missing:
        return Check(
            var,
            "FAIL",
            f"{var}={value}: no interface {', '.join(map(repr, missing))} on this node "
            f"(interfaces: {', '.join(names) or 'none'})",
            f"unset {var} (meshrun launch sets it from the chosen interface) or name one listed",
        )
    return _ok(var, f"{var}={value}")


def check_nccl_env(environ: Mapping[str, str]) -> list[Check]:
    """NCCL switches that are right for debugging and wrong (slow or noisy) for a real run."""
    checks = []
    debug = environ.get("NCCL_DEBUG", "")
    if debug.upper() in ("INFO", "TRACE"):
        fix = "fine while debugging; unset it (or set WARN) for long runs"
        checks.append(Check("NCCL_DEBUG", "WARN", f"NCCL_DEBUG={debug}: verbose logs", fix))
    switches = {
        "NCCL_P2P_DISABLE": "GPU peer-to-peer (NVLink/PCIe) transfers",
        "NCCL_IB_DISABLE": "InfiniBand/RoCE",
    }
    for var, what in switches.items():
        value = environ.get(var, "")
        if value and value != "0":
            detail = f"{var}={value}: {what} off, collectives take a slower transport"
            fix = f"unset {var} unless a known hardware problem needs it"
            checks.append(Check(var, "WARN", detail, fix))
    return checks


def check_omp(environ: Mapping[str, str], nproc: int, cores: int) -> Check:
    """OMP_NUM_THREADS x processes against the cores of this node."""
    value = environ.get("OMP_NUM_THREADS", "")
    share = max(1, cores // nproc)
    if not value:
        return _ok(
            "OMP_NUM_THREADS", f"unset: meshrun launch sets {share} ({cores} cores / {nproc})"
        )
    if not value.isdigit() or int(value) < 1:
        return Check(
            "OMP_NUM_THREADS",
            "FAIL",
            f"OMP_NUM_THREADS={value!r} is not a positive integer",
            f"unset it or set {share}",
        )
    threads = int(value) * nproc
    if threads > cores:
        return Check(
            "OMP_NUM_THREADS",
            "WARN",
            f"OMP_NUM_THREADS={value} x {nproc} processes = {threads} threads for {cores} cores",
            f"set OMP_NUM_THREADS={share} (or unset it: meshrun launch sets it)",
        )
    return _ok("OMP_NUM_THREADS", f"{value} x {nproc} processes for {cores} cores")


# --- storage -------------------------------------------------------------------------------


def shm_needed(gpus: int, num_workers: int, nproc: int) -> int:
    """Bytes of /dev/shm a job needs: 1 GiB with NCCL or DataLoader workers, more with many
    workers (data/checks.py's per-worker estimate); 0 when neither is used."""
    from meshrun.data.checks import SHM_PER_WORKER

    if gpus == 0 and num_workers == 0:
        return 0
    return max(SHM_MIN, num_workers * nproc * SHM_PER_WORKER)


def check_shm(size: int | None, needed: int) -> Check:
    """``size`` of /dev/shm (None: absent) against ``needed`` (see ``shm_needed``)."""
    if size is None:
        return Check(
            "/dev/shm", "WARN", "no /dev/shm on this node", "on Linux, mount a tmpfs at /dev/shm"
        )
    have = f"{size / MiB:.0f} MiB"
    if needed == 0:
        status: Status = "PASS" if size >= SHM_MIN else "WARN"
        note = "" if size >= SHM_MIN else f" (below {SHM_MIN / GiB:.0f} GiB)"
        return Check(
            "/dev/shm",
            status,
            f"{have}{note}; enough for Gloo without DataLoader workers",
            _SHM_FIX if note else "",
        )
    if size < needed:
        return Check(
            "/dev/shm",
            "FAIL",
            f"{have}, below the {needed / MiB:.0f} MiB that NCCL / DataLoader workers need",
            _SHM_FIX,
        )
    return _ok("/dev/shm", f"{have} (>= {needed / MiB:.0f} MiB needed)")


_SHM_FIX = (
    "enlarge it: docker run --shm-size=8g; Kubernetes: an emptyDir volume with medium: Memory "
    "mounted at /dev/shm; bare metal: mount -o remount,size=8g /dev/shm"
)


def shm_size(path: str = "/dev/shm") -> int | None:
    try:
        return shutil.disk_usage(path).total
    except OSError:
        return None


def check_disk(directory: Path, free: int, estimate: int | None) -> Check:
    """Free bytes where checkpoints go, against ``estimate`` (sized from an earlier checkpoint)
    or, without one, fixed thresholds."""
    where = f"{directory}: {free / GiB:.1f} GiB free"
    fix = "free space there or point checkpoint.dir at a larger disk (--checkpoint.dir=PATH)"
    if estimate is not None:
        if free < estimate:
            return Check(
                "disk", "FAIL", f"{where}, the kept checkpoints need ~{estimate / GiB:.1f} GiB", fix
            )
        return _ok("disk", f"{where} (kept checkpoints need ~{estimate / GiB:.1f} GiB)")
    if free < DISK_FAIL:
        return Check("disk", "FAIL", f"{where} (below {DISK_FAIL / GiB:.0f} GiB)", fix)
    if free < DISK_WARN:
        return Check("disk", "WARN", f"{where} (below {DISK_WARN / GiB:.0f} GiB)", fix)
    return _ok("disk", where)


def disk_free(directory: Path) -> tuple[Path, int]:
    """Free bytes at ``directory``, or at its nearest existing parent (not created yet)."""
    probe = directory.absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return probe, shutil.disk_usage(probe).free


def checkpoint_estimate(directory: Path, keep_last: int) -> int | None:
    """Bytes the kept checkpoints will take: the newest one's size x (keep_last + 1, the one
    being written); None when there is no checkpoint yet to measure."""
    from meshrun.checkpoint.on_disk import list_checkpoints

    found = list_checkpoints(directory)
    if not found:
        return None
    newest = found[-1].path
    size = sum(f.stat().st_size for f in newest.rglob("*") if f.is_file())
    return size * (keep_last + 1)


def usable_cores() -> int:
    from meshrun.data.checks import usable_cores as cores

    return cores()


def summarize(checks: list[Check]) -> dict[str, int]:
    counts = {"PASS": 0, "WARN": 0, "FAIL": 0}
    for c in checks:
        counts[c.status] += 1
    return counts


def as_dicts(checks: list[Check]) -> list[dict[str, Any]]:
    return [c.to_dict() for c in checks]
