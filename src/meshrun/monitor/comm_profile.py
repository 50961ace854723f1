"""Exposed communication on sampled steps, from ``torch.profiler``: the method for layouts
without a comm-hook interface (FSDP2 / ZeRO-2/3 / HSDP, tensor parallel, pipeline parallel).

Every ``monitor.comm_sample_every``-th optimizer step runs under ``torch.profiler.profile``
with the smallest settings (CPU activity only, plus CUDA activity on a GPU; no shapes, stacks,
memory or FLOPs). At the end of the step the raw profiler events are read (no event tree is
built) and reduced to three figures for that step (monitor/comm.py has the DDP method):

CPU (Gloo): every collective and point-to-point op is enqueued by a ``c10d::<op>`` call on
the main thread and records a ``gloo:<op>`` range on a Gloo thread from when it starts
running to when it completes. Gloo runs a group's work in the order it was enqueued, so the
k-th ``gloo:`` range belongs to the k-th ``c10d::`` call (matched in that order; the kinds
differ: Gloo's reduce-scatter records ``gloo:all_reduce``). From the call to the completion
the operation is *pending* (``comm_s`` is the union of those intervals); the time queued
behind other work or waiting for a free core counts too, as it does for DDP's hook. The main thread is *computing* while it is inside an ``aten::`` op that is not
itself a communication op (``c10d::``, ``_c10d_functional::``, ...). On CPU there are no
streams, so communication is hidden only where the main thread computes meanwhile:
``comm_exposed_s`` = pending time during which the main thread is not inside a compute op
(blocked in ``Work.wait``, ``wait_tensor``, FSDP2's waits, a pipeline ``recv``...).

CUDA (NCCL; written, not yet run on a GPU): the GPU timeline decides: ``comm_s`` is the union
of the NCCL kernels, ``comm_exposed_s`` the part of it during which no other kernel runs.

The guard collective (``sync_s``) is excluded on CPU: it runs inside a ``meshrun::guard``
range that is only recorded on sampled steps. Errors (docs/monitor.md): interpreter time
between ops while a collective is in flight counts as exposed (an over-estimate of a few tens
of microseconds per op on CPU); the profiler's own cost (one to two microseconds per op)
makes the sampled step slower than the others.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple, TypeVar

import torch
from torch.autograd.profiler import record_function

__all__ = ["CommSampler", "Event", "exposed_comm"]

log = logging.getLogger("meshrun")

MARK = "meshrun::sampled_step"  # the sampled step: its thread is the main thread
GUARD = "meshrun::guard"  # the numerics guard's collective: not the model's communication
RUNS = ("gloo:", "nccl:")  # ranges of a collective from its start to its completion
ENQUEUE = "c10d::"  # the call that enqueues one collective or point-to-point operation
COMM_OPS = (ENQUEUE, "_c10d_functional::", "c10d_functional::", "record_param_comms")
# What the CPU analysis reads (the rest is skipped while reading, for speed).
_KEEP = ("aten::", "meshrun::", *RUNS, *COMM_OPS)
Span = tuple[int, int]  # nanoseconds
T = TypeVar("T", int, float)


class Event(NamedTuple):
    """What the analysis needs of one profiler event."""

    name: str
    start_ns: int
    end_ns: int
    thread: int
    cuda: bool = False


def merge_spans(spans: Iterable[tuple[T, T]]) -> list[tuple[T, T]]:
    """The union of intervals as disjoint sorted intervals (empty ones dropped)."""
    out: list[tuple[T, T]] = []
    for s, e in sorted(spans):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _minus(a: list[Span], b: list[Span]) -> list[Span]:
    """Parts of the disjoint sorted spans ``a`` outside the disjoint sorted spans ``b``; one
    pass over both (a step has thousands of compute ops)."""
    out: list[Span] = []
    j = 0
    for s, e in a:
        while j < len(b) and b[j][1] <= s:
            j += 1
        cur, k = s, j
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            out.append((cur, e))
    return out


def _length_s(spans: list[Span]) -> float:
    return sum(e - s for s, e in spans) / 1e9


def exposed_comm(events: Sequence[Event], *, cuda: bool = False) -> dict[str, float]:
    """``comm_s``, ``comm_exposed_s``, ``comm_hidden_s`` of one sampled step (see the module
    docstring); empty when the step's marker is missing."""
    mark = next((e for e in events if e.name == MARK), None)
    if mark is None:
        return {}
    main = [e for e in events if e.thread == mark.thread and not e.cuda]
    guard = merge_spans((e.start_ns, e.end_ns) for e in main if e.name == GUARD)
    if cuda:
        kernels = [e for e in events if e.cuda]
        comm = merge_spans((e.start_ns, e.end_ns) for e in kernels if "nccl" in e.name.lower())
        busy = merge_spans((e.start_ns, e.end_ns) for e in kernels if "nccl" not in e.name.lower())
    else:
        pending = merge_spans(
            (s, min(e, mark.end_ns)) for s, e in _pending(events, main, mark.start_ns)
        )
        comm = _minus(pending, guard)
        ops = merge_spans((e.start_ns, e.end_ns) for e in main if e.name.startswith(COMM_OPS))
        aten = merge_spans((e.start_ns, e.end_ns) for e in main if e.name.startswith("aten::"))
        busy = _minus(aten, ops)
    total, exposed = _length_s(comm), _length_s(_minus(comm, busy))
    return {"comm_s": total, "comm_exposed_s": exposed, "comm_hidden_s": total - exposed}


