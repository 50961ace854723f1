"""The hang watchdog: a daemon thread per rank that expects a heartbeat every optimizer step.

When no step finishes within ``monitor.step_timeout_s`` (or a declared phase's longer
timeout: ``with run.phase("eval"):``, checkpoint saves), the rank writes
``RUN_DIR/hang/rank<R>.txt`` (a JSON header line, then faulthandler's dump of every thread)
and exits with ``EXIT_HANG``, well before the Gloo/NCCL collective timeout. The header also
holds the rank's position in each process group's sequence of collectives (PyTorch's flight
recorder, monitor/collectives.py), so the report can name a rank that never reached the
collective the others wait in.

The launcher's side (``watch_for_hangs``, a thread in ``meshrun launch``'s process) sees the
first hang file, asks every local rank to dump at once (``dump-request``: a rank whose
deadline is still ahead dumps now instead of being killed first), finds its stopped workers
(process state T) and the ones that do not answer, and ends those with SIGKILL itself: a
stopped process does not act on the agent's SIGTERM, and the agent would wait 30 s for it.
What it ended, and why, goes to ``hang/ended.json`` for the failure summary.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import json
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from meshrun.monitor.collectives import (
    Position,
    collective_lines,
    last_collectives,
    parse_positions,
)
from meshrun.monitor.p2p import P2PState, p2p_lines, p2p_snapshot, parse_p2p, record_pipeline_p2p
from meshrun.runtime.logs import say_line

__all__ = ["EXIT_HANG", "HANG_DIR", "Watchdog", "hang_report", "watch_for_hangs"]

EXIT_HANG = 124  # the `timeout` command's code for "ran past its limit"
HANG_DIR = "hang"
REQUEST_FILE = "dump-request"  # written by the launcher: every rank dumps now
ENDED_FILE = "ended.json"  # written by the launcher: {rank: why meshrun ended it}
_POLL_S = 0.25
# A rank that has written its hang file waits this long before it exits. Its exit is what the
# agent reacts to (SIGTERM to every worker) and what breaks its peers' collectives (a Gloo
# "connection closed"), so without the wait a peer whose deadline is a moment later, or which
# the launcher has just asked to dump, dies before it writes its file (the deadline race).
# The launcher's collection phase (COLLECT_S) ends inside this window.
HOLD_S = 3.0
COLLECT_S = 2.0


class Watchdog:
    """Armed while the step loop runs; ``beat()`` at every step, ``phase()`` for long work."""

    def __init__(self, run_dir: Path, rank: int, world_size: int, timeout_s: float) -> None:
        self.path = run_dir / HANG_DIR / f"rank{rank}.txt"
        self.request = run_dir / HANG_DIR / REQUEST_FILE
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self._born = time.time()  # a request older than this process is an earlier attempt's
        self._lock = threading.Lock()
        self._deadline: float | None = None  # None = disarmed
        self._limit_s = timeout_s  # what the deadline allows: the step's, or a phase's
        self._phase = "train"
        self._step = 0
        self._thread: threading.Thread | None = None
        if self.enabled:  # before any pipeline exists, so every rank counts from the same op
            record_pipeline_p2p()

    @property
    def enabled(self) -> bool:
        return self.timeout_s > 0

    def beat(self, step: int | None = None, timeout_s: float | None = None) -> None:
        """A step finished (or the loop started): the next must finish within the timeout."""
        if not self.enabled:
            return
        with self._lock:
            if step is not None:
                self._step = step
            self._limit_s = timeout_s or self.timeout_s
            self._deadline = time.monotonic() + self._limit_s
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._watch, name="meshrun-watchdog", daemon=True
            )
            self._thread.start()

    def disarm(self) -> None:
        with self._lock:
            self._deadline = None

    @contextmanager
    def phase(self, name: str, timeout_s: float) -> Iterator[None]:
        """Allow ``timeout_s`` for the block (eval, checkpointing); the step timeout resumes
        after it. Nested phases restore the outer one."""
        if not self.enabled:
            yield
            return
        with self._lock:
            outer, outer_deadline = self._phase, self._deadline
            self._phase = name
        self.beat(timeout_s=timeout_s)
        try:
            yield
        finally:
            with self._lock:
                self._phase = outer
            if outer_deadline is None:
                self.disarm()
            else:
                self.beat()

    def _watch(self) -> None:
        while True:
            time.sleep(_POLL_S)
            with self._lock:
                late = self._deadline is not None and time.monotonic() > self._deadline
                phase, step, limit_s = self._phase, self._step, self._limit_s
            if late or self._requested():
                self._dump(phase, step, "deadline" if late else "request", limit_s)
                time.sleep(HOLD_S)  # let the other ranks write theirs (see HOLD_S)
                os._exit(EXIT_HANG)  # the main thread is stuck: no clean shutdown is possible

    def _requested(self) -> bool:
        """The launcher asked every rank to dump (another rank reported a hang)."""
        try:
            return self.request.stat().st_mtime >= self._born
        except OSError:
            return False

    def _dump(
        self, phase: str, step: int, trigger: str = "deadline", limit_s: float | None = None
    ) -> None:
        # The limit of the deadline that passed: inside a phase (eval, a checkpoint save) that
        # is monitor.phase_timeout_s (or the phase's own), not the step timeout.
        if limit_s is None:
            with self._lock:
                limit_s = self._limit_s
        self.path.parent.mkdir(parents=True, exist_ok=True)
        header = {
            "rank": self.rank,
            "world_size": self.world_size,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "phase": phase,
            "step": step,  # the last step this rank finished
            "timeout_s": limit_s,
            "trigger": trigger,  # its own deadline, or the launcher's request
            "main_thread": threading.main_thread().ident,
            "time": time.time(),
            "collectives": last_collectives(),
            "p2p": p2p_snapshot(),  # pipeline sends/receives (monitor/p2p.py)
        }
        with open(self.path, "w", encoding="utf-8") as f:
            f.write(json.dumps(header) + "\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        why = (
            f"made no progress for {limit_s:g} s"
            if trigger == "deadline"
            else "was asked for its stacks (another rank reported a hang)"
        )
        say_line(
            f"meshrun watchdog: rank {self.rank} {why} (phase {phase}, after step {step}); "
            f"stacks in {self.path}; exiting {EXIT_HANG}",
            sys.stdout,
        )


# --- the launcher's side -------------------------------------------------------------------

_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-f]+)")
_FRAME = re.compile(r'^\s+File "(.+)", line (\d+) in (\S+)')
_LIBRARY = ("/torch/", "/meshrun/", "/threading.py", "/selectors.py")


@dataclass(frozen=True)
class RankDump:
    rank: int
    world_size: int
    host: str
    phase: str
    step: int
    innermost: str  # file:line in function
    user: str  # the innermost frame outside torch and meshrun (the user's line)
    positions: dict[str, Position] | None = None  # per process group (flight recorder)
    p2p: P2PState | None = None  # pipeline sends/receives (monitor/p2p.py)


def parse_dump(text: str) -> RankDump:
    """One rank's hang file: its header and where its main thread is."""
    head, _, stacks = text.partition("\n")
    info = json.loads(head)
    frames = _main_thread_frames(stacks, int(info["main_thread"]))
    where = [f"{os.path.basename(f)}:{line} in {fn}" for f, line, fn in frames]
    user = next(
        (
            w
            for (f, _, _), w in zip(frames, where, strict=True)
            if not any(p in f for p in _LIBRARY)
        ),
        "?",
    )
    return RankDump(
        int(info["rank"]),
        int(info["world_size"]),
        info["host"],
        info["phase"],
        int(info["step"]),
        where[0] if where else "?",
        user,
        parse_positions(info),
        parse_p2p(info),
    )


