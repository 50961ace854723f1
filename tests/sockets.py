"""The listening TCP sockets of a process tree, read from /proc (Linux), for the tests that a
job binds its servers where asked (tests/e2e/test_trust_rendezvous.py; replica groups can use
it too).

``/proc/<pid>/fd`` names each socket ``socket:[INODE]``; ``/proc/<pid>/net/tcp{,6}`` lists the
sockets of that process's network namespace with their inode, so a tree whose processes sit
in a network namespace of their own is read correctly too. Sockets are sampled while the job
runs (:class:`Watch`), since servers come and go with restarts.

    with sockets.Watch(proc.pid) as watch:
        ...  # the job runs
    assert not sockets.wildcard(watch.seen), sockets.describe(watch.seen)
"""

from __future__ import annotations

import ipaddress
import os
import threading
from dataclasses import dataclass
from pathlib import Path

LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's st column


@dataclass(frozen=True)
class Listener:
    pid: int
    command: str
    address: str
    port: int

    @property
    def is_wildcard(self) -> bool:
        return ipaddress.ip_address(self.address).is_unspecified

    def __str__(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{host}:{self.port} (pid {self.pid} {self.command})"


def tree(root: int) -> list[int]:
    """``root`` and every process below it."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [root], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _address(hex_addr: str) -> str:
    """/proc/net/tcp{,6}'s address: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hex_addr)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def _listening(pid: int) -> dict[str, tuple[str, int]]:
    """inode -> (address, port) of the LISTEN sockets in ``pid``'s network namespace."""
    out = {}
    for name in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if cols[3] != LISTEN:
                continue
            addr, port = cols[1].split(":")
            out[cols[9]] = (_address(addr), int(port, 16))
    return out


def listeners(root: int) -> set[Listener]:
    """The listening sockets held now by ``root``'s tree."""
    found = set()
    for pid in tree(root):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            command = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue  # exited meanwhile
        table = _listening(pid)
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in table:
                address, port = table[target[8:-1]]
                found.add(Listener(pid, command, address, port))
    return found


def wildcard(seen: set[Listener]) -> list[Listener]:
    return sorted((s for s in seen if s.is_wildcard), key=str)


def describe(seen: set[Listener]) -> str:
    return "\n".join(sorted(map(str, seen))) or "(none)"


class Watch:
    """Samples ``listeners(root)`` every ``every_s`` in a thread until the block ends."""

    def __init__(self, root: int, every_s: float = 0.1) -> None:
        self.root, self.every_s = root, every_s
        self.seen: set[Listener] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.seen |= listeners(self.root)
            self._stop.wait(self.every_s)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