def _pending(events: Sequence[Event], main: Sequence[Event], since: int) -> list[Span]:
    """(enqueue, completion) of each operation that ran in the window: the k-th run matched
    with the k-th enqueueing call (FIFO). A run that began before the window counts from the
    window's start; one without a call in the window (enqueued before it) from its own."""
    calls = sorted(e.start_ns for e in main if e.name.startswith(ENQUEUE) and "wait" not in e.name)
    runs = sorted((e.start_ns, e.end_ns) for e in events if e.name.startswith(RUNS))
    out, k = [], 0
    for start, end in runs:
        if start < since:
            out.append((since, end))  # no call of the window can be its call
            continue
        if k < len(calls) and calls[k] <= start:
            start, k = calls[k], k + 1
        out.append((start, end))
    return out


def _events(prof: Any, cuda: bool) -> list[Event]:
    """The raw (kineto) events: reading them costs a few milliseconds, ``prof.events()``
    builds a tree of Python objects (tens of milliseconds on a step of a small model). On
    CPU only the events the analysis reads are kept."""
    out = []
    gpu = torch.autograd.DeviceType.CUDA
    for e in prof.profiler.kineto_results.events():
        name = e.name()
        on_gpu = cuda and e.device_type() == gpu
        if not on_gpu and not name.startswith(_KEEP):
            continue
        start = e.start_ns()
        out.append(Event(name, start, start + e.duration_ns(), e.start_thread_id(), on_gpu))
    return out


class CommSampler:
    """Runs every ``every``-th step under the profiler; ``stop()`` gives its figures."""

    def __init__(self, every: int, device: torch.device) -> None:
        self.every = every
        self.cuda = device.type == "cuda"
        self._prof: Any = None
        self._mark: Any = None
        self._told = False

    @property
    def active(self) -> bool:
        return self._prof is not None

    def wants(self, step: int) -> bool:
        """Whether optimizer step ``step`` (1-based) is sampled; never the first (warm-up)."""
        return self.every > 0 and step > 1 and step % self.every == 0

    def start(self) -> None:
        if self._prof is not None:
            return
        if torch.autograd.profiler._is_profiler_enabled:  # the user is profiling: leave it be
            self._say("a profiler is already running: this step's communication is not sampled")
            return
        # kineto prints two lines per start/stop on stderr unless told otherwise (level 6:
        # none); read at its first use, so set before it. A user's own setting wins.
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        acts = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        prof = torch.profiler.profile(activities=acts, record_shapes=False, with_stack=False)
        prof.start()
        self._prof = prof
        self._mark = record_function(MARK)
        self._mark.__enter__()

    @contextmanager
    def guard(self) -> Iterator[None]:
        """Marks the guard collective on a sampled step (nothing recorded otherwise)."""
        if self._prof is None:
            yield
            return
        with record_function(GUARD):
            yield

    def stop(self) -> dict[str, float | str]:
        """End the sampled step: its figures with ``comm_method``; empty when not sampling."""
        prof, self._prof = self._prof, None
        if prof is None:
            return {}
        self._mark.__exit__(None, None, None)
        prof.stop()
        figures = exposed_comm(_events(prof, self.cuda), cuda=self.cuda)
        if not figures:
            self._say("the profiler recorded no step marker: communication not measured")
            return {}
        return {**figures, "comm_method": "profiler_sampled"}

    def close(self) -> None:
        """Stop without measuring (the loop ended inside a sampled step)."""
        if self._prof is not None:
            self._mark.__exit__(None, None, None)
            self._prof.stop()
            self._prof = None

    def _say(self, text: str) -> None:
        if not self._told:
            self._told = True
            log.warning("monitor.comm_sample_every: %s", text)
