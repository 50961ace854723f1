"""The one multi-process helper of the test suite: run a function in N real processes.

    def check(rank: int, world_size: int, scale: float) -> float:  # module level: it is pickled
        run = meshrun.init(cfg, argv=[])  # or dist.init_process_group("gloo", timeout=...)
        ...
        return value

    values = run_distributed(check, 2, 0.5)  # [rank 0's value, rank 1's value]

Each child is forked from a server that imported torch once (see ``_context``), and gets the
test's environment plus the torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT) and OMP_NUM_THREADS=1, so the code under test starts its process group
exactly as under ``torchrun``. A rank that raises fails the test with its traceback; a run that
outlives ``timeout`` is killed and fails naming the ranks that had not finished.

Children leave through ``destroy_process_group``, a flush and ``os._exit``: a Gloo worker can
abort in interpreter teardown (SIGABRT) even after ``destroy_process_group``, in 8-40% of
FSDP2/ZeRO runs measured here; skipping the teardown made 0 of 12 abort.
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from multiprocessing import forkserver, get_context
from multiprocessing.connection import Connection, wait
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from typing import Any, NoReturn, cast

import pytest

GRACE_S = 5.0  # after one rank fails, how long the others get to report before they are killed
EXIT_S = 15.0  # how long the ranks get to leave once all have returned

# What a child sends back: ("ok", pickled value) or ("error", formatted traceback); the
# parent records ("died", None) for a child that closed its pipe without sending.
Outcome = tuple[str, Any]


# Imported once by the fork server (see _context); never meshrun: its modules may read the
# environment when imported, and a child must see the test's.
PRELOAD = ("torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor")
_server_started: list[bool] = []

_next_port: list[int] = []  # this process's next candidate below the ephemeral range


def free_port() -> int:
    """A port that is free now and below the kernel's ephemeral range. The ranks bind
    it seconds later (after importing torch); a port from the ephemeral range (what binding
    port 0 returns) can be taken in between by any socket that connects somewhere on this
    machine, and was (EADDRINUSE in a full suite). Each pytest-xdist worker, and each process,
    draws from its own slice of 20000..(range start), so two never pick the same one."""
    low = _ephemeral_start()
    if low - 20000 < 4096:  # no room below the range on this machine: the kernel's choice
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    slices = 8
    width = (low - 20000) // slices
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    start = 20000 + (int(worker) % slices if worker.isdigit() else 0) * width
    if not _next_port:
        _next_port.append(start + os.getpid() % width)
    for _ in range(width):
        port = start + (_next_port[0] - start) % width
        _next_port[0] = port + 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # taken: the next one
            return port
    raise RuntimeError(f"no free port in {start}..{start + width - 1}")


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 20000  # unknown (not Linux): fall back to the kernel's choice


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 90.0,
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` new processes; return each
    rank's (picklable) return value in rank order. ``env`` is added to every child's
    environment, after (so over) the torchrun variables."""
    ctx = _context()
    # fn and args travel as bytes and are unpickled only after the environment is set: importing
    # fn's module imports torch, which reads OMP_NUM_THREADS once.
    blob = pickle.dumps((fn, world_size, args))
    common = {
        **os.environ,  # the test's environment now (monkeypatch included), as spawn would give
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "OMP_NUM_THREADS": "1",
    }
    procs: list[BaseProcess] = []
    readers: dict[Connection, int] = {}
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            rank_env = {**common, "RANK": str(rank), "LOCAL_RANK": str(rank), **(env or {})}
            proc = ctx.Process(
                target=_child, args=(rank, rank_env, blob, writer), name=f"rank{rank}"
            )
            proc.start()
            writer.close()  # the child now holds the only write end: EOF means it died
            procs.append(proc)
            readers[reader] = rank
        outcomes, timed_out = _collect(readers, time.monotonic() + timeout)
        if not timed_out and all(kind == "ok" for kind, _ in outcomes.values()):
            leave_by = time.monotonic() + EXIT_S
            for proc in procs:
                proc.join(max(0.0, leave_by - time.monotonic()))
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
    codes = [proc.exitcode for proc in procs]
    problems = _describe_problems(outcomes, codes, timed_out, timeout)
    if problems:
        pytest.fail(
            f"run_distributed({fn.__name__}, {world_size}) failed:\n{problems}", pytrace=False
        )
    return [pickle.loads(outcomes[rank][1]) for rank in range(world_size)]