def _main_thread_frames(stacks: str, main_ident: int) -> list[tuple[str, str, str]]:
    frames: list[tuple[str, str, str]] = []
    current: int | None = None
    for line in stacks.splitlines():
        m = _THREAD.match(line)
        if m:
            current = int(m.group(1), 16)
            continue
        f = _FRAME.match(line)
        if f and current == main_ident:
            frames.append((f.group(1), f.group(2), f.group(3)))
    return frames  # most recent call first, as faulthandler writes them


def _fresh_dumps(folder: Path, since: float) -> list[RankDump]:
    files = sorted(folder.glob("rank*.txt")) if folder.is_dir() else []
    dumps = []
    for path in files:
        try:
            if path.stat().st_mtime >= since:
                dumps.append(parse_dump(path.read_text()))
        except (OSError, ValueError, KeyError):
            continue  # being written, or not a hang file
    return dumps


def read_ended(run_dir: str | Path, since: float) -> dict[int, str]:
    """Ranks that ``meshrun launch`` ended itself after a hang: rank -> why ("stopped", ...)."""
    path = Path(run_dir) / HANG_DIR / ENDED_FILE
    try:
        if path.stat().st_mtime < since:
            return {}  # a previous run's
        return {int(rank): str(why) for rank, why in json.loads(path.read_text()).items()}
    except (OSError, ValueError):
        return {}


