"""Run N launches of a plain distributed script while a thread keeps binding port 0.

``python port_race_launches.py N -- LAUNCH_ARGV...``: LAUNCH_ARGV is run N times (with the
plain barrier script appended); prints how often the hammer takes a port chosen the way
torch chooses MASTER_PORT, then ``launches=N failed=K`` and each failed launch's last lines. Run it inside a network namespace of its own (``unshare
-n``): it brings loopback up and narrows the ephemeral port range to 512 ports there, so the
hammer cycles through the whole range within the seconds between the agent choosing
MASTER_PORT and rank 0 listening on it, and the machine's own ports are never touched.
"""

from __future__ import annotations

import collections
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

SCRIPT = Path(__file__).with_name("plain_barrier.py")
HELD = 192  # sockets the hammer holds at once: over a third of the free ports


def own_namespace() -> None:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True, timeout=30)
    Path("/proc/sys/net/ipv4/ip_local_port_range").write_text("40000 40511\n")


def hammer(stop: threading.Event) -> None:
    """Bind port 0 (the OS's pick), hold the socket briefly, close it; over and over."""
    held: collections.deque[socket.socket] = collections.deque()
    while not stop.is_set():
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind(("127.0.0.1", 0))
            held.append(sock)
        except OSError:  # the range is full for a moment: let the oldest go below
            sock.close()
        if held and (len(held) > HELD or sock.fileno() == -1):
            held.popleft().close()
        time.sleep(0.0002)
    for sock in held:
        sock.close()


def hammer_takes(trials: int = 20, wait_s: float = 0.3) -> int:
    """How often a port chosen as torch chooses MASTER_PORT (bind port 0, close) is taken
    by the hammer ``wait_s`` later: the race this test would meet without the fix."""
    taken = 0
    for _ in range(trials):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        time.sleep(wait_s)
        with socket.socket() as again:
            again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                again.bind(("127.0.0.1", port))
            except OSError:
                taken += 1
    return taken


def main() -> int:
    n = int(sys.argv[1])
    launch = sys.argv[sys.argv.index("--") + 1 :]
    own_namespace()
    stop = threading.Event()
    threading.Thread(target=hammer, args=(stop,), daemon=True).start()
    failed = []
    try:
        print(f"hammer took {hammer_takes()}/20 closed port-0 picks", flush=True)
        for i in range(n):
            proc = subprocess.run(
                [*launch, str(SCRIPT)], capture_output=True, text=True, timeout=120
            )
            if proc.returncode != 0:
                tail = (proc.stdout + proc.stderr).strip().splitlines()[-6:]
                failed.append(f"launch {i}: exit {proc.returncode}: " + " / ".join(tail))
    finally:
        stop.set()
    print(f"launches={n} failed={len(failed)}")
    for line in failed:
        print(line[:2000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
