"""What ``meshrun launch`` watches around torchrun's agent, from a thread of its own process.

torchrun's agent runs in the launcher's main thread, and three of its behaviours leave a user
without an answer; this module adds one for each:

- **Restarts are silent.** Under ``--max-restarts`` the agent restarts the worker group with a
  log line at INFO, which torchrun does not show. The agent publishes its state through
  torch's elastic metrics (``torch.distributed.elastic.metrics``: ``remaining_restarts``, then
  ``failed``/``unhealthy``, every monitor tick); a metrics handler turns the tick that leads to
  a restart into one stderr line, ``worker group failed (rank 1: exit code 1); restart 1 of 3``.
  The failing ranks are not in the metrics: a thin wrapper of the agent's ``_monitor_workers``
  (private; skipped where missing) remembers its last failures for that line.
- **A node cut off from the network never exits.** Its worker exits through the hang
  watchdog, but the agent's main thread is blocked in a call to the store it cannot reach
  (the rendezvous's check for waiting nodes, every monitor tick; or the next rendezvous), a
  TCP read that lasts as long as the kernel retries (15 minutes or more): it never reaps the
  worker, and is deaf to SIGTERM, as a Python signal handler runs only when the main thread
  returns from C++. So on a
  multi-node launch, when no worker has run here for ``join_timeout_s + RDZV_GRACE_S`` while
  the agent is not finished, the launcher says it lost the rendezvous, ends what is left and
  exits 1.
- **SIGTERM may take 30 s or forever.** The agent SIGTERMs its workers and waits 30 s
  (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``) before SIGKILL, and cannot act at all while blocked in
  the store. ``signal.set_wakeup_fd`` tells this thread about the signal at once, from C; it
  SIGKILLs the workers still running ``KILL_AFTER_S`` later and ends the launcher
  ``EXIT_AFTER_S`` after the signal if the agent has not returned by then.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from meshrun.launch.agent.orphans import orphan_guard
from meshrun.launch.hostfile.guard import descendants
from meshrun.monitor.watchdog import EXIT_HANG, local_workers

RDZV_GRACE_S = 10.0  # beyond the join timeout: torch's own rendezvous timeout comes first
KILL_AFTER_S = 10.0  # SIGTERM -> SIGKILL of workers that are still running
EXIT_AFTER_S = 20.0  # SIGTERM -> the launcher leaves even if the agent is stuck
_TICK_S = 0.5
_STOP_SIGNALS = {int(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)}


def describe_failures(failures: Mapping[int, Any], limit: int = 4) -> str:
    """``rank 1: exit code 1, rank 0: exit code 124 (hang watchdog)`` from ProcessFailures.
    The ranks the agent itself stopped with SIGTERM (after the first failure) are left out."""
    from meshrun.launch.agent.failures import signal_name  # on a failure only

    causes = {r: f for r, f in failures.items() if int(f.exitcode) != -signal.SIGTERM}
    failures = causes or failures
    parts = []
    for rank in sorted(failures)[:limit]:
        code = int(failures[rank].exitcode)
        name = signal_name(code)
        text = f"signal {name}" if code < 0 and name else f"exit code {code}"
        parts.append(f"rank {rank}: {text}" + (" (hang watchdog)" if code == EXIT_HANG else ""))
    if len(failures) > limit:
        parts.append(f"and {len(failures) - limit} more")
    return ", ".join(parts)


class AgentWatch:
    """State shared by the metrics handler (agent's thread) and the watch thread."""

    def __init__(
        self,
        max_restarts: int,
        rdzv_bound_s: float | None,
        say: Callable[[str], None],
        rdzv_hint: str = "",
    ) -> None:
        self.max_restarts = max_restarts
        self.rdzv_bound_s = rdzv_bound_s  # None: single node, the store is local
        self.rdzv_hint = rdzv_hint
        self.say = say
        self.restarts = 0
        self.finished = False  # the agent reported its final state (succeeded / failed)
        self.last_failures: dict[int, Any] = {}
        self._remaining: int | None = None
        self._stop = threading.Event()
        # The write end of the pipe the watch thread waits on: stop() writes to it, so the
        # launcher's exit does not wait out the tick (0-0.5 s of every launch, measured).
        self.poke_fd: int | None = None

    # --- the agent's metrics (called in the agent's thread) ---------------------------------

    def on_metric(self, name: str, value: int) -> None:
        if not name.startswith("workers."):
            return
        state = name.rsplit(".", 1)[-1]
        if state == "remaining_restarts":
            self._remaining = value
        elif state in ("failed", "unhealthy") and value:
            if self._remaining:  # the agent restarts the group right after this tick
                self.restarts += 1
                cause = describe_failures(self.last_failures) or state
                self.say(
                    f"worker group failed ({cause}); restart {self.restarts} of {self.max_restarts}"
                )
            else:
                self.finished = True
        elif state == "succeeded" and value:
            self.finished = True

    # --- the watch thread -------------------------------------------------------------------

    def watch(self, wakeup: int | None) -> None:
        idle_since = time.monotonic()  # no worker of ours running since
        signalled: tuple[int, float] | None = None
        killed = False
        while not self._stop.is_set():
            sig = _read_signal(wakeup, _TICK_S, self._stop)
            if sig is not None and signalled is None:
                signalled = (sig, time.monotonic())
            now = time.monotonic()
            if self.rdzv_bound_s is not None and local_workers(os.getpid()):
                idle_since = now  # (a scan of /proc: only where a lost rendezvous is possible)
            if signalled is not None:
                sig, at = signalled
                if not killed and now - at >= KILL_AFTER_S:
                    killed = True
                    self._kill_workers(f"still running {KILL_AFTER_S:g} s after {_name(sig)}")
                if now - at >= EXIT_AFTER_S:
                    self._leave(
                        f"stopped by {_name(sig)}; the agent did not return within "
                        f"{EXIT_AFTER_S:g} s, leaving without it",
                        128 + sig,
                    )
            elif self._lost(now - idle_since):
                self._kill_workers("left behind by the lost rendezvous")
                self._leave(
                    f"lost the rendezvous: no worker has run on this node for "
                    f"{now - idle_since:.0f} s (launch.join_timeout_s + {RDZV_GRACE_S:g} s) and "
                    f"the agent has not moved on: the rendezvous store{self.rdzv_hint} does "
                    "not answer. Is this node cut off from the network? Exiting 1",
                    1,
                )

    def _lost(self, idle_s: float) -> bool:
        bound = self.rdzv_bound_s
        return bound is not None and not self.finished and idle_s > bound

    def _kill_workers(self, why: str) -> None:
        for w in local_workers(os.getpid()):
            self.say(f"rank {w.rank} (pid {w.pid}) {why}: ending it with SIGKILL")
            for pid in [*descendants(w.pid), w.pid]:  # its DataLoader workers too
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def _leave(self, text: str, code: int) -> None:
        self.say(text)
        _reap_children()
        sys.stdout.flush()
        sys.stderr.flush()
        # The main thread is blocked inside the agent (a store read in C++): nothing can
        # unwind it, so the process ends from here.
        os._exit(code)

    def stop(self) -> None:
        self._stop.set()
        if self.poke_fd is not None:
            with contextlib.suppress(OSError):  # full: the thread has bytes to wake it already
                os.write(self.poke_fd, b"\0")  # no stop signal's number: it only wakes


def _name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def _read_signal(fd: int | None, timeout_s: float, stop: threading.Event) -> int | None:
    """A stop signal's number from the wakeup pipe, waiting up to ``timeout_s`` (or, without
    the pipe, until ``stop`` is set)."""
    if fd is None:
        stop.wait(timeout_s)
        return None
    ready, _, _ = select.select([fd], [], [], timeout_s)
    if not ready:
        return None
    try:
        data = os.read(fd, 64)
    except BlockingIOError:
        return None
    return next((b for b in data if b in _STOP_SIGNALS), None)


def _reap_children() -> None:
    """Collect exited children (the agent, blocked, will not), so none is left a zombie."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass


class _MetricsHandler:
    """A torch.distributed.elastic MetricHandler that forwards to the watch and to the
    handler that was configured before (if any)."""

    def __init__(self, watch: AgentWatch, previous: Any) -> None:
        self.watch, self.previous = watch, previous

    def emit(self, metric_data: Any) -> None:
        self.watch.on_metric(str(metric_data.name), int(metric_data.value))
        if self.previous is not None:
            self.previous.emit(metric_data)


@contextmanager
def _metrics(watch: AgentWatch) -> Iterator[None]:
    from torch.distributed.elastic import metrics

    group = "torchelastic"  # the group the agent's put_metric calls use
    previous = metrics.getStream(group).handler
    metrics.configure(_MetricsHandler(watch, previous), group)  # type: ignore[arg-type]
    try:
        yield
    finally:
        metrics.configure(previous, group)


@contextmanager
def _failures(watch: AgentWatch) -> Iterator[None]:
    from torch.distributed.elastic.agent.server import local_elastic_agent as lea

    cls = lea.LocalElasticAgent
    original = cls.__dict__.get("_monitor_workers")
    if original is None:  # another torch: announce restarts without the ranks
        yield
        return

    def monitor(agent: Any, worker_group: Any) -> Any:
        result = original(agent, worker_group)
        if getattr(result, "failures", None):
            watch.last_failures = dict(result.failures)
        return result

    cls._monitor_workers = monitor  # type: ignore[method-assign]
    try:
        yield
    finally:
        cls._monitor_workers = original  # type: ignore[method-assign]


@contextmanager
def _wakeup_pipe() -> Iterator[tuple[int, int] | None]:
    """The read and write ends of the pipe C writes a signal's number to, at once."""
    if threading.current_thread() is not threading.main_thread():
        yield None  # set_wakeup_fd works from the main thread only
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)
    os.set_blocking(write_fd, False)
    previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    try:
        yield read_fd, write_fd
    finally:
        signal.set_wakeup_fd(previous)
        os.close(read_fd)
        os.close(write_fd)


@contextmanager
def watched_agent(
    max_restarts: int,
    rdzv_bound_s: float | None,
    say: Callable[[str], None],
    rdzv_hint: str = "",
) -> Iterator[AgentWatch]:
    """Around ``torch.distributed.run.run``: announce restarts, bound a lost rendezvous and
    the time from SIGTERM to exit (see the module docstring); end the workers if this process
    is killed (``orphans.py``)."""
    watch = AgentWatch(max_restarts, rdzv_bound_s, say, rdzv_hint)
    # orphan_guard: the workers end with this process even if it is SIGKILLed (orphans.py).
    with _metrics(watch), _failures(watch), _wakeup_pipe() as pipe, orphan_guard():
        wakeup, watch.poke_fd = pipe or (None, None)
        thread = threading.Thread(
            target=watch.watch, args=(wakeup,), name="meshrun-agent-watch", daemon=True
        )
        thread.start()
        try:
            yield watch
        finally:
            watch.stop()
            thread.join(timeout=2 * _TICK_S)
