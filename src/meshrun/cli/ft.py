"""``meshrun lighthouse``: torchft's lighthouse for a replica-group job on a cluster
(docs/fault_tolerance.md). One per job, on any host every group can reach; it is the job's
single point of failure. ``meshrun launch --replica-groups N`` starts its own on one node."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

__all__ = ["add_parser"]


def _cmd_lighthouse(a: argparse.Namespace) -> int:
    from meshrun.config import ConfigError
    from meshrun.config.fault_tolerance import check_lighthouse

    if a.min_replicas < 1:
        raise ConfigError(f"--min-replicas {a.min_replicas} is not allowed: must be >= 1")
    try:
        check_lighthouse(a.bind.replace("[::]", "any"))
    except ConfigError:
        raise ConfigError(
            f"--bind {a.bind!r} is not allowed: expected HOST:PORT with PORT in 1..65535, "
            "e.g. 0.0.0.0:29510 (every interface) or [::]:29510"
        ) from None
    os.environ.setdefault("RUST_LOG", "info")  # torchft's own default: a line per quorum
    try:
        from torchft.coordination import LighthouseServer
    except ImportError as err:
        raise ConfigError("meshrun lighthouse needs torchft: pip install 'meshrun[ft]'") from err
    server = LighthouseServer(
        bind=a.bind,
        min_replicas=a.min_replicas,
        join_timeout_ms=a.join_timeout_ms,
        heartbeat_timeout_ms=a.heartbeat_timeout_ms,
    )
    print(
        f"meshrun lighthouse: listening on {a.bind} ({server.address()}), min_replicas "
        f"{a.min_replicas}; Ctrl-C stops it",
        file=sys.stderr,
        flush=True,
    )
    if a.bind.rpartition(":")[0] in ("[::]", "0.0.0.0", ""):
        # torchft's lighthouse authenticates no one: every interface is every network's reach.
        print(
            "meshrun lighthouse: warning: listening on every interface; anyone who reaches "
            "the port can stall the job's quorums or restart its groups (docs/security.md): "
            "pass --bind ADDRESS:PORT of the interface the groups use",
            file=sys.stderr,
            flush=True,
        )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.shutdown()
    print("meshrun lighthouse: stopped", file=sys.stderr, flush=True)
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "lighthouse",
        help="run torchft's lighthouse for a replica-group job (docs/fault_tolerance.md)",
    )
    p.add_argument(
        "--bind",
        default="[::]:29510",
        metavar="HOST:PORT",
        help="address to listen on (default [::]:29510, every interface)",
    )
    p.add_argument(
        "--min-replicas",
        type=int,
        default=1,
        metavar="N",
        help="groups a quorum needs (match fault_tolerance.min_replicas)",
    )
    p.add_argument(
        "--heartbeat-timeout-ms",
        type=int,
        default=5000,
        metavar="MS",
        help="a group silent this long is dropped (fault_tolerance.heartbeat_timeout_ms)",
    )
    p.add_argument(
        "--join-timeout-ms",
        type=int,
        default=5000,
        metavar="MS",
        help="how long a quorum waits for groups that heartbeat but have not asked",
    )
    p.set_defaults(fn=_cmd_lighthouse)
