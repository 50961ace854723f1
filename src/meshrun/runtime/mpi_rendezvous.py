"""Where rank 0 of an ``mpirun``/``mpiexec`` job listens, found over MPI itself (mpi4py).

MPI launchers give every process its rank but never ``MASTER_ADDR``/``MASTER_PORT``, which
torch's ``env://`` rendezvous needs. When mpi4py imports, rank 0 picks the address the other
hosts reach it on (the local end of its route to another host; loopback when every rank
shares its host) and a free port, and broadcasts both; each rank then names the interface it
reaches that address through, for Gloo/NCCL (``GLOO_SOCKET_IFNAME``: Gloo otherwise binds the
address of the hostname, often loopback). meshrun finalizes MPI right after (unless the
script imported ``mpi4py.MPI`` first, and so owns it): Open MPI's mpirun fails a job whose
processes called MPI_Init and exit without MPI_Finalize, as ``@meshrun.main``'s ``os._exit``
does.

Imported by ``launcher_env.detect`` only for a live environment with no ``MASTER_ADDR``; the pure
fallbacks (one host, a port from the job id) stay in runtime/launcher_env.py. docs/mpirun.md.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from types import ModuleType

from meshrun.runtime.logs import say_line
from meshrun.runtime.ports import free_port

_SIOCGIFADDR = 0x8915
_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_LOOPBACK = "127.0.0.1"


class MpiRendezvousError(RuntimeError):
    """MPI cannot tell where rank 0 listens (the message says why and what to set)."""


@dataclass(frozen=True)
class Endpoint:
    addr: str  # rank 0's address, as every rank connects to it
    port: int
    ifname: str  # the interface this rank reaches ``addr`` through; "" on one host
    library: str  # the MPI library mpi4py loaded (its first version line)


_ABI_VARS = frozenset({"MPI4PY_MPIABI", "MPI4PY_LIBMPI"})


def choose_abi(launcher: str, environ: MutableMapping[str, str]) -> str:
    """Started by Open MPI's launcher, with neither MPI4PY_MPIABI nor MPI4PY_LIBMPI set and
    mpi4py not yet imported: tell mpi4py's binary wheel to load Open MPI, and return the
    setting made ("" when none). On its own the wheel loads ``libmpi.so`` first, which on a
    machine with MPICH's development files is MPICH's: it then fails to import (Debian names
    MPICH's library libmpich.so.12) or runs every process as rank 0 of its own job. MPICH's
    soname differs between distributions, so under MPICH's launcher the user's setting
    decides (docs/mpirun.md)."""
    if launcher != "Open MPI" or "mpi4py.MPI" in sys.modules or _ABI_VARS & environ.keys():
        return ""
    environ["MPI4PY_MPIABI"] = "openmpi"
    return "MPI4PY_MPIABI=openmpi, the launcher's"


def load_mpi() -> tuple[ModuleType | None, bool, str]:
    """mpi4py's ``MPI`` module (None when it does not import), whether this process imported
    it first (then meshrun finalizes it), and why it did not import."""
    owned = "mpi4py.MPI" not in sys.modules
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError) as err:  # RuntimeError: no MPI library would load
        return None, False, f"{type(err).__name__}: {err}"
    return MPI, owned, ""


def find_endpoint(
    world: int, launcher: str, size_var: str, port: int = 0
) -> tuple[Endpoint | None, str]:
    """Rank 0's endpoint over MPI (``port``, else a free one rank 0 picks), or None and why
    mpi4py could not say (it does not import). Across hosts it also sets this process's
    GLOO/NCCL_SOCKET_IFNAME where unset, and says so.

    Raises :class:`MpiRendezvousError` when mpi4py imports but runs a different MPI than the
    launcher's (every process alone, rank 0 of 1) or rank 0 has no route to the others."""
    chose = choose_abi(launcher, os.environ)
    mpi, owned, why = load_mpi()
    if mpi is None:
        return None, f"{why}; set {chose}" if chose else why
    try:
        endpoint, rank, local_rank = exchange(mpi, world, (launcher, size_var), port)
    finally:
        if owned and not mpi.Is_finalized():
            mpi.Finalize()
    _announce(endpoint, rank, local_rank, init_socket_ifname(endpoint, os.environ), chose)
    return endpoint, ""


def _announce(
    endpoint: Endpoint, rank: int, local_rank: int, set_vars: list[str], chose: str = ""
) -> None:
    where = f"{endpoint.addr}:{endpoint.port}"
    if rank == 0:
        how = f"; set {chose}" if chose else ""
        _say(f"rank 0 listens on {where} (found over mpi4py, {endpoint.library}{how})")
    if set_vars and local_rank == 0:  # one line per host
        _say(
            f"rank {rank} on {socket.gethostname()} reaches {endpoint.addr} through interface "
            f"{endpoint.ifname} (set {', '.join(set_vars)})"
        )


def _say(text: str) -> None:
    say_line(f"meshrun: mpi: {text}")


def exchange(
    mpi: ModuleType, world: int, launched_by: tuple[str, str], port: int = 0
) -> tuple[Endpoint, int, int]:
    """The endpoint, this process's MPI rank and its rank on its host (collective: every
    process of the job calls it). ``launched_by``: the launcher and its world-size variable,
    which must agree with MPI's own size."""
    comm = mpi.COMM_WORLD
    library = " ".join(mpi.Get_library_version().splitlines()[0].split(",")[0].split())
    if comm.Get_size() != world:
        raise MpiRendezvousError(mismatch_message(library, world, comm.Get_size(), launched_by))
    node = comm.Split_type(mpi.COMM_TYPE_SHARED)
    # 1 on every rank of rank 0's host, 0 elsewhere: MPI knows which ranks share a node.
    with_rank0 = node.allreduce(1 if comm.Get_rank() == 0 else 0) == 1
    local_rank = node.Get_rank()
    node.Free()
    reports = comm.gather((with_rank0, local_addresses()), root=0)
    chosen = _choose_on_rank0(reports, port) if comm.Get_rank() == 0 else None
    addr, port, error = comm.bcast(chosen, root=0)
    if error:  # every rank stops with rank 0's reason instead of waiting for it
        raise MpiRendezvousError(error)
    ifname = "" if addr == _LOOPBACK else interface_of(route_source(addr))
    return Endpoint(addr, port, ifname, library), comm.Get_rank(), local_rank


def _choose_on_rank0(reports: list[tuple[bool, list[str]]], port: int) -> tuple[str, int, str]:
    try:
        addr = choose_address(reports, os.environ)
    except MpiRendezvousError as err:
        return "", 0, str(err)
    return addr, port or free_port(""), ""  # free on every interface: the store binds them all


def choose_address(reports: list[tuple[bool, list[str]]], environ: Mapping[str, str]) -> str:
    """Rank 0's address from every rank's (shares rank 0's host, its IPv4 addresses).

    One host: loopback. Else the interface the user named (``GLOO_SOCKET_IFNAME``), or the
    local end of the route to the first address of another host that this host does not
    also hold (a docker bridge has the same address on every host)."""
    others = [addrs for with_rank0, addrs in reports if not with_rank0]
    if not others:
        return _LOOPBACK
    named = _named_interface_address(environ)
    if named:
        return named
    mine = set(local_addresses())
    for addrs in others:
        for peer in (a for a in addrs if a not in mine):
            source = route_source(peer)
            if source and not ipaddress.ip_address(source).is_loopback:
                return source
    raise MpiRendezvousError(
        "rank 0 has no route to any address of the other hosts (their addresses: "
        f"{sorted({a for addrs in others for a in addrs})}); set MASTER_ADDR to an address of "
        "rank 0's host that they reach (mpirun -x MASTER_ADDR=... -x MASTER_PORT=...)"
    )


def _named_interface_address(environ: Mapping[str, str]) -> str:
    for var in _IFNAME_VARS:
        name = (environ.get(var) or "").split(",")[0]
        if name:
            return _ipv4_of(name) or ""
    return ""


def init_socket_ifname(endpoint: Endpoint, environ: MutableMapping[str, str]) -> list[str]:
    """Set GLOO/NCCL_SOCKET_IFNAME to the interface toward rank 0 where the user has not;
    returns the variables set (none on one host: Gloo's default binds there)."""
    if not endpoint.ifname:
        return []
    unset = [var for var in _IFNAME_VARS if not environ.get(var)]
    for var in unset:
        environ[var] = endpoint.ifname
    return unset


def mismatch_message(library: str, world: int, mpi_size: int, launched_by: tuple[str, str]) -> str:
    launcher, size_var = launched_by
    if launcher == "MPICH":
        fix = (
            "point mpi4py at MPICH: MPI4PY_MPIABI=mpich with MPICH's libmpi.so.12 on the "
            "library path (Debian/Ubuntu name it libmpich.so.12: link it as libmpi.so.12 into "
            "a directory on LD_LIBRARY_PATH), or MPI4PY_LIBMPI=/path/to/mpich/libmpi.so.12; "
            "or pass the address: mpiexec -genv MASTER_ADDR <rank 0's host> -genv "
            "MASTER_PORT 29500"
        )
    else:
        fix = (
            "point mpi4py at the launcher's MPI (Open MPI: MPI4PY_MPIABI=openmpi, loading "
            "libmpi.so.40, or MPI4PY_LIBMPI=/path/to/openmpi/libmpi.so.40); or pass the "
            "address: mpirun -x MASTER_ADDR=<rank 0's host> -x MASTER_PORT=29500"
        )
    return (
        f"this process was started by {launcher}'s launcher as one of {size_var}={world}, but "
        f"mpi4py runs {library}, which sees {mpi_size} process(es): mpi4py loaded another MPI "
        f"than the launcher's, so every process would be rank 0 of its own job. Fix: {fix}"
    )


def route_source(dest: str) -> str:
    """The local address the kernel sends from to reach ``dest`` ("" without a route); a
    connected UDP socket sends nothing."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((dest, 9))
        except OSError:
            return ""
        source: str = sock.getsockname()[0]
        return source


def _ipv4_of(name: str) -> str | None:
    packed = struct.pack("256s", name.encode()[:15])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            result = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, packed)
        except OSError:
            return None  # down, or IPv6 only
    return socket.inet_ntoa(result[20:24])


def _interfaces() -> dict[str, str]:
    """Interface name -> IPv4 address, for every interface of this host that has one."""
    found = {name: _ipv4_of(name) for _, name in socket.if_nameindex()}
    return {name: addr for name, addr in found.items() if addr}


def local_addresses() -> list[str]:
    """This host's IPv4 addresses other than loopback, in interface order."""
    addrs = _interfaces().values()
    return [a for a in addrs if not ipaddress.ip_address(a).is_loopback]


def interface_of(address: str) -> str:
    """The name of the interface holding ``address`` ("" if none does)."""
    return next((n for n, a in _interfaces().items() if a == address), "")
