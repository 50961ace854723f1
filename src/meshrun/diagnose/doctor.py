"""``meshrun doctor``: a pre-flight checklist of this node, before a long job.

Each line is PASS, WARN or FAIL, with the fix for each FAIL (and WARN where there is one); the
exit status is 1 when anything FAILs. The checks themselves are small functions in
``doctor_checks.py``; ``meshrun launch --doctor`` runs the same checks on every rank of a real
launch and adds what needs all nodes (``doctor_worker.py``: versions compared, clock skew, a
timed all-reduce).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from meshrun.diagnose import doctor_checks as dc
from meshrun.diagnose.doctor_checks import Check

WORKER_MODULE = "meshrun.diagnose.doctor_worker"
LOOPBACK = "127.0.0.1"


@dataclass
class DoctorOptions:
    """What the local checks judge against; built from the CLI flags and the config."""

    nproc: int
    checkpoint_dir: Path
    rdzv_endpoint: str = ""  # "" = one node (loopback, a free port chosen at launch)
    interface: str = ""
    keep_last: int = 3
    num_workers: int = 0
    # "auto": bind the port on the node that owns the endpoint, connect from the others;
    # "connect": a running launch (the agent already listens there).
    port_mode: str = "auto"


def multi_host(opts: DoctorOptions) -> bool:
    """A job reaching other hosts: an endpoint that is not a loopback address."""
    if not opts.rdzv_endpoint:
        return False
    host, _ = dc.split_endpoint(opts.rdzv_endpoint)
    return not host.startswith("127.") and host != "localhost"


def local_checks(opts: DoctorOptions) -> list[Check]:
    """Every check of this node, in the order printed."""
    gpus = dc.gpu_count()
    host = dc.split_endpoint(opts.rdzv_endpoint)[0] if opts.rdzv_endpoint else LOOPBACK
    multi = multi_host(opts)
    checks = [
        dc.check_versions(),
        dc.check_gpus(gpus, opts.nproc),
        dc.check_interface(host, opts.interface, multi),
        _port_check(opts),
        dc.check_hostname(multi),
    ]
    checks += _env_checks(opts.nproc)
    checks.append(dc.check_shm(dc.shm_size(), dc.shm_needed(gpus, opts.num_workers, opts.nproc)))
    _, free = dc.disk_free(opts.checkpoint_dir)
    estimate = dc.checkpoint_estimate(opts.checkpoint_dir, opts.keep_last)
    checks.append(dc.check_disk(opts.checkpoint_dir, free, estimate))
    return checks


def _port_check(opts: DoctorOptions) -> Check:
    if not opts.rdzv_endpoint:
        return Check("port", "PASS", "one node: meshrun launch picks a free loopback port")
    host, port = dc.split_endpoint(opts.rdzv_endpoint)
    bind = opts.port_mode == "auto" and dc.rendezvous_is_here(host)
    return dc.check_port(host, port, bind=bind)


def _env_checks(nproc: int) -> list[Check]:
    from meshrun.launch.multinode.netif import SOCKET_IFNAME_VARS, list_interfaces

    names = [i.name for i in list_interfaces()]
    checks = [dc.check_socket_ifname(var, os.environ, names) for var in SOCKET_IFNAME_VARS]
    found = [c for c in checks if c is not None]
    found += dc.check_nccl_env(os.environ)
    found.append(dc.check_omp(os.environ, nproc, dc.usable_cores()))
    return found


# --- output --------------------------------------------------------------------------------


def render(rows: list[tuple[str, Check]], title: str) -> str:
    """The checklist as text: one line per (node, check), the fix under each FAIL/WARN."""
    width = max((len(c.name) for _, c in rows), default=8)
    nodes = any(node for node, _ in rows)
    node_width = max((len(node) for node, _ in rows), default=0)
    lines = [title]
    for node, c in rows:
        where = f"{node:<{node_width}}  " if nodes else ""
        lines.append(f"  {c.status}  {c.name:<{width}}  {where}{c.detail}")
        if c.fix and c.status != "PASS":
            lines.append(f"  {'':4}  {'':<{width}}  {'':<{len(where)}}fix: {c.fix}")
    counts = dc.summarize([c for _, c in rows])
    verdict = "FAILED" if counts["FAIL"] else "ok"
    lines.append(
        f"doctor: {verdict} ({counts['FAIL']} FAIL, {counts['WARN']} WARN, {counts['PASS']} PASS)"
    )
    return "\n".join(lines)


def exit_code(checks: list[Check]) -> int:
    return 1 if any(c.status == "FAIL" for c in checks) else 0
