"""Linux network namespaces as separate hosts, for multi-node tests (needs root).

``hosts(n)`` makes n "host" namespaces, each with one veth whose other end sits on a bridge
inside a separate "switch" namespace, so all traffic stays inside namespaces this test made
(nothing is added to the machine's own namespace). Host i gets ``10.<b>.<c>.(i+1)/24`` on
interface ``eth-mr`` (a name that is neither loopback nor a bridge pattern), loopback up, and
its own hostname (``node0``, ``node1``, ...) when commands go through ``Hosts.argv``.
Everything is removed on exit, also when the test fails.

    with netns.hosts(2) as net:
        subprocess.run(net.argv(0, ["ip", "addr"]))
        net.address(1)  # "10.x.y.2"
        net.throttle(100_000_000)  # optional: every link shaped to 100 Mb/s (tc tbf)
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

IFNAME = "eth-mr"


def available() -> str | None:
    """None if namespaces can be made here, else why not (for pytest.skip)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    return None


def require() -> None:
    reason = available()
    if reason:
        pytest.skip(reason)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@dataclass
class Hosts:
    names: list[str]  # namespace names, host i = names[i]
    switch: str
    subnet: str  # "10.b.c"

    def address(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    def hostname(self, i: int) -> str:
        return f"node{i}"

    def argv(self, i: int, argv: Sequence[str], *, hostname: bool = True) -> list[str]:
        """``argv`` run inside host i (with its own UTS namespace and hostname ``node<i>``)."""
        cmd = ["ip", "netns", "exec", self.names[i]]
        if hostname:
            cmd += ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"']
            cmd += [self.hostname(i)]
        return cmd + list(argv)

    def throttle(self, rate_bit: int, mtu: int = 9000) -> None:
        """Every host's link shaped with ``tc tbf`` at ``rate_bit`` (its egress: a path between
        two hosts is shaped once each way) and the MTU set on both ends and the bridge; skips
        the test, with tc's reason, where the kernel or iproute2 has no tbf. MTU 9000 by
        default: tbf counts whole frames, so TCP payload gets (MTU - 52) / (MTU + 14) of the
        rate, 93.6% at 1500 and 98.9% at 9000 (what a bandwidth check within 10% needs)."""
        if shutil.which("tc") is None:
            pytest.skip("`tc` (iproute2) is not installed")
        for i, name in enumerate(self.names):
            _ip("-n", name, "link", "set", IFNAME, "mtu", str(mtu))
            _ip("-n", self.switch, "link", "set", f"p{i}", "mtu", str(mtu))
            done = subprocess.run(
                ["tc", "-n", name, "qdisc", "add", "dev", IFNAME, "root", *tbf_args(rate_bit)],
                capture_output=True,
                text=True,
                timeout=30,
            )
            if done.returncode != 0:
                pytest.skip(f"tc tbf is not available here: {done.stderr.strip()}")
        _ip("-n", self.switch, "link", "set", "br0", "mtu", str(mtu))

    def drops(self) -> list[int]:
        """Packets each host's tbf dropped so far (``tc -s``): a full queue makes TCP back off,
        so a rate measured through a dropping queue reads the back-off as well as the link."""
        counts = []
        for name in self.names:
            done = subprocess.run(
                ["tc", "-s", "-n", name, "qdisc", "show", "dev", IFNAME],
                check=True,
                capture_output=True,
                text=True,
                timeout=30,
            )
            found = re.search(r"dropped (\d+)", done.stdout)
            counts.append(int(found.group(1)) if found else 0)
        return counts

    def unplug(self, i: int) -> None:
        """Take host i's link down (a node vanishing from the network)."""
        _ip("-n", self.names[i], "link", "set", IFNAME, "down")


def tbf_args(rate_bit: int) -> list[str]:
    """tbf with a bucket of max(64 KiB, 1 ms at the rate): at least one GSO super-packet (veth
    hands the qdisc up to 64 KiB at once; a smaller bucket makes tbf split it), small against
    the megabytes a bandwidth test times. ``latency 50ms`` sizes the queue: deep enough that
    TCP does not fall back to slow start, adding at most 50 ms. (This kernel has no netem, so
    no delay is added on purpose.)"""
    burst = max(64 * 1024, rate_bit // 8 // 1000)
    return ["tbf", "rate", f"{rate_bit}bit", "burst", str(burst), "latency", "50ms"]


@contextmanager
def hosts(n: int) -> Iterator[Hosts]:
    require()
    tag = uuid.uuid4().hex[:6]
    # A /24 of 10.0.0.0/8 from the tag: concurrent tests on one machine do not collide.
    b, c = 100 + int(tag[:2], 16) % 100, int(tag[2:4], 16)
    net = Hosts([f"mr{tag}h{i}" for i in range(n)], f"mr{tag}sw", f"10.{b}.{c}")
    made: list[str] = []
    try:
        _ip("netns", "add", net.switch)
        made.append(net.switch)
        _ip("-n", net.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", net.switch, "link", "set", "br0", "up")
        for i, name in enumerate(net.names):
            _ip("netns", "add", name)
            made.append(name)
            peer = f"p{i}"
            # Create the pair inside the host namespace, then move the peer to the switch.
            _ip("-n", name, "link", "add", IFNAME, "type", "veth", "peer", "name", peer)
            _ip("-n", name, "link", "set", peer, "netns", net.switch)
            _ip("-n", net.switch, "link", "set", peer, "master", "br0")
            _ip("-n", net.switch, "link", "set", peer, "up")
            _ip("-n", name, "addr", "add", f"{net.address(i)}/24", "dev", IFNAME)
            _ip("-n", name, "link", "set", IFNAME, "up")
            _ip("-n", name, "link", "set", "lo", "up")
        yield net
    finally:
        for name in reversed(made):
            # Kill what still runs inside, then delete; a leftover namespace would leak.
            pids = subprocess.run(
                ["ip", "netns", "pids", name], capture_output=True, text=True
            ).stdout.split()
            for pid in pids:
                subprocess.run(["kill", "-9", pid], capture_output=True)
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
