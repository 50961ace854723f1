"""Rendezvous at scale, simulated on one machine: N agents, no workers.

The real parts: torch's ``TCPStore`` server (in a process of its own, so its CPU can be read
from /proc), torch's ``DynamicRendezvousHandler`` (join, rounds, keep-alive), over meshrun's
signed backend (``launch/trust/rendezvous.py``, wrapped as ``create_signed_handler`` wraps it) or
torch's own c10d backend. What is simulated: each agent is a thread of this process with a
TCPStore client of its own and a node address of its own (``10.x.y.z``); no worker starts.

Per N and backend:
- ``first_s``: from all agents calling ``next_rendezvous`` together to the last one returning
  (torch spreads round 0's joins over 0-0.3 s);
- ``restart_s``: one node stops (no exit, no heartbeat: a dead host), the others call
  ``next_rendezvous`` again; the time until the last returns in a round of N-1. It includes
  torch's fixed waits: the dead node's heartbeats must be missed (``keep_alive_interval`` x
  ``keep_alive_max_attempt``) and the last call (``last_call_timeout``); ``restart_work_s`` is
  the time beyond them;
- ``ops_per_node`` and ``kb_per_node``: the store operations of meshrun's backend (get,
  compare_set, ... of the shared state and of its mark, the per-node heartbeat keys)
  or of c10d's, and
  the bytes they carry, both ways, per agent, over both rounds;
- ``state_kb``: the size of the state value once N nodes joined;
- ``idle_b_per_s``: between the rounds, every agent asks ``num_nodes_waiting`` once a second
  for ``--idle`` seconds, as torchrun's agent does while its workers train: the store bytes
  per node per second of that phase (not in the other columns);
- ``store_cpu_s``: the store server process's CPU seconds over both rounds; ``store_load``:
  that over the rounds' (virtual) seconds, the share of one core the store needs to keep
  their pace (over 1, a real store would fall behind);
- ``agent_cpu_ms_per_s``: this process's CPU over both rounds and the idle phase, per agent
  and per (virtual) second: what a host spends on its agent's rendezvous; the JSON row's
  ``agent_cpu_s_by_phase`` gives this process's CPU seconds in each phase (first round, idle,
  restart), which is where a simulation's wall time goes;
- ``dilate`` and ``wall_s``: the clock's dilation K or "event" (below) and the run's real
  seconds.

``--dilate K`` runs the agents on a clock K times slower than the real one
(``virtual_clock.py``): every clock the rendezvous code reads is virtual and every sleep K
times longer, so each agent gets K times the CPU per virtual second, as on a machine with K
times the cores; the protocol's waits (keep-alive, heartbeat expiry, last call, 1 s polls) keep
their virtual length. Every time in the table is then virtual seconds, but ``wall_s``; the
store server's CPU is real, and undilated. The agents' own Python (JSON or pickle, HMAC)
shares this process's GIL: at large N, or on a busy machine, they starve even so.

``--dilate event`` runs them on an event clock (``event_clock.py``): virtual time stands still
while any agent works and jumps to the next wake-up when all wait, each agent's own CPU
charged to its clock as on a host of its own. The store and the network take no virtual
time (the store's CPU is measured apart). The times are then the protocol's waits and each
node's own work, the same under any load, and nothing starves.

    .venv/bin/python benchmarks/rdzv_scale.py --nodes 64,256,1024 [--backends meshrun,c10d]
        [--dilate K|event]

An older checkout's ``src`` first on PYTHONPATH gives its "before" row: its agent is composed
as that checkout did (``rdzv_before.py``).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import resource
import secrets
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from torch.distributed import PrefixStore, TCPStore
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

# The clock is a sibling file, not a package: tests load this script by its path (importlib),
# where the script's folder is not on sys.path.
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import event_clock
import rdzv_before
import shared_objects
import virtual_clock
from event_clock import EventClock
from rdzv_before import SECRET_ENV, from_env
from virtual_clock import AnchoredClock as Clock

BACKENDS = ("meshrun", "c10d")
IDLE_SETTLE_S = 10.0  # idle polling before the idle bytes are counted (``idle``)
KEEP_ALIVE_S, KEEP_ALIVE_TRIES, LAST_CALL_S = 5, 3, 1  # torch's defaults but the last call's 30
LAUNCH_NONCE = "rdzv-scale-bench"  # one simulated launch: every agent signs with this nonce

_SERVER = (
    "import sys\nfrom datetime import timedelta\nfrom torch.distributed import TCPStore\n"
    "s = TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False,"
    " timeout=timedelta(seconds=600))\nprint(s.port, flush=True)\nsys.stdin.read()\n"
)


class Counting:
    """A store proxy counting the operations an agent's backend makes and their bytes."""

    def __init__(self, store: Any) -> None:
        self._store, self.ops, self.bytes = store, 0, 0
        self.kinds: collections.Counter[str] = collections.Counter()  # "op:key family"
        # The keys each kind carries (a multi_get of N keys: N): the store's CPU goes by key.
        self.keys: collections.Counter[str] = collections.Counter()

    def __getattr__(self, op: str) -> Any:
        call = getattr(self._store, op)

        def counted(*args: Any) -> Any:
            result = call(*args)
            self.ops += 1
            kind = f"{op}:{_family(args[0] if args else '')}"
            self.kinds[kind] += 1
            self.keys[kind] += len(args[0]) if args and isinstance(args[0], list) else 1
            self.bytes += sum(_size(a) for a in args) + _size(result)
            return result

        return counted


