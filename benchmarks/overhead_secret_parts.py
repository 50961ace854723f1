"""What the job secret adds to a launch, part by part, in one process (less disturbed by a
busy machine than whole launches): reading or creating the secret file, creating the bound
rendezvous store with its signed attempt mark, and one 1-node rendezvous through meshrun's
signed backend against torch's c10d backend (each on a fresh store). Interleaved, medians.

    .venv/bin/python benchmarks/overhead_secret_parts.py [--rounds 30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from meshrun.launch.multinode.handshake import publish_attempt
from meshrun.launch.rdzv_signed import forget_store, listen_store, register
from meshrun.launch.secret import resolve
from meshrun.runtime.ports import free_port
from meshrun.runtime.secret import SECRET_ENV


def rendezvous(backend: str, port: int, run_id: str) -> float:
    params = RendezvousParameters(
        backend=backend,
        endpoint=f"127.0.0.1:{port}",
        run_id=run_id,
        min_nodes=1,
        max_nodes=1,
        local_addr="127.0.0.1",
        is_host="1",
    )
    start = time.perf_counter()
    handler = get_rendezvous_handler(params)
    handler.next_rendezvous()
    took = time.perf_counter() - start
    handler.shutdown()
    return took


def signed(i: int, tmp: Path) -> float:
    start = time.perf_counter()
    secret = resolve(str(tmp / f"run{i}"), {}, create=True)
    os.environ[SECRET_ENV] = secret.key.decode()
    store = listen_store("127.0.0.1", 0, 60)
    publish_attempt(store, f"job{i}", secret)
    setup = time.perf_counter() - start
    took = rendezvous("meshrun", store.port, f"job{i}")
    forget_store(store)
    return setup + took


def plain(i: int, tmp: Path) -> float:
    start = time.perf_counter()
    port = free_port()
    setup = time.perf_counter() - start
    return setup + rendezvous("c10d", port, f"plain{i}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=30)
    args = p.parse_args()
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    register()
    runs: dict[str, list[float]] = {"plain": [], "signed": []}
    variants: dict[str, Callable[[int, Path], float]] = {"plain": plain, "signed": signed}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            order = ["plain", "signed"] if i % 2 == 0 else ["signed", "plain"]
            for name in order:
                runs[name].append(variants[name](i, Path(tmp)))
    diffs = [s - q for s, q in zip(runs["signed"], runs["plain"], strict=True)]
    print(
        f"secret + store + 1-node rendezvous, {args.rounds} interleaved pairs: median plain "
        f"{statistics.median(runs['plain']):.4f} s, signed {statistics.median(runs['signed']):.4f}"
        f" s, median pair difference {statistics.median(diffs):+.4f} s"
    )


if __name__ == "__main__":
    main()
