"""``meshrun launch --replica-groups N``: N replica groups on this node, each its own torchrun
job (its own world, TCPStore and restarts), and torchft's lighthouse for them
(docs/fault_tolerance.md).

A group that fails is restarted by its own agent (``--max-restarts``) and heals from a live
group; the other groups' processes never restart. The launcher starts the lighthouse itself
on loopback unless ``--lighthouse`` names one, and stops it (and every group) at the end.
torch elastic starts workers in their own session (setsid), so stopping a group kills its
agent's workers by PID too, not only the agent's process group.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

from meshrun.config import CONFIG_ENV, Config, apply_overrides, load_config, validate_for_world
from meshrun.config import write_config as write_config_file
from meshrun.launch.trust.secret import resolve
from meshrun.runtime.logs import say_launch
from meshrun.runtime.ports import LOCAL_HOST, free_port
from meshrun.runtime.secret import SECRET_ENV

__all__ = ["GroupPlan", "group_config", "launch_replica_groups", "run_lighthouse"]


STOP_GRACE_S = 10.0  # after SIGTERM, how long a group's agent gets before SIGKILL


class _Stop(Exception):
    """SIGTERM/SIGINT reached the launcher: stop every group."""


def group_pairs(
    cfg: Config, groups: int, index: int, lighthouse: str, nproc: int
) -> list[tuple[str, str]]:
    """The keys that make group ``index``'s config: its index, the lighthouse, its own run
    directory (each group's rank 0 writes its metrics and logs there), its process count."""
    return [
        ("fault_tolerance.replica_groups", str(groups)),
        ("fault_tolerance.group_index", str(index)),
        ("fault_tolerance.lighthouse", lighthouse),
        ("job.run_dir", str(cfg.resolved_run_dir() / f"group{index}")),
        ("launch.nproc_per_node", str(nproc)),
    ]


def group_config(
    cfg: Config, groups: int, index: int, lighthouse: str, nproc: int, nodes: int = 1
) -> Config:
    """Group ``index``'s copy of the resolved config (:func:`group_pairs`), checked for its
    world (``nodes`` x ``nproc``: the launch spec's node count, parsed once)."""
    out = copy.deepcopy(cfg)
    pairs = group_pairs(cfg, groups, index, lighthouse, nproc)
    apply_overrides(out, pairs, source="meshrun launch --replica-groups")
    validate_for_world(out, nproc * nodes)
    return out


@dataclass
class GroupPlan:
    """What ``launch_local`` hands over for ``--replica-groups``: the counts, the resolved
    config, and how to build one group's torchrun argv (local.py owns torchrun's flags)."""

    groups: int
    nproc_per_node: int  # all groups together
    config_path: str
    lighthouse: str  # --lighthouse; "" = the config's, else an embedded one
    # (group index, its run dir, its config path) -> torchrun argv
    argv_for: Callable[[int, str, str], list[str]]
    extra_env: dict[str, str] = field(default_factory=dict)
    nodes: int = 1  # the spec's node count (the CLI runs replica groups on one node)


def launch_replica_groups(plan: GroupPlan) -> int:
    """Start ``plan.groups`` torchrun jobs of ``nproc_per_node / groups`` processes; wait for
    all; return 0 when every group finished, else the first failing group's exit code. (The
    launcher has checked that the groups divide the processes and that the job is one node:
    launch/prepare.py's group_nproc.)"""
    groups = plan.groups
    cfg = load_config(plan.config_path)
    nproc = plan.nproc_per_node // groups
    # Every group's workers sign their quorum ids and heals with the job's secret (ft/auth.py).
    secret = resolve(str(cfg.resolved_run_dir()), {**os.environ, **plan.extra_env}, create=True)
    plan = dataclasses.replace(plan, extra_env={**plan.extra_env, SECRET_ENV: secret.key.decode()})
    with run_lighthouse(plan.lighthouse or cfg.fault_tolerance.lighthouse, cfg, groups) as addr:
        procs = [_start_group(plan, cfg, g, addr, nproc) for g in range(groups)]
        return _wait(procs)


@contextmanager
def run_lighthouse(given: str, cfg: Config, groups: int) -> Iterator[str]:
    """``given`` when set (a lighthouse someone else runs); else one on loopback for the life
    of the block, with the config's quorum size and heartbeat timeout."""
    if given:
        yield given.removeprefix("http://")
        return
    os.environ.setdefault("RUST_LOG", "warn")  # read at import: else a line per quorum tick
    from torchft.coordination import LighthouseServer

    ft = dataclasses.replace(cfg.fault_tolerance, replica_groups=groups)
    port = free_port(LOCAL_HOST)
    server = LighthouseServer(
        bind=f"{LOCAL_HOST}:{port}",
        min_replicas=ft.quorum_size(),
        join_timeout_ms=ft.heartbeat_timeout_ms,
        heartbeat_timeout_ms=ft.heartbeat_timeout_ms,
    )
    say_launch(f"lighthouse on {LOCAL_HOST}:{port} (min_replicas {ft.quorum_size()} of {groups})")
    try:
        yield f"{LOCAL_HOST}:{port}"
    finally:
        server.shutdown()


def _start_group(
    plan: GroupPlan, cfg: Config, index: int, lighthouse: str, nproc: int
) -> subprocess.Popen[bytes]:
    gcfg = group_config(cfg, plan.groups, index, lighthouse, nproc, plan.nodes)
    run_dir = gcfg.resolved_run_dir()
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.toml"
    write_config_file(gcfg, path)
    # The workers apply the script's --section.key=value overrides over the config file
    # (meshrun.init): the group's own keys go last, so a --job.run_dir there cannot undo them.
    tail = [f"--{k}={v}" for k, v in group_pairs(cfg, plan.groups, index, lighthouse, nproc)]
    argv = [*plan.argv_for(index, str(run_dir), str(path)), *tail]
    env = {**os.environ, **plan.extra_env, CONFIG_ENV: str(path.resolve())}
    # The restarts need it (agent/environment.py's SHARE_STORE_ENV); OMP threads: cores / processes.
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    cores = max(1, (os.cpu_count() or 1) // plan.nproc_per_node)
    env.setdefault("OMP_NUM_THREADS", str(cores))
    env.setdefault("RUST_LOG", "warn")  # torchft's servers log every quorum at info
    say_launch(f"group {index}: {nproc} process(es), run dir {run_dir}")
    # torchrun with meshrun's signed rendezvous: its store bound to the group's endpoint
    # (loopback), its state signed JSON, never a pickle read back (launch/trust/rendezvous.py).
    return subprocess.Popen(
        [sys.executable, "-m", "meshrun.launch.trust.rendezvous", *argv],
        env=env,
        start_new_session=True,
    )


def _wait(procs: list[subprocess.Popen[bytes]]) -> int:
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    for sig in previous:
        signal.signal(sig, _raise_stop)
    try:
        while any(p.poll() is None for p in procs):
            time.sleep(0.2)
    except _Stop:
        say_launch("stopping every replica group")
        for p in procs:
            stop_group(p)
        return 128 + signal.SIGTERM
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    codes = [p.returncode for p in procs]
    for index, code in enumerate(codes):
        if code:
            say_launch(f"group {index} failed (exit code {code})")
    return next((c for c in codes if c), 0)


def _raise_stop(signum: int, frame: object) -> None:
    raise _Stop(signum)


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the agent (it stops its workers), then SIGKILL it and any worker left: the
    workers are in sessions of their own, outside the agent's process group."""
    workers = descendants(proc.pid)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    for pid in workers:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (read from /proc; empty where there is none)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        kids = [c for c, p in parents.items() if p in frontier]
        found += kids
        frontier = kids
    return found