def _family(key: Any) -> str:
    """What a key is, without the run and the node: ``log`` for ``meshrun.rdzv/<run>/log/17``,
    ``state`` for the state key itself (a list of keys: its first)."""
    if isinstance(key, list):
        key = key[0] if key else ""
    parts = str(key).split("/")
    if len(parts) <= 2:
        return "state"
    return parts[2]


def _size(value: Any) -> int:
    if isinstance(value, (bytes, str)):
        return len(value)
    if isinstance(value, list):
        return sum(_size(v) for v in value)
    if isinstance(value, int):  # add's amount and answer: eight bytes on the wire
        return 8
    return 0


class StoreServer:
    """torch's TCPStore server in a child process; its CPU seconds read from /proc."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())

    def cpu_s(self) -> float:
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


@dataclass
class Agent:
    handler: RendezvousHandler
    counter: Counting


def make_agent(
    backend: str, port: int, n: int, i: int, run_id: str, clock: Clock, keep_alive_s: int
) -> Agent:
    params = RendezvousParameters(
        backend=backend,
        endpoint=f"127.0.0.1:{port}",
        run_id=run_id,
        min_nodes=n - 1,
        max_nodes=n,
        local_addr=f"10.{i // 65536}.{i // 256 % 256}.{i % 256}",
        join_timeout=900,
        last_call_timeout=LAST_CALL_S,
        keep_alive_interval=keep_alive_s,
        keep_alive_max_attempt=KEEP_ALIVE_TRIES,
    )
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=900))
    if backend == "meshrun":  # as create_signed_handler composes it, the store counted
        secret = from_env()
        counter = Counting(store)
        # The handler's keep-alive settings, as create_signed_handler passes them (an older
        # checkout's backend: rdzv_before.py)
        signed = rdzv_before.signed_backend(counter, run_id, secret, LAUNCH_NONCE, _said, params)
        prefixed = PrefixStore(f"meshrun.{secret.tag(run_id)}", store)
        handler = create_handler(_clocked(prefixed, clock), signed, params)
        return Agent(rdzv_before.held(handler), counter)
    c10d = C10dRendezvousBackend(store, run_id)
    counter = Counting(c10d._store)
    c10d._store = counter  # type: ignore[assignment]
    return Agent(create_handler(_clocked(store, clock), c10d, params), counter)


def _clocked(store: Any, clock: Clock) -> Any:
    """The handler's store: on an event clock, one whose blocking ``get`` waits on it."""
    return event_clock.ClockedStore(store, clock) if isinstance(clock, EventClock) else store


