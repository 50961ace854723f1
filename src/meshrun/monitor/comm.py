"""Exposed versus hidden gradient communication under DDP, timed through DDP's comm hook.

DDP launches one all-reduce per gradient bucket as soon as the bucket's gradients are
computed, while backward goes on computing the rest; ``backward()`` returns once every
bucket's all-reduce is done. meshrun wraps the registered hook (torch's default
``allreduce_hook`` when none is configured and the user registered none, else the
fp16/bf16/PowerSGD one) so that each
bucket records two times: when the hook is called (its gradients are ready: the launch) and
when its future completes (a ``then`` callback).

- ``comm_s``: the time during which at least one bucket's all-reduce was in flight (the union
  of the launch-to-completion intervals) per optimizer step.
- ``comm_exposed_s``: the wait for communication after the last bucket was launched: the
  latest completion minus the latest launch. When the last bucket is launched, all
  gradients are computed; whatever communication is still running then is waited for by
  ``backward()``; everything before it ran behind compute (``comm_hidden_s`` = the rest).

No synchronisation is added: on CPU/Gloo the times are wall-clock reads on the host (the
completion callback runs on Gloo's worker thread as the collective finishes); on CUDA they are
CUDA events on the launch and completion streams, read at the end of the step only when
``query()`` says they are done (the guard's ``.item()`` has synchronised by then).
Errors: the launch time is taken when DDP calls the hook, a few microseconds after the
bucket's last gradient; the small amount of autograd work after the last bucket (DDP's
finalisation) counts as exposed; communication threads competing with compute for CPU cores
slow the compute but are not counted as exposed. See docs/monitor.md.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from meshrun.monitor.comm_profile import merge_spans
from meshrun.parallel.kinds import is_fsdp_module

__all__ = ["CommHook", "CommTimer"]

log = logging.getLogger("meshrun")

CommHook = Callable[[Any, Any], "torch.futures.Future[torch.Tensor]"]


@dataclass
class _Bucket:
    launched: Any  # float seconds (host clock) or a CUDA event
    done: Any = None


class CommTimer:
    """Times the buckets of each backward; ``take()`` once per optimizer step."""

    def __init__(
        self, device: torch.device, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.cuda = device.type == "cuda"
        self._clock = clock  # the host clock (CPU); a test passes its own to set the times
        self.installed = False
        self._lock = threading.Lock()
        self._open: list[_Bucket] = []  # the current backward's buckets
        self._closed: list[list[_Bucket]] = []  # this step's finished backwards
        self._seen: set[int] = set()  # models already looked at by maybe_attach

    def _now(self) -> Any:
        if not self.cuda:
            return self._clock()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def wrap(self, hook: CommHook) -> CommHook:
        """``hook`` with its launch and completion timed; register the result with DDP."""
        self.installed = True

        # DDP inspects the parameter named ``bucket``; no annotations (checked at runtime).
        def timed_hook(state, bucket):  # type: ignore[no-untyped-def]
            mark = _Bucket(self._now())
            with self._lock:
                self._open.append(mark)

            def done(fut):  # type: ignore[no-untyped-def]
                mark.done = self._now()
                return fut.value()

            return hook(state, bucket).then(done)

        timed_hook.__name__ = f"timed_{getattr(hook, '__name__', 'hook')}"
        return timed_hook

    def maybe_attach(self, models: Sequence[nn.Module]) -> None:
        """Before a step: time the default all-reduce of DDP models without a comm hook. Done
        lazily (not in ``parallelize``) so that users can still register their own hook on the
        returned DDP model before the loop starts; such a hook is left alone (not timed)."""
        for m in models:
            if id(m) in self._seen:
                continue
            self._seen.add(id(m))
            if is_fsdp_module(m):
                log.info(
                    "FSDP2's all-gathers and reduce-scatters have no comm hook: their exposed "
                    "time is measured by the profiler every monitor.comm_sample_every steps "
                    "(docs/monitor.md)"
                )
            if not isinstance(m, DDP):
                continue
            hooks = getattr(m, "_comm_hooks", None)  # private: checked, never assumed
            if hooks is None or hooks:
                log.info(
                    "exposed communication not measured for this DDP model: %s",
                    "a comm hook is already registered (time your own with "
                    "run.timed_comm_hook(hook))"
                    if hooks
                    else "this torch does not say whether a comm hook is registered",
                )
                continue
            m.register_comm_hook(m.process_group, self.wrap(default_hooks.allreduce_hook))

    def backward_ends(self) -> None:
        """Called after each ``backward()``: its buckets form one group."""
        with self._lock:
            if self._open:
                self._closed.append(self._open)
                self._open = []

    def take(self) -> dict[str, float]:
        """This step's ``comm_s``, ``comm_exposed_s`` and ``comm_hidden_s`` (summed over its
        backwards with a gradient all-reduce); empty when no hook is installed."""
        if not self.installed:
            return {}
        with self._lock:
            groups, self._closed = self._closed, []
        comm = exposed = 0.0
        for group in groups:
            spans = [s for s in (self._span(b, group[0]) for b in group) if s is not None]
            if not spans:
                continue
            comm += sum(e - s for s, e in merge_spans(spans))
            exposed += max(0.0, max(e for _, e in spans) - max(s for s, _ in spans))
        return {"comm_s": comm, "comm_exposed_s": exposed, "comm_hidden_s": comm - exposed}

    def _span(self, b: _Bucket, first: _Bucket) -> tuple[float, float] | None:
        if b.done is None:
            return None  # not completed (an error): not measured
        if not self.cuda:
            return (b.launched, b.done)
        if not (first.launched.query() and b.launched.query() and b.done.query()):
            return None  # never wait here: the figure is dropped instead
        # On the GPU timeline, from the group's first launch: only differences matter.
        ref = first.launched
        return (ref.elapsed_time(b.launched) / 1e3, ref.elapsed_time(b.done) / 1e3)