def hang_states(run_dir: str | Path, since: float) -> tuple[dict[int, str], dict[int, str]]:
    """For the failure summary: (ranks meshrun ended -> why, ranks that reported -> where they
    wait, e.g. "waits in collective #26 (gloo:all_reduce) of process group 0 (default_pg)")."""
    ended = read_ended(run_dir, since)
    waiting = {}
    for d in _fresh_dumps(Path(run_dir) / HANG_DIR, since):
        if d.rank not in ended:
            waiting[d.rank] = _where(d)
    return ended, waiting


def _where(d: RankDump) -> str:
    if d.positions:
        pg = min(d.positions, key=lambda g: (not g.isdigit(), int(g) if g.isdigit() else 0, g))
        p = d.positions[pg]
        return f"waits in collective #{p.seq} ({p.op}) of process group {pg} ({p.group or '?'})"
    return f"waits at {d.innermost}"


def hang_report(run_dir: str | Path, since: float) -> str | None:
    """The launcher's one report for a hang: which ranks reported, where each one is, and which
    did not report (stopped, dead, or stuck outside Python). None when no rank reported."""
    folder = Path(run_dir) / HANG_DIR
    dumps = _fresh_dumps(folder, since)
    if not dumps:
        return None
    ended = read_ended(run_dir, since)
    stopped = sorted(r for r, why in ended.items() if why == STOPPED)
    deaf = sorted(r for r, why in ended.items() if why == NOT_RESPONDING)
    # An ended rank's dump (if any) is not where the hang happened: leave it out.
    dumps = [d for d in dumps if d.rank not in ended] or dumps
    seen = {d.rank for d in dumps} | set(ended)
    missing = [r for r in range(max(d.world_size for d in dumps)) if r not in seen]
    lines = ["meshrun: hang detected by the watchdog (monitor.step_timeout_s)"]
    if stopped:
        lines.append(
            f"  rank(s) {_ranks(stopped)} were stopped (process state T: SIGSTOP or a debugger) "
            "when the hang was detected; the others wait for them; meshrun launch ended them "
            "with SIGKILL"
        )
    if deaf:
        lines.append(
            f"  rank(s) {_ranks(deaf)} were not responding (running, but their watchdog did not "
            f"answer within {COLLECT_S:g} s: stuck outside Python?); meshrun launch ended them "
            "with SIGKILL"
        )
    if missing:
        lines.append(
            f"  rank(s) {_ranks(missing)} did not report: on another node, dead, or stuck "
            "outside Python; the others wait for them"
        )
    for d in sorted(dumps, key=lambda d: d.rank):
        lines.append(
            f"  rank {d.rank} ({d.host}) in phase {d.phase} after step {d.step}: "
            f"waits at {d.innermost}; your code: {d.user}"
        )
    silent = sorted(set(ended) | set(missing))
    positions = {d.rank: d.positions for d in dumps if d.positions is not None}
    if positions:
        lines += collective_lines(positions, silent)
    p2p = {d.rank: d.p2p for d in dumps if d.p2p is not None}
    lines += p2p_lines(p2p, {d.rank: d.innermost for d in dumps}, silent)
    lines.append(f"  stacks: {folder}/rank*.txt")
    return "\n".join(lines)


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