def _said(line: str) -> None:
    """A backend's line (a refused or deleted state): never expected here, so printed."""
    print(f"an agent's backend said: {line}", file=sys.stderr, flush=True)


def torch_handler(agent: Agent) -> Any:
    """torch's handler, under HeldPortHandler where it is wrapped (its privates are read)."""
    return getattr(agent.handler, "_inner", agent.handler)


def stop_heartbeats(agent: Agent) -> None:
    torch_handler(agent)._stop_heartbeats()


def die_after_next_heartbeat(agent: Agent) -> None:
    """Return once ``agent``'s keep-alive timer has sent its next heartbeat and stopped: the
    node then dies at its last heartbeat, and every restart waits the same 15 s for it to be
    missed (stopped at any moment instead, its last heartbeat was 0-5 s old and restarts took
    13.4 or 17.4 s, depending on where the idle phase ended)."""
    handler = torch_handler(agent)
    beat, sent = handler._keep_alive, threading.Event()

    def last_beat() -> None:
        beat()
        handler._keep_alive_timer._ctx.stop_event.set()  # its loop ends (a join from here would not)
        sent.set()

    handler._keep_alive = last_beat
    sent.wait()
    handler._keep_alive = beat
    stop_heartbeats(agent)


def all_join(
    agents: list[Agent], clock: Clock, stall_s: float = 0.0, dead: Agent | None = None
) -> tuple[float, list[tuple[int, int]]]:
    """Every agent's ``next_rendezvous`` at once; seconds on ``clock`` until the last
    returned, and the (rank, world size) each got. ``stall_s`` (on ``clock`` too): past it,
    print once where every agent is; with any ``stall_s``, each agent's return is said as it
    comes."""
    verbose = stall_s > 0
    errors: list[BaseException] = []
    got: list[tuple[int, int]] = []
    returned: list[float] = []  # each agent's return, on ``clock``, read in its own thread
    start = threading.Barrier(len(agents) + 1)

    def join(agent: Agent) -> None:
        start.wait()
        try:
            info = agent.handler.next_rendezvous()
            # Read here: the clock may move on before the caller reads it (``began`` below).
            returned.append(clock.perf_counter())
            got.append((info.rank, info.world_size))
            if verbose:
                state = torch_handler(agent)._state_holder.state
                print(
                    f"an agent returned: rank {info.rank} of {info.world_size}, round "
                    f"{state.round}, {len(state.participants)} participants",
                    file=sys.stderr,
                    flush=True,
                )
        except BaseException as err:  # reported below, with the others; said at once too
            errors.append(err)
            print(f"an agent's next_rendezvous failed: {err!r}", file=sys.stderr, flush=True)

    threads = [threading.Thread(target=join, args=(a,), daemon=True) for a in agents]
    for t in threads:
        t.start()
    # Read before the agents go: once the last one has returned and only keep-alive timers
    # wait, an event clock moves to their next beat (up to 5 s) before this thread reads it
    # again (first rounds of 5.3 s instead of 1.3, one run in eight at 64 nodes).
    began = clock.perf_counter()
    start.wait()
    for t in threads:
        while t.is_alive():
            t.join(timeout=1.0)
            if stall_s and clock.perf_counter() - began > stall_s:
                print(stall_report(agents, threads, clock, dead), file=sys.stderr, flush=True)
                stall_s = 0.0
    if errors:
        raise RuntimeError(f"{len(errors)} agents failed: {errors[0]!r}")
    return max(returned) - began, got


