"""Which network interface a node uses to reach the others, and the settings that follow.

Plain torchrun leaves three things to the user on a multi-host job, and each one, wrong,
hangs or fails the job (measured across two network namespaces): the node that owns the
rendezvous endpoint must host the store (``--rdzv-conf is_host=1``), each node must advertise
a reachable address (``--local-addr``; by default the hostname, which often resolves to
127.0.0.1), and Gloo/NCCL must bind the right interface (``GLOO_SOCKET_IFNAME`` /
``NCCL_SOCKET_IFNAME``; by default Gloo picks the hostname's address). meshrun derives all
three from one choice: the interface the kernel routes through to the rendezvous host.

Only the standard library: interface names from ``socket.if_nameindex``, IPv4 addresses from
the ``SIOCGIFADDR``/``SIOCGIFNETMASK`` ioctls, the route from a connected UDP socket (which
sends nothing).
"""

from __future__ import annotations

import fcntl
import ipaddress
import re
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass

_SIOCGIFADDR = 0x8915
_SIOCGIFNETMASK = 0x891B
SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
# Container/VM bridges: reachable from this host only, a poor choice when another route exists.
_BRIDGE_NAMES = re.compile(r"^(docker\d*|br-[0-9a-f]+|virbr\d+|cni\d*|podman\d*|lxcbr\d*)$")


class NetworkError(RuntimeError):
    """No usable interface or route; the message names the interfaces that exist."""


@dataclass(frozen=True)
class Interface:
    name: str
    address: str  # IPv4
    prefixlen: int

    @property
    def is_loopback(self) -> bool:
        return ipaddress.ip_address(self.address).is_loopback

    @property
    def is_bridge(self) -> bool:
        return bool(_BRIDGE_NAMES.match(self.name))

    @property
    def network(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(f"{self.address}/{self.prefixlen}", strict=False)

    def __str__(self) -> str:
        return f"{self.name} ({self.address}/{self.prefixlen})"


def list_interfaces() -> list[Interface]:
    """Every interface of this network namespace that has an IPv4 address (loopback too)."""
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            address = _ioctl_ipv4(sock, _SIOCGIFADDR, name)
            if address is None:
                continue  # down, or IPv6 only
            mask = _ioctl_ipv4(sock, _SIOCGIFNETMASK, name) or "255.255.255.255"
            prefix = ipaddress.IPv4Network(f"0.0.0.0/{mask}").prefixlen
            found.append(Interface(name, address, prefix))
    return found


def _ioctl_ipv4(sock: socket.socket, request: int, name: str) -> str | None:
    packed = struct.pack("256s", name.encode()[:15])
    try:
        result = fcntl.ioctl(sock.fileno(), request, packed)
    except OSError:
        return None
    return socket.inet_ntoa(result[20:24])


def resolve_host(host: str) -> str:
    """``host`` as an IPv4 address; a name that does not resolve is a NetworkError."""
    try:
        return socket.gethostbyname(host)
    except OSError as err:
        raise NetworkError(
            f"rendezvous host {host!r} does not resolve ({err}); use an IP address, or a name "
            "every node can resolve"
        ) from None


def route_source(dest: str) -> str:
    """The local address the kernel would send from to reach ``dest`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((dest, 9))
        except OSError as err:
            raise NetworkError(f"no route from this node to {dest}: {err}") from None
        source: str = sock.getsockname()[0]
        return source


def is_local_address(address: str, interfaces: list[Interface] | None = None) -> bool:
    """Whether ``address`` belongs to this node (so this node hosts the rendezvous store)."""
    if ipaddress.ip_address(address).is_loopback:
        return True
    return any(i.address == address for i in interfaces or list_interfaces())


def choose_interface(
    rdzv_host: str, requested: str = "", *, multi_host: bool = True
) -> tuple[Interface, list[str]]:
    """The interface to use for a job whose rendezvous endpoint is on ``rdzv_host``.

    ``requested`` (an interface name the user gave) wins if it exists; otherwise the one the
    kernel routes through to the rendezvous host. Returns the interface and warnings to print.
    A multi-host job never gets loopback: the other nodes could not reach it.
    """
    interfaces = list_interfaces()
    names = ", ".join(str(i) for i in interfaces) or "none"
    if requested:
        chosen = next((i for i in interfaces if i.name == requested), None)
        if chosen is None:
            raise NetworkError(
                f"--interface {requested!r} does not exist on this node (or has no IPv4 "
                f"address); interfaces here: {names}"
            )
    else:
        source = route_source(resolve_host(rdzv_host))
        chosen = next((i for i in interfaces if i.address == source), None)
        if chosen is None:
            raise NetworkError(
                f"the route to {rdzv_host} leaves from {source}, which no interface here "
                f"holds; pass --interface NAME (interfaces here: {names})"
            )
    warnings = []
    if multi_host and chosen.is_loopback:
        raise NetworkError(
            f"a multi-node job cannot use the loopback interface {chosen}: the rendezvous "
            f"endpoint {rdzv_host!r} must be an address the other nodes reach (this node's "
            f"address on the shared network), or pass --interface NAME (interfaces here: {names})"
        )
    if chosen.is_bridge:
        others = [i for i in interfaces if not i.is_loopback and not i.is_bridge]
        if others:
            warnings.append(
                f"interface {chosen} looks like a container/VM bridge; other interfaces here: "
                f"{', '.join(map(str, others))} (pass --interface NAME to choose one)"
            )
    return chosen, warnings


def socket_env(iface: Interface, environ: Mapping[str, str]) -> dict[str, str]:
    """GLOO/NCCL_SOCKET_IFNAME for ``iface``, leaving out any the user has already set."""
    return {var: iface.name for var in SOCKET_IFNAME_VARS if not environ.get(var)}
