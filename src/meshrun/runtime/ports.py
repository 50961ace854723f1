"""The one free-port helper every launcher and server uses: the OS picks a port free on the
address the server will bind (so a port free on loopback is not assumed free elsewhere)."""

from __future__ import annotations

import socket

LOCAL_HOST = "127.0.0.1"


def free_port(host: str = LOCAL_HOST) -> int:
    """A TCP port free on ``host`` now, the OS's pick; another process may take it before the
    caller binds it again, so bind it at once. ``""``: free on every interface (for a server
    that binds them all); an IPv6 literal is bound over IPv6."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