def stall_report(
    agents: list[Agent], threads: list[threading.Thread], clock: Clock, dead: Agent | None
) -> str:
    """Where each agent's thread is (its innermost rendezvous or meshrun frame, counted), and
    what its handler holds: participants, wait list, and the age of the dead node's heartbeat
    in its last synced state and in what its backend has seen (ages on ``clock``, the one the
    handlers read)."""
    from collections import Counter

    frames = sys._current_frames()
    where: Counter[str] = Counter()
    for t in threads:
        frame, spot = frames.get(t.ident or -1), "returned"
        while frame is not None:
            name = frame.f_code.co_filename
            if "rendezvous" in name or "meshrun" in name:
                spot = f"{os.path.basename(name)}:{frame.f_code.co_name}:{frame.f_lineno}"
                break
            frame = frame.f_back
        where[spot] += 1
    now = datetime.fromtimestamp(clock.time(), timezone.utc)
    dead_node = None
    if dead is not None:
        dead_node = torch_handler(dead)._this_node
    views: Counter[str] = Counter()
    for agent in agents:
        holder = torch_handler(agent)._state_holder
        st = holder.state
        age = "-"
        if dead_node is not None and dead_node in st.last_heartbeats:
            age = f"{(now - st.last_heartbeats[dead_node]).total_seconds():.0f}"
        seen = "-"
        hb = getattr(holder._backend, "_hb", None)
        if hb is not None and dead_node in hb._seen:
            seen = f"{(now - hb._seen[dead_node]).total_seconds():.0f}"
        synced = clock.monotonic() - holder._last_sync_time
        views[
            f"round {st.round} complete {st.complete} participants {len(st.participants)} "
            f"(dead in: {dead_node in st.participants}) wait {len(st.wait_list)} dead hb age "
            f"held {age} s seen {seen} s, synced {synced:.0f} s ago"
        ] += 1
    lines = ["STALL: agent threads at:"]
    lines += [f"  {n:4d} x {spot}" for spot, n in where.most_common()]
    lines += ["STALL: agents' views:"]
    lines += [f"  {n:4d} x {view}" for view, n in views.most_common(12)]
    return "\n".join(lines)


def odd_views(agents: list[Agent], clock: Clock) -> str:
    """After a round whose nodes disagree on the world: for each agent whose world differs
    from the most common one, the nodes its round lacks, and what its backend holds of them
    (the newest log entry, the newest heartbeat seen) and of itself."""
    from collections import Counter

    states = [torch_handler(a)._state_holder.state for a in agents]
    common = Counter(len(s.participants) for s in states).most_common(1)[0][0]
    full = next(s for s in states if len(s.participants) == common)
    now = datetime.fromtimestamp(clock.time(), timezone.utc)
    lines = [f"ODD: {common} participants in most views, at {now.isoformat()}"]
    for agent, state in zip(agents, states, strict=True):
        if len(state.participants) == common:
            continue
        me = torch_handler(agent)._this_node
        backend = torch_handler(agent)._state_holder._backend
        log, hb = getattr(backend, "_log", None), getattr(backend, "_hb", None)

        def held(node: Any, log: Any = log, hb: Any = hb) -> str:
            entry = log.newest.get(node) if log is not None else None
            seen = hb._seen.get(node) if hb is not None else None
            age = f"{(now - seen).total_seconds():.1f}" if seen else "-"
            return f"entry {entry and (entry.slot, entry.round, entry.place)} hb age {age}"

        lines.append(
            f"ODD: agent {me} world {len(state.participants)} round {state.round} "
            f"complete {state.complete} wait {len(state.wait_list)} log next "
            f"{log.next if log else '-'}; itself: {held(me)}"
        )
        for node in [n for n in full.participants if n not in state.participants][:10]:
            lines.append(f"ODD:   lacks {node}: {held(node)}")
    return "\n".join(lines)