STOPPED = "stopped"
NOT_RESPONDING = "not responding"


@dataclass(frozen=True)
class Worker:
    """One of the launcher's worker processes, from /proc."""

    pid: int
    rank: int
    state: str  # /proc/PID/stat's state letter: R, S, D, T (stopped), t (traced), Z...

    @property
    def stopped(self) -> bool:
        return self.state in ("T", "t")


def local_workers(parent: int) -> list[Worker]:
    """``parent``'s live child processes that are torchrun workers (RANK in their environment);
    zombies (exited, not yet reaped) are left out. Linux /proc; empty elsewhere."""
    found: list[Worker] = []
    for stat in _child_stats(parent):
        try:
            # "pid (comm) state ppid ...": comm may hold spaces, so split after its ')'.
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) != parent or fields[0] in ("Z", "X"):
                continue
            environ = (stat.parent / "environ").read_bytes().split(b"\0")
            rank = next((e[5:].decode() for e in environ if e.startswith(b"RANK=")), "")
            if rank.isdigit():
                found.append(Worker(int(stat.parent.name), int(rank), fields[0]))
        except (OSError, IndexError, ValueError):
            continue  # the process ended while we looked
    return found


def _child_stats(parent: int) -> list[Path]:
    """/proc/PID/stat of ``parent``'s children: from the kernel's per-thread children lists
    (a few reads; the launcher polls this twice a second), else from a scan of all of /proc."""
    lists = list(Path(f"/proc/{parent}/task").glob("*/children"))
    pids: set[str] = set()
    try:
        for children in lists:
            pids.update(children.read_text().split())
    except OSError:
        lists = []  # a thread ended while we looked: scan instead
    if not lists:  # a kernel without CONFIG_PROC_CHILDREN
        return list(Path("/proc").glob("[0-9]*/stat"))
    return [Path(f"/proc/{pid}/stat") for pid in pids]


def watch_for_hangs(
    run_dir: str | Path, since: float, stop: threading.Event, stopped_after_s: float | None = None
) -> None:
    """The launcher's helper thread: once a watchdog has reported a hang, or a local worker has
    been stopped for ``stopped_after_s`` (default: :func:`stopped_bound_s`), collect the
    local ranks' reports, then end the ranks that cannot end themselves (see the module
    docstring). Keeps watching, so a restarted worker group's hang is handled too."""
    folder = Path(run_dir) / HANG_DIR
    # The config is read when a worker is first seen stopped, not as the workers start: the
    # launcher has validated it already, and a second read here cost ~30 ms of their start-up.
    bound_of: Callable[[], float | None] = (
        functools.cache(stopped_bound_s) if stopped_after_s is None else lambda: stopped_after_s
    )
    clock = StoppedClock()
    while not stop.wait(_POLL_S):
        late = clock.overdue(bound_of)
        if late is not None:
            bound = bound_of()
            say_line(
                f"meshrun launch: rank {late.rank} (pid {late.pid}) has been stopped (process "
                f"state T) for {bound:g} s (monitor.step_timeout_s + {STOPPED_GRACE_S:g} s): "
                "a hang, though no rank's deadline has passed (its peers may wait in a longer "
                "phase, a checkpoint save)",
                sys.stdout,
            )
        if late is not None or _fresh_dumps(folder, since):
            end_hung_workers(folder, since, stop)
            since = time.time()  # the next attempt's reports are newer than this
            clock = StoppedClock()


# A stopped worker is a hang even when no rank's deadline is near: its peers may wait for it in
# a phase allowed far longer than a step (a checkpoint save: monitor.phase_timeout_s). Past the
# step timeout by this much, so that in a step the peers' own watchdogs report first.
STOPPED_GRACE_S = 2.0