def _collect(readers: dict[Connection, int], deadline: float) -> tuple[dict[int, Outcome], bool]:
    """Read each rank's outcome as it arrives (insertion order = order of arrival), until all
    have reported, the deadline passes, or GRACE_S after the first failure. Returns the
    outcomes and whether the deadline (the caller's timeout) cut it short."""
    outcomes: dict[int, Outcome] = {}
    pending = dict(readers)
    while pending:
        ready = wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            return outcomes, not any(kind != "ok" for kind, _ in outcomes.values())
        for conn in cast("list[Connection]", ready):
            rank = pending.pop(conn)
            try:
                outcomes[rank] = conn.recv()
            except EOFError:
                outcomes[rank] = ("died", None)
            conn.close()
            if outcomes[rank][0] != "ok":
                deadline = min(deadline, time.monotonic() + GRACE_S)
    return outcomes, False


def _describe_problems(
    outcomes: dict[int, Outcome], codes: list[int | None], timed_out: bool, timeout: float
) -> str:
    """Failing ranks first, in the order they failed; then ranks that never reported."""
    parts = []
    for rank, (kind, payload) in outcomes.items():
        if kind == "error":
            parts.append(f"--- rank {rank} raised:\n{payload}")
        elif kind == "died":
            parts.append(f"--- rank {rank} exited without a result (exit code {codes[rank]})")
    for rank, (kind, _) in outcomes.items():
        if kind == "ok" and codes[rank] != 0:
            parts.append(f"--- rank {rank} returned but exited with code {codes[rank]}")
    unfinished = [rank for rank in range(len(codes)) if rank not in outcomes]
    if unfinished:
        why = f"after the {timeout:g} s timeout" if timed_out else "when another rank had failed"
        parts.append(f"--- ranks {unfinished} had not finished {why}; killed")
    return "\n".join(parts)


def _context() -> BaseContext:
    """Children fork from a server that imported torch once per test process: torch's import
    is 2-3 s of CPU, which every rank of every run paid when they were spawned. The server
    starts with
    OMP_NUM_THREADS=1, read once when torch loads OpenMP; each child then takes the test's
    whole environment (:func:`_child`), as a spawned process would."""
    ctx = get_context("forkserver")
    if not _server_started:
        ctx.set_forkserver_preload(list(PRELOAD))
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"
        try:
            forkserver.ensure_running()
        finally:
            if saved is None:
                del os.environ["OMP_NUM_THREADS"]
            else:
                os.environ["OMP_NUM_THREADS"] = saved
        _server_started.append(True)
    return ctx


def _child(rank: int, env: dict[str, str], blob: bytes, conn: Connection) -> None:
    os.environ.clear()
    os.environ.update(env)
    try:
        fn, world_size, args = pickle.loads(blob)
        outcome: Outcome = ("ok", pickle.dumps(fn(rank, world_size, *args)))
    except BaseException:
        outcome = ("error", traceback.format_exc())
    code = 0 if outcome[0] == "ok" else 1
    try:
        # Report before tearing down: a failing rank's traceback must arrive even if its peers
        # hang in a collective.
        conn.send(outcome)
    except BaseException:
        traceback.print_exc()
        code = 1
    _leave(code)


def _leave(code: int) -> NoReturn:
    dist = sys.modules.get("torch.distributed")  # no torch import just to leave
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        code = code or 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