def idle(agents: list[Agent], seconds: float, clock: Clock) -> float:
    """Every agent polls ``num_nodes_waiting`` once a second (torchrun's agent asks it in its
    monitor loop while the workers train) for ``IDLE_SETTLE_S`` and then ``seconds`` more; the
    bytes per node per second over those ``seconds`` (the keep-alives' included), both on
    ``clock``. The first seconds after a round are not steady: every heartbeat the round wrote
    is fresh, and no node reads a heartbeat key before one is 12.5 s old (a 10 s window
    measured 763 B/s or 2,942 B/s at 64 nodes, depending on where it fell)."""
    before = [a.counter.bytes for a in agents]
    ops = [
        (a.counter.ops, collections.Counter(a.counter.kinds), a.counter.keys.copy()) for a in agents
    ]
    settled = clock.monotonic() + IDLE_SETTLE_S
    stop = settled + seconds
    start = threading.Barrier(len(agents) + 1)  # on an event clock, none may wait before all run
    rates: list[float] = []

    def poll(agent: Agent) -> None:
        start.wait()
        mark: tuple[int, float] | None = None
        while (now := clock.monotonic()) < stop:
            if mark is None and now >= settled:
                mark = (agent.counter.bytes, now)
            agent.handler.num_nodes_waiting()
            clock.sleep(1.0)
        if mark is not None:
            rates.append((agent.counter.bytes - mark[0]) / (clock.monotonic() - mark[1]))

    threads = [threading.Thread(target=poll, args=(a,), daemon=True) for a in agents]
    for t in threads:
        t.start()
    start.wait()
    for t in threads:
        t.join()
    for a, b, (o, k, keys) in zip(
        agents, before, ops, strict=True
    ):  # the rounds' columns leave it out
        a.counter.bytes, a.counter.ops, a.counter.kinds, a.counter.keys = b, o, k, keys
    return statistics.mean(rates)


def cheap_event_names() -> None:
    """torch's handler names each event it records (every join, keep-alive, leave) with two
    calls of ``inspect.stack()``: 2.8 ms for a 25-frame thread here, each agent's own CPU on
    a real host, but serialised across all N agents of this one process (124 of 256 agent
    threads were in it at one stall report). The same name from one frame lookup."""
    import torch.distributed.elastic.rendezvous.dynamic_rendezvous as dynamic

    def get_method_name(depth: int = 2) -> str:
        frame = sys._getframe(depth)  # 0: this function, 1: _record, 2: its caller
        return frame.f_code.co_name

    dynamic.get_method_name = get_method_name


def measure(
    backend: str,
    n: int,
    stall_s: float = 0.0,
    idle_s: float = 0.0,
    dilate: float | str = 1.0,
    restart: bool = True,
    trace_dead: bool = False,
    keep_alive_s: int = KEEP_ALIVE_S,
) -> dict[str, Any]:
    """One row of the table (see the module); raises if a round is not what it must be.
    ``dilate``: the agents' clock runs that many times slower than the real one, or is an
    event clock ("event"); ``stall_s``, ``idle_s`` and the row's times but ``wall_s`` are on
    that clock. ``restart`` False: the first round only (the restart's columns empty, the
    others over that round)."""
    cheap_event_names()
    os.environ.setdefault(SECRET_ENV, secrets.token_hex(32))
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # as meshrun launch sets it
    began = time.perf_counter()  # the real clock: this module's own ``time`` is never dilated
    raise_open_files(n)
    server = StoreServer()
    try:
        clocked = event_clock.events() if dilate == "event" else virtual_clock.dilate(float(dilate))
        # meshrun's pickles never leave this process: its agents share what they decode alike
        # (shared_objects.py); c10d's go to the store, and their bytes are measured as torch
        # makes them: its agents share the nodes and times of each state they unpickle,
        # swapped after the load, each distinct object for a distinct one (its bytes
        # unchanged; peak memory at 512 nodes 362 MB instead of 520).
        with clocked as clock, _sharing(backend, clock):
            row = _rounds(
                backend, n, server, clock, stall_s, idle_s, restart, trace_dead, keep_alive_s
            )
        if missed := getattr(clock, "missed_sets", 0):  # event_clock.ClockedStore
            print(
                f"{missed} wait(s) for a key ended by the fallback poll, not by the set: "
                "their agents went on up to 1 virtual second late",
                file=sys.stderr,
                flush=True,
            )
        return Row(**row, dilate=dilate, wall_s=round(time.perf_counter() - began, 1)).__dict__
    finally:
        server.close()