def stopped_bound_s() -> float | None:
    """How long a worker may stay stopped: the resolved config's ``monitor.step_timeout_s``
    (the file the launcher hands its workers) + ``STOPPED_GRACE_S``; None when the watchdog is
    off (``step_timeout_s = 0``)."""
    from meshrun.config import CONFIG_ENV, MonitorConfig, load_config  # the launcher's side only

    try:  # read as the workers read it: the defaults, then the file
        timeout_s = load_config(os.environ.get(CONFIG_ENV)).monitor.step_timeout_s
    except (OSError, ValueError):  # ConfigError is one; the workers will say what is wrong
        timeout_s = MonitorConfig().step_timeout_s
    return timeout_s + STOPPED_GRACE_S if timeout_s > 0 else None


class StoppedClock:
    """Since when each local worker has been stopped (state T; not t: a debugger's trace)."""

    def __init__(self) -> None:
        self._since: dict[int, float] = {}

    def overdue(self, bound_of: Callable[[], float | None]) -> Worker | None:
        """The first worker stopped for longer than ``bound_of()`` (asked only once a worker
        is stopped; None: never overdue), if any."""
        now = time.monotonic()
        stopped = {w.pid: w for w in local_workers(os.getpid()) if w.state == "T"}
        self._since = {pid: self._since.get(pid, now) for pid in stopped}
        bound_s = bound_of() if stopped else None
        if bound_s is None:
            return None
        return next((stopped[p] for p, t in self._since.items() if now - t > bound_s), None)


def end_hung_workers(folder: Path, since: float, stop: threading.Event) -> dict[int, str]:
    """The collection phase, then the killing. Returns what was ended (rank -> why)."""
    folder.mkdir(parents=True, exist_ok=True)  # no rank may have reported (a stopped worker)
    (folder / REQUEST_FILE).write_text(f"{time.time()}\n")  # every local rank: dump now
    deadline = time.monotonic() + COLLECT_S
    workers = local_workers(os.getpid())
    while time.monotonic() < deadline and not stop.is_set():
        reported = {d.rank for d in _fresh_dumps(folder, since)}
        workers = local_workers(os.getpid())
        if all(w.stopped or w.rank in reported for w in workers):
            break  # everyone who can answer has
        time.sleep(_POLL_S)
    reported = {d.rank for d in _fresh_dumps(folder, since)}
    doomed = {w.rank: w for w in workers if w.stopped or w.rank not in reported}
    ended = {r: (STOPPED if w.stopped else NOT_RESPONDING) for r, w in doomed.items()}
    # Written before any kill, so the summary knows these SIGKILLs were meshrun's own. Merged
    # with what the launcher of another node wrote there (a shared run directory).
    if ended:
        merged = read_ended(folder.parent, since) | ended
        (folder / ENDED_FILE).write_text(json.dumps({str(r): w for r, w in merged.items()}))
    for rank, w in sorted(doomed.items()):
        say_line(
            f"meshrun launch: rank {rank} (pid {w.pid}) is {ended[rank]}"
            f"{' (process state ' + w.state + ')' if w.stopped else ''} in a hang; ending it "
            "with SIGKILL",
            sys.stdout,
        )
    # Kill once the reporting ranks have left (HOLD_S): a killed peer breaks their
    # collectives, and they should exit through their watchdog, not a Gloo error.
    _wait_for_exit({w.pid for w in workers if w.rank in reported}, HOLD_S + 1.0, stop)
    for w in doomed.values():
        with contextlib.suppress(ProcessLookupError):  # it left meanwhile
            os.kill(w.pid, signal.SIGKILL)  # acts on a stopped process too: no SIGCONT needed
    return ended


def _wait_for_exit(pids: set[int], limit_s: float, stop: threading.Event) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and not stop.is_set():
        alive = {w.pid for w in local_workers(os.getpid())}
        if not pids & alive:
            return
        time.sleep(0.1)
