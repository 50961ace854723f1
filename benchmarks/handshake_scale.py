"""The launch's checked handshake at scale, simulated on one machine: N nodes, no agents.

Before torchrun's agent starts, every node of a multi-node ``meshrun launch`` publishes its
record (versions, config digest, the shared config) in the rendezvous store and the nodes
agree or stop together (``launch/multinode/handshake.py``). The real parts: torch's
``TCPStore`` server in a process of its own (its CPU read from /proc) and meshrun's
``Handshake``, signed records included. What is simulated: each node is a thread of this
process with a store client of its own; its record carries the default config's shared
settings, as a real node's does.

Per N: ``handshake_s`` from all nodes starting together (the host first, as its store is up
before any other node can connect) to the last one returning; ``ops_per_node`` and
``kb_per_node`` (store operations and the bytes they carry, both ways, per node, the host's
included); ``store_cpu_s``; how many records the host read (each once: as many as nodes) and
the others (none). The operations per node grow with the wall time (each waiting node looks
for the host's decision every half second), the record reads do not.

    .venv/bin/python benchmarks/handshake_scale.py --nodes 64,256,1024 [--timeout 600]

The nodes' Python (JSON, HMAC) shares this process's GIL, as in ``rdzv_scale.py``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from dataclasses import replace
from datetime import timedelta
from typing import Any

from rdzv_scale import Counting, StoreServer, emit
from torch.distributed import TCPStore

from meshrun.config import Config
from meshrun.launch.multinode.handshake import Handshake, HandshakeError
from meshrun.launch.multinode.nodes import shared_digest, shared_settings
from meshrun.runtime.secret import JobSecret

try:
    from meshrun.launch.multinode.records import JoinTarget
    from meshrun.launch.multinode.records import local_node_info as node_info
except ImportError:  # an older checkout (a "before" figure) kept them in handshake.py
    from meshrun.launch.multinode.handshake import JoinTarget  # type: ignore[attr-defined,no-redef]
    from meshrun.launch.multinode.handshake import (  # type: ignore[attr-defined,no-redef]
        local_node_info as node_info,
    )

SECRET = JobSecret(os.urandom(32).hex().encode(), "handshake_scale")


class Recording(Counting):
    """Counting, and the handshake records (``.../node/<slot>``) this node read."""

    def __init__(self, store: Any) -> None:
        super().__init__(store)
        self.records: list[str] = []

    def __getattr__(self, op: str) -> Any:
        call = super().__getattr__(op)
        if op not in ("get", "multi_get"):
            return call

        def noted(arg: Any) -> Any:
            keys = [arg] if isinstance(arg, str) else list(arg)
            self.records += [k for k in keys if "/node/" in k]
            return call(arg)

        return noted


def measure(n: int, timeout_s: float) -> dict[str, Any]:
    """One row: N nodes' handshake against one real store server."""
    server = StoreServer()
    cfg = Config()
    base = node_info(0, 8, shared_digest(cfg), shared_settings(cfg))
    try:
        stores = [
            Recording(TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(600)))
            for _ in range(n)
        ]
        results: list[Any] = [None] * n
        host_up = threading.Event()

        def run(i: int) -> None:
            info = replace(base, hostname=f"node{i}", node_rank=i, token=f"t{i:08d}")
            hs = Handshake(
                stores[i], "scale", info, JoinTarget(n, n), i == 0, timeout_s, _quiet, SECRET
            )
            if i == 0:
                host_up.set()
            try:
                results[i] = hs.run()
            except HandshakeError as err:
                results[i] = err

        cpu0 = server.cpu_s()
        began = time.perf_counter()
        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
        threads[0].start()
        host_up.wait()
        for t in threads[1:]:
            t.start()
        for t in threads:
            t.join()
        took = time.perf_counter() - began
        failed = [r for r in results if not isinstance(r, list)]
        if failed:
            raise RuntimeError(f"{len(failed)} of {n} nodes failed: {failed[0]!r}")
        return {
            "nodes": n,
            "handshake_s": round(took, 2),
            "ops_per_node": round(statistics.mean(s.ops for s in stores), 1),
            "kb_per_node": round(statistics.mean(s.bytes for s in stores) / 1024, 1),
            "record_kb": round(len(base.to_json()) / 1024, 2),
            "store_cpu_s": round(server.cpu_s() - cpu0, 2),
            "records_read_by_host": len(stores[0].records),
            "distinct_read_by_host": len(set(stores[0].records)),
            "records_read_by_others": sum(len(s.records) for s in stores[1:]),
        }
    finally:
        server.close()


def _quiet(_: str) -> None:
    pass


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="64,256,1024", help="simulated node counts")
    p.add_argument("--timeout", type=float, default=600.0, help="the handshake's join timeout")
    p.add_argument("--json", help="append each row to this file as a JSON line")
    a = p.parse_args(argv)
    print(
        "| nodes | handshake s | ops/node | KiB/node | record KiB | store CPU s "
        "| records read by the host (distinct) | by the others |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for n in [int(x) for x in a.nodes.split(",")]:
        row = measure(n, a.timeout)
        cells = [str(v) for v in row.values()]
        cells[6:8] = [f"{row['records_read_by_host']} ({row['distinct_read_by_host']})"]
        emit(row, cells, a.json)


if __name__ == "__main__":
    sys.exit(main())