def _sharing(backend: str, clock: Any) -> contextlib.AbstractContextManager[None]:
    if backend == "meshrun":
        return shared_objects.shared()
    return shared_objects.shared_loads(getattr(clock, "uncharged", contextlib.nullcontext))


def _rounds(
    backend: str,
    n: int,
    server: StoreServer,
    clock: Clock,
    stall_s: float,
    idle_s: float,
    restart: bool,
    trace_dead: bool = False,
    keep_alive_s: int = KEEP_ALIVE_S,
) -> dict[str, Any]:
    """The row's columns but ``dilate`` and ``wall_s``: both rounds, the idle phase between
    them, every agent's heartbeats stopped at the end (their timers run on ``clock``).
    ``trace_dead``: say every live node a handler drops as dead (``rdzv_trace.py``)."""
    run_id = f"scale{n}"
    agents = [make_agent(backend, server.port, n, i, run_id, clock, keep_alive_s) for i in range(n)]
    untrace = None
    if trace_dead:
        import rdzv_trace  # here: it reads the current checkout's heartbeat keys

        untrace = rdzv_trace.install(agents, torch_handler, server.port, clock, LAUNCH_NONCE)
        rdzv_trace.expect_dead(torch_handler(agents[-1])._this_node)

    def own_cpu() -> float:
        """This process's CPU so far, the garbage collector's passes and the shared objects'
        swaps left out: this process's work, not a host's (event_clock.EventClock.gc_pass and
        uncharged; the dilated clock does not count them)."""
        return (
            time.process_time() - getattr(clock, "gc_s", 0.0) - getattr(clock, "uncharged_s", 0.0)
        )

    try:
        cpu0 = server.cpu_s()
        marks = {"start": own_cpu()}  # own_cpu() at the start and at each phase's end
        first, got = all_join(agents, clock, stall_s)
        marks["first"] = own_cpu()
        say_phase(f"{backend} {n}: first round", marks, clock)
        if trace_dead:
            rdzv_trace.say_charges(clock, "first round")
        _check_round(got, n)
        state = agents[0].counter._store.get(
            f"meshrun.rdzv/{run_id}" if backend == "meshrun" else f"torch.rendezvous.{run_id}"
        )
        # The idle phase's store CPU is its own column: over the rounds' seconds it made the
        # store load of both-round rows about 2x too high for meshrun and 2.6x for c10d at
        # 1,024 nodes (until 2026-12-07).
        idle_cpu0 = server.cpu_s()
        idle_b = idle(agents, idle_s, clock) if idle_s > 0 else 0.0
        idle_cpu = server.cpu_s() - idle_cpu0
        marks["idle"] = own_cpu()
        if idle_s > 0:
            say_phase(f"{backend} {n}: idle", marks, clock)
        idle_total = IDLE_SETTLE_S + idle_s if idle_s > 0 else 0.0
        again, live = None, agents
        if restart:
            dead = agents[-1]
            die_after_next_heartbeat(dead)  # the host is gone: no exit, no heartbeat
            live = agents[:-1]
            again, got = all_join(live, clock, stall_s, dead)
            if trace_dead:
                rdzv_trace.say_charges(clock, "restart")
            try:
                _check_round(got, n - 1)
            except RuntimeError:
                print(odd_views(live, clock), file=sys.stderr, flush=True)
                raise
        cpu = server.cpu_s() - cpu0 - idle_cpu
        marks["restart"] = own_cpu()
        if restart:
            say_phase(f"{backend} {n}: restart", marks, clock)
        own = marks["restart"] - marks["start"]
    finally:
        for agent in agents:
            stop_heartbeats(agent)
        if untrace is not None:
            untrace()
    waits = keep_alive_s * KEEP_ALIVE_TRIES + LAST_CALL_S
    rounds_s = first + (again or 0.0)
    return dict(
        backend=backend,
        nodes=n,
        first_s=round(first, 2),
        restart_s=None if again is None else round(again, 2),
        restart_work_s=None if again is None else round(max(0.0, again - waits), 2),
        ops_per_node=round(statistics.mean(a.counter.ops for a in agents), 1),
        kb_per_node=round(statistics.mean(a.counter.bytes for a in live) / 1024, 1),
        state_kb=round(len(state) / 1024, 1),
        store_cpu_s=round(cpu, 2),
        # The share of one core the store needs to keep the rounds' pace in real time; over 1
        # the real store would fall behind (the event clock's rounds do not wait for it).
        store_load=round(cpu / rounds_s, 3),
        # A host's CPU for its agent, per second of the rounds (this process's CPU, the idle
        # phase's included, over N agents).
        agent_cpu_ms_per_s=round(1000 * own / n / (rounds_s + idle_total), 2),
        idle_b_per_s=round(idle_b),
        idle_store_load=round(idle_cpu / idle_total, 3) if idle_total else None,
        ops_by_kind=_per_node(agents),
        keys_by_kind=_per_node(agents, keys=True),
        agent_cpu_s_by_phase=_phases(marks, restart),
        keep_alive_s=keep_alive_s,
    )


