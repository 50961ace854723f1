"""The hang watchdog: a daemon thread per rank that expects a heartbeat every optimizer step.

When no step finishes within ``monitor.step_timeout_s`` (or a declared phase's longer
timeout: ``with run.phase("eval"):``, checkpoint saves), the rank writes
``RUN_DIR/hang/rank<R>.txt`` (a JSON header line, then faulthandler's dump of every thread)
and exits with ``EXIT_HANG``, well before the Gloo/NCCL collective timeout. All healthy ranks
of a stuck job block in the same collective, so each one's watchdog fires on its own; a
stopped or dead rank writes nothing, and ``hang_report`` (run by ``meshrun launch``) names it
as the rank that did not report. The header also holds the rank's position in each process
group's sequence of collectives (PyTorch's flight recorder, monitor/collectives.py), so the
report can name a rank that never reached the collective the others wait in.
"""

from __future__ import annotations

import faulthandler
import json
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
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

__all__ = ["EXIT_HANG", "HANG_DIR", "Watchdog", "hang_report", "watch_for_hangs"]

EXIT_HANG = 124  # the `timeout` command's code for "ran past its limit"
HANG_DIR = "hang"
_POLL_S = 0.25


class Watchdog:
    """Armed while the step loop runs; ``beat()`` at every step, ``phase()`` for long work."""

    def __init__(self, run_dir: Path, rank: int, world_size: int, timeout_s: float) -> None:
        self.path = run_dir / HANG_DIR / f"rank{rank}.txt"
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self._lock = threading.Lock()
        self._deadline: float | None = None  # None = disarmed
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
            self._deadline = time.monotonic() + (timeout_s or self.timeout_s)
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
                phase, step = self._phase, self._step
            if late:
                self._dump(phase, step)
                os._exit(EXIT_HANG)  # the main thread is stuck: no clean shutdown is possible

    def _dump(self, phase: str, step: int) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        header = {
            "rank": self.rank,
            "world_size": self.world_size,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "phase": phase,
            "step": step,  # the last step this rank finished
            "timeout_s": self.timeout_s,
            "main_thread": threading.main_thread().ident,
            "time": time.time(),
            "collectives": last_collectives(),
            "p2p": p2p_snapshot(),  # pipeline sends/receives (monitor/p2p.py)
        }
        with open(self.path, "w", encoding="utf-8") as f:
            f.write(json.dumps(header) + "\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        print(
            f"meshrun watchdog: rank {self.rank} made no progress for {self.timeout_s:g} s "
            f"(phase {phase}, after step {step}); stacks in {self.path}; exiting {EXIT_HANG}",
            flush=True,
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


def hang_report(run_dir: str | Path, since: float) -> str | None:
    """The launcher's one report for a hang: which ranks reported, where each one is, and which
    did not report (stopped, dead, or stuck outside Python). None when no rank reported."""
    folder = Path(run_dir) / HANG_DIR
    files = sorted(folder.glob("rank*.txt")) if folder.is_dir() else []
    dumps = [parse_dump(p.read_text()) for p in files if p.stat().st_mtime >= since]
    if not dumps:
        return None
    # A rank the launcher found stopped may dump its stack once continued: that dump shows
    # where it woke up, not the hang, so the report names it as stopped instead.
    stopped = _read_stopped(folder, since)
    dumps = [d for d in dumps if str(d.rank) not in stopped] or dumps
    seen = {d.rank for d in dumps} | {int(r) for r in stopped if r.isdigit()}
    missing = [r for r in range(max(d.world_size for d in dumps)) if r not in seen]
    lines = ["meshrun: hang detected by the watchdog (monitor.step_timeout_s)"]
    if stopped:
        lines.append(
            f"  rank(s) {', '.join(sorted(stopped))} were stopped (SIGSTOP or a debugger) when "
            "the hang was detected; the others wait for them"
        )
    if missing:
        lines.append(
            f"  rank(s) {', '.join(map(str, missing))} did not report: stopped, dead or stuck "
            "outside Python; the others wait for them"
        )
    for d in sorted(dumps, key=lambda d: d.rank):
        lines.append(
            f"  rank {d.rank} ({d.host}) in phase {d.phase} after step {d.step}: "
            f"waits at {d.innermost}; your code: {d.user}"
        )
    silent = sorted({int(r) for r in stopped if r.isdigit()} | set(missing))
    positions = {d.rank: d.positions for d in dumps if d.positions is not None}
    if positions:
        lines += collective_lines(positions, silent)
    p2p = {d.rank: d.p2p for d in dumps if d.p2p is not None}
    lines += p2p_lines(p2p, {d.rank: d.innermost for d in dumps}, silent)
    lines.append(f"  stacks: {folder}/rank*.txt")
    return "\n".join(lines)


STOPPED_FILE = "stopped.txt"


def _read_stopped(folder: Path, since: float) -> set[str]:
    path = folder / STOPPED_FILE
    fresh = path.is_file() and path.stat().st_mtime >= since  # not a previous run's
    return set(path.read_text().split()) if fresh else set()


def _stopped_children(parent: int) -> list[tuple[int, str]]:
    """(pid, RANK) of ``parent``'s child processes in the stopped state (Linux /proc)."""
    found: list[tuple[int, str]] = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # "pid (comm) state ppid ...": comm may hold spaces, so split after its ')'.
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if fields[0] in ("T", "t") and int(fields[1]) == parent:
                environ = (stat.parent / "environ").read_bytes().split(b"\0")
                rank = next((e[5:].decode() for e in environ if e.startswith(b"RANK=")), "?")
                found.append((int(stat.parent.name), rank))
        except (OSError, IndexError, ValueError):
            continue  # the process ended while we looked
    return found


def watch_for_hangs(run_dir: str | Path, since: float, stop: threading.Event) -> None:
    """The launcher's helper thread: once a watchdog has reported a hang, wake workers that
    are stopped (SIGSTOP, a debugger). torchrun's agent only SIGTERMs the workers and waits
    30 s before SIGKILL; a stopped process does not act on SIGTERM until it is continued."""
    folder = Path(run_dir) / HANG_DIR
    while not stop.wait(0.5):
        if folder.is_dir() and any(p.stat().st_mtime >= since for p in folder.glob("rank*.txt")):
            stopped = _stopped_children(os.getpid())
            # Written before continuing them, so the report knows which dumps to disregard.
            (folder / STOPPED_FILE).write_text("\n".join(rank for _, rank in stopped) + "\n")
            for pid, rank in stopped:
                print(
                    f"meshrun launch: rank {rank} (pid {pid}) was stopped (SIGSTOP?): "
                    "continuing it so that it can be shut down",
                    flush=True,
                )
                os.kill(pid, signal.SIGCONT)
            return
