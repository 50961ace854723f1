"""What one TCPStore server's CPU pays per store operation, by the operation and its keys.

The rendezvous at scale is limited by its one store (docs/scale.md): which of a backend's
operations cost that store most is what this measures. A TCPStore server runs in a process
of its own; one client makes each kind of operation ``--ops`` times; the server's CPU is read
from ``/proc/<pid>/task/*/schedstat`` (nanoseconds, every thread of the server) around each
batch. Each kind is answered by the store, so a batch is one operation after another, as an
agent makes them (a ``set`` is not answered: a batch of them would be pipelined, cheaper per
operation than an agent's one at a time). The kinds are interleaved, ``--reps`` times, and
the median of each is printed in microseconds of the server's CPU per operation.

    .venv/bin/python benchmarks/store_cost.py [--ops 400] [--reps 7]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from torch.distributed import TCPStore

_SERVER = (
    "import sys\nfrom datetime import timedelta\nfrom torch.distributed import TCPStore\n"
    "s = TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False,"
    " timeout=timedelta(seconds=60))\nprint(s.port, flush=True)\nsys.stdin.read()\n"
)
ENTRY_B = 250  # about one signed log entry or heartbeat key
PROBE = b"never-written"


def server_cpu_ns(pid: int) -> int:
    """The server's CPU so far, every thread's (its store runs in a thread of its own)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        total += int((task / "schedstat").read_text().split()[0])
    return total


def kinds(store: Any) -> dict[str, Callable[[], Any]]:
    """Each kind measured, after writing what it reads."""
    entries = {n: [f"e/{n}/{i}" for i in range(n)] for n in (4, 64, 256, 1024, 4096)}
    for keys in entries.values():
        store.multi_set(keys, [b"x" * ENTRY_B] * len(keys))
    chunks = [f"c/{i}" for i in range(16)]
    store.multi_set(chunks, [b"x" * (ENTRY_B * 64)] * 16)
    store.set("state", b"x" * (96 * 1024))  # the shared state at 1,024 nodes
    store.set("digest", b"x" * (40 * 1024))  # the heartbeat digest at 1,024 nodes
    return {
        "check, 1 key": lambda: store.check(["state"]),
        "compare_set probe of 96 KiB": lambda: store.compare_set("state", PROBE, PROBE),
        "compare_set probe of 40 KiB": lambda: store.compare_set("digest", PROBE, PROBE),
        "multi_get, 4 keys": lambda: store.multi_get(entries[4]),
        "multi_get, 64 keys": lambda: store.multi_get(entries[64]),
        "multi_get, 256 keys": lambda: store.multi_get(entries[256]),
        "multi_get, 1,024 keys": lambda: store.multi_get(entries[1024]),
        "multi_get, 4,096 keys": lambda: store.multi_get(entries[4096]),
        "multi_get, 4 x 256 keys": lambda: [
            store.multi_get(entries[1024][i : i + 256]) for i in range(0, 1024, 256)
        ],
        "multi_get, 16 chunks of 64": lambda: store.multi_get(chunks),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", type=int, default=400, help="operations of each kind per sample")
    p.add_argument("--reps", type=int, default=7, help="samples of each kind, interleaved")
    a = p.parse_args(argv)
    server = subprocess.Popen(
        [sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
        measured = kinds(store)
        samples: dict[str, list[float]] = {name: [] for name in measured}
        for _ in range(a.reps):
            for name, op in measured.items():
                before = server_cpu_ns(server.pid)
                for _ in range(a.ops):
                    op()
                samples[name].append((server_cpu_ns(server.pid) - before) / a.ops / 1e3)
        print(f"| operation | store CPU us per operation (median of {a.reps}) | min | max |")
        print("|---|---|---|---|")
        for name, got in samples.items():
            cells = (statistics.median(got), min(got), max(got))
            print(f"| {name} | " + " | ".join(f"{v:.1f}" for v in cells) + " |")
    finally:
        if server.stdin is not None:
            server.stdin.close()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