def say_phase(what: str, marks: dict[str, float], clock: Any) -> None:
    """One line on stderr as a phase ends: a run of hours that is stopped still leaves its
    finished phases' figures (the process's CPU in it, the collector's so far, the memory)."""
    last = list(marks.values())
    gc_s = getattr(clock, "gc_s", None)
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    print(
        f"{what} done: {last[-1] - last[-2]:.1f} s of this process's CPU"
        + ("" if gc_s is None else f", the collector's {gc_s:.1f} s so far")
        + f", peak RSS {rss_mb} MB, at {time.strftime('%H:%M:%S')}",
        file=sys.stderr,
        flush=True,
    )


def _phases(marks: dict[str, float], restart: bool) -> dict[str, float | None]:
    """This process's CPU seconds in each phase (all agents, the event clock's own work in,
    the collector's passes out): where a simulation's time goes, and each phase's growth
    with N (docs/scale.md: at 512 nodes first round 12.1 s, idle 54.4 s, restart 68.6 s)."""
    return {
        "first": round(marks["first"] - marks["start"], 1),
        "idle": round(marks["idle"] - marks["first"], 1),
        "restart": round(marks["restart"] - marks["idle"], 1) if restart else None,
    }


def _per_node(agents: list[Agent], keys: bool = False) -> dict[str, float]:
    """Each kind of store operation (``op:key family``) per node, most first: where the
    ``ops/node`` column's operations go; ``keys``: the keys they carried instead."""
    total: collections.Counter[str] = collections.Counter()
    for a in agents:
        total.update(a.counter.keys if keys else a.counter.kinds)
    return {k: round(v / len(agents), 1) for k, v in total.most_common()}


