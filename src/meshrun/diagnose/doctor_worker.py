"""``meshrun launch --doctor``: the doctor's checks on every rank of a real launch.

Started by torchrun's agent in place of the user's script (same flags, same rendezvous, same
interface choice), each rank runs the local checks of ``doctor.py``; then over the process
group: the checks are gathered to every rank (``all_gather_object``), the clock skew between
ranks is measured (wall clocks read right after a barrier), and a timed all-reduce (16 MiB)
gives the bus bandwidth. Rank 0 prints one table (one row per node where nodes differ) and
writes ``RUN_DIR/doctor.json``; every rank exits 1 on any FAIL.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from meshrun.diagnose import doctor_checks as dc
from meshrun.diagnose.doctor import DoctorOptions, exit_code, local_checks, render
from meshrun.diagnose.doctor_checks import Check

SKEW_WARN_S = 1.0
ALLREDUCE_BYTES = 16 * dc.MiB
ALLREDUCE_ITERS = 5
ALLREDUCE_TIMEOUT_S = 60.0
SKEW_ROUNDS = 5


def worker_options(cfg: Any, local_world: int, world: int) -> DoctorOptions:
    """The checks' inputs from the resolved config the launcher wrote and torchrun's env."""
    launch = cfg.launch
    endpoint = getattr(launch, "rdzv_endpoint", "")
    if not endpoint and world > local_world:  # several nodes: the workers' store host
        endpoint = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    # A requested interface, else the route to the endpoint (the launcher's own choice; the
    # GLOO/NCCL_SOCKET_IFNAME it exported are checked against the interfaces separately).
    interface = getattr(launch, "interface", "")
    ckpt = cfg.checkpoint.dir or str(cfg.resolved_run_dir() / "checkpoints")
    return DoctorOptions(
        nproc=local_world,
        checkpoint_dir=Path(ckpt),
        rdzv_endpoint=endpoint,
        interface=interface,
        keep_last=cfg.checkpoint.keep_last,
        num_workers=cfg.data.num_workers,
        port_mode="connect",  # the agent already listens on the endpoint
    )


# --- launch-wide checks (collectives: every rank calls them in the same order) --------------


def clock_skew(device: Any, rounds: int = SKEW_ROUNDS) -> Check:
    """Spread of the ranks' wall clocks read right after a barrier; the smallest of a few
    rounds (each round adds the barrier's own exit jitter, a few ms at most)."""
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    best: list[float] | None = None
    for _ in range(rounds):
        dist.barrier()
        now = torch.tensor([time.time()], dtype=torch.float64, device=device)
        times = [torch.zeros_like(now) for _ in range(n)]
        dist.all_gather(times, now)
        values = [float(t) for t in times]
        if best is None or max(values) - min(values) < max(best) - min(best):
            best = values
    assert best is not None
    spread = max(best) - min(best)
    worst = max(range(1, n), key=lambda r: abs(best[r] - best[0]))  # n >= 2 here
    detail = (
        f"{spread * 1e3:.1f} ms across {n} ranks (rank {worst} vs rank 0: "
        f"{(best[worst] - best[0]) * 1e3:+.1f} ms)"
    )
    if spread > SKEW_WARN_S:
        return Check(
            "clock skew",
            "WARN",
            detail + f", above {SKEW_WARN_S:.0f} s",
            "run NTP/chrony on every node: logs, timeouts and traces compare "
            "timestamps across nodes",
        )
    return Check("clock skew", "PASS", detail)


def timed_all_reduce(
    device: Any,
    nbytes: int = ALLREDUCE_BYTES,
    iters: int = ALLREDUCE_ITERS,
    timeout_s: float = ALLREDUCE_TIMEOUT_S,
) -> Check:
    """A correct sum, then ``iters`` all-reduces of ``nbytes``: the slowest rank's time and
    the bus bandwidth (nccl-tests: algbw x 2(n-1)/n). FAIL on an error or a timeout."""
    import torch
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    limit = timedelta(seconds=timeout_s)
    try:
        probe = torch.tensor([float(rank + 1)], device=device)
        dist.all_reduce(probe, async_op=True).wait(limit)
        if float(probe) != n * (n + 1) / 2:
            return Check(
                "all-reduce",
                "FAIL",
                f"wrong sum {float(probe)} (expected {n * (n + 1) // 2})",
                "check the backend and the devices",
            )
        data = torch.ones(nbytes // 4, device=device)
        dist.all_reduce(data, async_op=True).wait(limit)  # warm-up
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(data, async_op=True).wait(limit)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        took = torch.tensor([(time.perf_counter() - start) / iters], device=device)
        dist.all_reduce(took, op=dist.ReduceOp.MAX, async_op=True).wait(limit)
    except Exception as err:  # a timeout or a broken link: the check's verdict, not a crash
        return Check(
            "all-reduce",
            "FAIL",
            f"{nbytes / dc.MiB:.0f} MiB all-reduce failed: {' '.join(str(err).split())[:300]}",
            _AR_FIX,
        )
    seconds = float(took)
    busbw = nbytes / seconds * 2 * (n - 1) / n
    return Check(
        "all-reduce",
        "PASS",
        f"{nbytes / dc.MiB:.0f} MiB x {iters} on {n} ranks: "
        f"{seconds * 1e3:.1f} ms each, bus bandwidth {busbw / 1e9:.2f} GB/s",
    )


_AR_FIX = (
    "check the interface every node uses (GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME), firewalls "
    "between nodes, and NCCL_DEBUG=INFO output"
)


# --- merging every rank's checks into one table --------------------------------------------


def merge(reports: list[dict[str, Any]]) -> list[tuple[str, Check]]:
    """(node label, check) rows: one "all nodes" row where every node agrees, else one row per
    node; differing versions across nodes are a FAIL."""
    labels = _labels(reports)
    by_name: dict[str, list[tuple[str, Check]]] = {}
    for report, label in zip(reports, labels, strict=True):
        for d in report["checks"]:
            c = Check(**d)
            by_name.setdefault(c.name, [])
            if (label, c) not in by_name[c.name]:
                by_name[c.name].append((label, c))
    several = len(set(labels)) > 1
    rows: list[tuple[str, Check]] = []
    for name, found in by_name.items():
        distinct = {c for _, c in found}
        if len(distinct) == 1:
            rows.append(("all nodes" if several else "", found[0][1]))
            continue
        if name == "versions":
            fix = "install the same python, torch and meshrun on every node"
            found = [
                (lb, Check(c.name, "FAIL", c.detail + " (differs across nodes)", fix))
                for lb, c in found
            ]
        rows += found if several else [("", c) for _, c in found]
    return rows


def _labels(reports: list[dict[str, Any]]) -> list[str]:
    hosts = {(r["node_rank"], r["host"]) for r in reports}
    unique = len({h for _, h in hosts}) == len(hosts)
    return [r["host"] if unique else f"{r['host']}[node {r['node_rank']}]" for r in reports]


def _write_atomically(path: Path, doc: Any) -> None:
    # Nodes sharing a filesystem write the same file: each renames its own complete copy.
    tmp = path.with_name(f"{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=2))
    tmp.replace(path)


def worker() -> int:
    import torch.distributed as dist

    import meshrun

    run = meshrun.init(argv=[])
    env = run.cluster
    opts = worker_options(run.config, env.local_world_size, env.world_size)
    mine = {
        "rank": env.rank,
        "node_rank": env.node_rank,
        "host": socket.gethostname(),
        "checks": dc.as_dicts(local_checks(opts)),
    }
    reports: list[Any] = [None] * env.world_size
    dist.all_gather_object(reports, mine)
    rows = merge(reports)
    if env.world_size > 1:
        label = "all ranks" if any(node for node, _ in rows) else ""
        rows += [(label, clock_skew(run.device)), (label, timed_all_reduce(run.device))]
    checks = [c for _, c in rows]
    out = run.run_dir / "doctor.json"
    if env.local_rank == 0:  # every node keeps the whole table
        _write_atomically(out, [{"node": node, **c.to_dict()} for node, c in rows])
    if run.is_main:
        nodes = len({(r["node_rank"], r["host"]) for r in reports})
        title = f"meshrun launch --doctor: {env.world_size} process(es) on {nodes} node(s)"
        print(render(rows, title), flush=True)
    failed = sorted({c.name for c in checks if c.status == "FAIL"})
    if failed:
        # One line the launcher's failure summary quotes (it reads the failing rank's stderr).
        print(
            f"DoctorError: FAIL in {', '.join(failed)}: see the table printed by rank 0 and {out}",
            file=sys.stderr,
            flush=True,
        )
    return exit_code(checks)


if __name__ == "__main__":
    from meshrun.train.entry import main as _entry

    _entry(worker)()
