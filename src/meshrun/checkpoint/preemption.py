"""Preemption: SIGTERM/SIGUSR1 set a flag; the ranks agree on it at the next step boundary.

A handler must not save: it may run in the middle of a collective. It only records the signal;
:meth:`Preemption.requested_locally` reads that flag, and :meth:`Preemption.consume` takes the
value the ranks agreed on (any rank's signal stops them all), from :meth:`Preemption.agreed`'s
own all-reduce or from a per-step agreement that carries it with other flags.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

import torch

from meshrun.checkpoint.facts import any_rank

__all__ = ["Preemption"]


class Preemption:
    """The preemption signal handlers of one run (``checkpoint.on_signal``)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.installed = False
        self.signal_name: str | None = None  # the signal received (or "... on another rank")

    def install(self) -> None:
        """Install the handlers once, from the main thread (the only one that may)."""
        if self.installed or not self.enabled:
            return
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._on_signal)
        self.installed = True

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signal_name = signal.Signals(signum).name

    def requested_locally(self) -> bool:
        """Whether this rank received a preemption signal (no collective)."""
        return self.signal_name is not None

    def consume(self, on_any_rank: bool) -> bool:
        """Take the agreed value (the same on every rank); returns it."""
        if on_any_rank and self.signal_name is None:
            self.signal_name = "a signal on another rank"
        return on_any_rank

    def agreed(self, device: torch.device) -> bool:
        """Whether any rank was signalled: one all-reduce, every step once handlers are in."""
        if not self.installed:
            return False
        return self.consume(any_rank(self.requested_locally(), device))