def raise_open_files(n: int) -> None:
    """Each agent holds a store client socket and a held-port socket in this process, and the
    store server (a child: it inherits the limit) one socket per agent: at 4,096 nodes that
    nears a soft limit of 8,192 or less. Raise the soft limit to the hard one if needed, and
    say so."""
    need = 3 * n + 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        new = hard if hard == resource.RLIM_INFINITY else max(soft, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        print(f"open files: soft limit {soft} raised to {new} for {n} nodes", file=sys.stderr)
        soft = new
    if soft != resource.RLIM_INFINITY and soft < need:
        print(f"open files: limit {soft} < about {need} needed", file=sys.stderr)


def _check_round(got: list[tuple[int, int]], n: int) -> None:
    ranks = sorted(rank for rank, _ in got)
    if ranks != list(range(n)) or {world for _, world in got} != {n}:
        raise RuntimeError(f"a round of {n} nodes gave ranks {ranks[:8]}... and worlds {got[:4]}")


@dataclass
class Row:
    backend: str
    nodes: int
    first_s: float
    restart_s: float | None
    restart_work_s: float | None
    ops_per_node: float
    kb_per_node: float
    state_kb: float
    store_cpu_s: float
    store_load: float
    agent_cpu_ms_per_s: float
    idle_b_per_s: float
    idle_store_load: float | None
    ops_by_kind: dict[str, float]
    keys_by_kind: dict[str, float]
    agent_cpu_s_by_phase: dict[str, float | None]
    keep_alive_s: int
    dilate: float | str
    wall_s: float


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="64,256,1024,4096", help="simulated node counts")
    p.add_argument(
        "--backends",
        default="meshrun,c10d",
        type=_backends,
        help="meshrun (signed), c10d, or both as meshrun,c10d",
    )
    p.add_argument("--json", help="append each row to this file as a JSON line")
    p.add_argument(
        "--stall-report",
        type=float,
        default=0.0,
        metavar="S",
        help="a round still running after S seconds (virtual under --dilate) prints where every "
        "agent is (once)",
    )
    p.add_argument(
        "--idle",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds of polling between the rounds, as while workers train, measured after "
        f"{IDLE_SETTLE_S:.0f} s more (0: none; virtual under --dilate)",
    )
    p.add_argument(
        "--first-only",
        action="store_true",
        help="the first round only, no restart (at 4,096 nodes the restart's 15 s of polls "
        "cost hours of this machine's CPU)",
    )
    p.add_argument(
        "--dilate",
        type=_dilation,
        default=1.0,
        metavar="K",
        help="run the agents on a clock K times slower than the real one (1: real time), or "
        "on an event clock (event: time moves only when every agent waits); every time but "
        "the wall seconds is then virtual",
    )
    p.add_argument(
        "--trace-dead",
        action="store_true",
        help="say every live node a handler drops as dead: what the dropping node held of it "
        "and what the node had written (rdzv_trace.py)",
    )
    p.add_argument(
        "--keep-alive",
        type=_keep_alive,
        default=KEEP_ALIVE_S,
        metavar="S",
        help=f"the handler's keep-alive interval, whole seconds (default {KEEP_ALIVE_S}, "
        f"torch's): a dead node is dropped after {KEEP_ALIVE_TRIES} intervals, the restart's "
        "longest wait (a shorter one makes a 4,096-node restart affordable here)",
    )
    a = p.parse_args(argv)
    print(
        "| backend | nodes | first round s | restart s | beyond fixed waits s | "
        "ops/node | KiB/node | state KiB | store CPU s | store load | agent CPU ms/s | "
        "idle B/s per node | idle store load | keep-alive s | dilate | wall s |"
    )
    print("|---" * 16 + "|")
    for n in [int(x) for x in a.nodes.split(",")]:
        for backend in a.backends:
            row = measure(
                backend,
                n,
                a.stall_report,
                a.idle,
                a.dilate,
                not a.first_only,
                a.trace_dead,
                a.keep_alive,
            )
            cells = ["-" if v is None else str(v) for v in row.values() if not isinstance(v, dict)]
            emit(row, cells, a.json)


def _backends(text: str) -> list[str]:
    """``--backends``: names from meshrun and c10d, comma-separated ("both" once ran torch's
    backend under that name)."""
    names = [b.strip() for b in text.split(",")]
    bad = [b for b in names if b not in BACKENDS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"--backends {text!r}: {', '.join(map(repr, bad)) or 'none'} not a backend; "
            f"use {' or '.join(BACKENDS)}, or both as meshrun,c10d"
        )
    return names


def _keep_alive(text: str) -> int:
    """``--keep-alive``: whole seconds, as torch's ``keep_alive_interval`` parameter is read."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(
            f"--keep-alive {text!r}: whole seconds >= 1 (torch reads the interval as an integer)"
        )
    return int(text)


def _dilation(text: str) -> float | str:
    if text == "event":
        return text
    try:
        k = float(text)
    except ValueError:
        k = 0.0
    if k <= 0:
        raise argparse.ArgumentTypeError(f"--dilate {text!r}: a number > 0, or event")
    return k


def emit(row: dict[str, Any], cells: list[str], json_path: str | None) -> None:
    """One markdown table line on stdout; the row appended to ``json_path`` as a JSON line."""
    print("| " + " | ".join(cells) + " |", flush=True)
    if json_path:
        with open(json_path, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
