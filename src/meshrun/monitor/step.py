"""Per-step monitoring the step loop calls into: the wall-clock breakdown of a step, the
numerics guard and the periodic straggler check. One instance per run, on every rank.

Breakdown (wall clock, no added synchronisation): ``forward_s`` runs from the batch being
handed to the user until ``run.backward``; ``backward_s`` is the ``backward`` call (on DDP it
includes the gradient all-reduce not hidden behind compute); ``optimizer_s`` is clipping plus
``optimizer.step``; ``sync_s`` the per-step agreement (the guard's collective); ``data_wait_s`` comes from the loader
clock. On CUDA these are host times of asynchronous launches (see docs/monitor.md).
Under DDP, ``comm_exposed_s`` (part of ``backward_s``) and ``comm_hidden_s`` split the gradient
all-reduce into waited-for and overlapped time (monitor/comm.py). Without DDP's hook (FSDP2,
TP, PP), every ``monitor.comm_sample_every``-th step runs under the profiler and carries the
same figures (monitor/comm_profile.py); ``comm_method`` says which.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from meshrun.config import MonitorConfig
from meshrun.monitor.comm import CommHook, CommTimer
from meshrun.monitor.comm_profile import CommSampler
from meshrun.monitor.host import HostStats
from meshrun.monitor.metrics import MetricsLogger
from meshrun.monitor.numerics import (
    GuardResult,
    NonFiniteLossError,
    describe,
    first_nonfinite,
    guard_result,
    local_loss,
)
from meshrun.monitor.replicas_check import ReplicaCheck
from meshrun.monitor.straggler_history import StragglerHistory, Verdict
from meshrun.monitor.stragglers import (
    COMPONENTS,
    find_stragglers,
    gather_components,
    gather_hosts,
)
from meshrun.monitor.watchdog import Watchdog
from meshrun.runtime.agreement import StepAgreement

__all__ = ["StepMonitor"]

log = logging.getLogger("meshrun")

# loop_s: the loop's own bookkeeping after a step (metrics line, console, straggler check),
# counted in the next step, whose wall-clock time it is part of.
_PHASES = ("forward_s", "backward_s", "optimizer_s", "sync_s", "loop_s")


@dataclass
class _Window:
    steps: int = 0
    sums: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COMPONENTS, 0.0))


class StepMonitor:
    """Times the phases of each step, runs the guard, and checks for stragglers."""

    def __init__(
        self,
        settings: MonitorConfig,
        *,
        device: torch.device,
        distributed: bool,
        hostname: str,
        metrics: MetricsLogger,
        agreement: StepAgreement | None = None,
        models: list[nn.Module] | None = None,
    ) -> None:
        self.settings = settings
        # The run's one per-step collective: the guard exchanges it; the checkpointer's
        # preemption and async-save flags are slots of it (meshrun/runtime/agreement.py).
        self.agreement = agreement or StepAgreement(device, distributed)
        self.device = device
        self.distributed = distributed
        self.hostname = hostname
        self.metrics = metrics
        self.skipped_steps = 0
        self.nonfinite_in_row = 0  # non-finite steps since the last finite one
        self._hosts: list[str] | None = None
        self._phase = dict.fromkeys(_PHASES, 0.0)
        self._t_batch: float | None = None
        self._window = _Window()
        self._history = StragglerHistory(
            settings.straggler_windows, settings.straggler_chronic, settings.straggler_top_k
        )
        self._said_at = 0  # checks already summed up by the "slowest ranks" line
        self.replica_check = ReplicaCheck(settings.replica_check_every, hostname, metrics)
        self.comm = CommTimer(device)
        self.sampler = CommSampler(settings.comm_sample_every, device)
        self._step = 0  # optimizer steps done, for choosing the sampled ones
        self.host = HostStats(device)  # network bytes/s, NVML: sampled on logged steps
        # The loop's models (run.parallelize appends to the train state's list, this one).
        self.models: list[nn.Module] = [] if models is None else models
        distributed_now = dist.is_initialized()
        self.watchdog = Watchdog(
            metrics.run_dir,
            dist.get_rank() if distributed_now else 0,
            dist.get_world_size() if distributed_now else 1,
            settings.step_timeout_s,
        )

    # --- hang watchdog --------------------------------------------------------------------

    def loop_starts(self, step: int) -> None:
        """Arm the watchdog; the first step gets the phase timeout (warm-up, compilation)."""
        self.watchdog.beat(step, timeout_s=self.settings.phase_timeout_s)
        self._step = step

    def loop_ends(self) -> None:
        self.watchdog.disarm()
        self.sampler.close()
        self._say_slowest()

    @contextmanager
    def phase(self, name: str, timeout_s: float | None = None) -> Iterator[None]:
        with self.watchdog.phase(name, timeout_s or self.settings.phase_timeout_s):
            yield

    # --- breakdown ------------------------------------------------------------------------

    def batch_ready(self) -> None:
        if self.settings.comm_timing:
            self.comm.maybe_attach(self.models)
        # DDP's hook measures every step; the profiler is for the layouts it cannot time.
        if self.distributed and not self.comm.installed and self.sampler.wants(self._step + 1):
            t0 = time.perf_counter()
            self.sampler.start()
            self._phase["loop_s"] += time.perf_counter() - t0  # monitoring's own cost
        self._t_batch = time.perf_counter()

    def backward_starts(self) -> float:
        now = time.perf_counter()
        if self._t_batch is not None:
            self._phase["forward_s"] += now - self._t_batch
            self._t_batch = None
        return now

    def add(self, phase: str, since: float) -> float:
        now = time.perf_counter()
        self._phase[phase] += now - since
        if phase == "backward_s":
            self.comm.backward_ends()
        return now

    def comm_hook_wrap(self) -> Callable[[CommHook], CommHook] | None:
        """What ``run.parallelize`` wraps DDP's comm hook with (None: ``comm_timing`` off)."""
        return self.comm.wrap if self.settings.comm_timing else None

    # --- numerics guard -------------------------------------------------------------------

    def guard(
        self,
        loss_sum: torch.Tensor | None,
        accum: int,
        step: int,
        grad_sq: Callable[[], float] | None = None,
    ) -> GuardResult:
        """Exchange the step's agreement (the one collective; ``step`` is the 1-based step
        about to be taken) and read the guard's slot of it: raise on every rank together under
        ``nonfinite = "stop"``. The other subsystems read their slots with
        ``agreement.agreed(step)`` after this. ``grad_sq``: this rank's share of the squared
        gradient norm, carried by the same exchange (its time counts as ``optimizer_s``)."""
        if self._t_batch is not None:  # no run.backward (pipeline step): count it as forward
            self.backward_starts()
        share = None
        if grad_sq is not None:
            t_norm = time.perf_counter()
            share = grad_sq()
            self.add("optimizer_s", t_norm)
        t0 = time.perf_counter()
        with self.sampler.guard():
            agreed = self.agreement.exchange(step, loss=local_loss(loss_sum, accum), grad_sq=share)
        result = guard_result(agreed)
        self.add("sync_s", t0)
        if result.finite:
            self.nonfinite_in_row = 0
            return result
        self.nonfinite_in_row += 1
        self._stop_or_skip(result, step)
        return result

    def _stop_or_skip(self, result: GuardResult, step: int) -> None:
        """A non-finite step: raise on every rank together under ``nonfinite = "stop"`` or at
        the ``nonfinite_limit``-th such step in a row (a model NaN from its start would else
        skip every step and exit 0), naming the first NaN/Inf tensor; else skip it."""
        text = describe(result, step, self._hosts)
        limit, in_row = self.settings.nonfinite_limit, self.nonfinite_in_row
        limit_hit = self.settings.nonfinite == "skip" and 0 < limit <= in_row
        stop = self.settings.nonfinite == "stop" or limit_hit
        action = "stop" if stop else "skip"
        self.metrics.log_event("nonfinite", step=step, ranks=list(result.bad_ranks), action=action)
        if stop:
            reason = (
                f"{in_row} non-finite steps in a row, monitor.nonfinite_limit={limit}"
                if limit_hit
                else "monitor.nonfinite=stop"
            )
            where = first_nonfinite(self.models, self.distributed)
            raise NonFiniteLossError(
                f"{text}: stopping on every rank ({reason}); {where}. Fix the model's "
                "initialisation, the data or the learning rate; monitor.nonfinite_limit=0 "
                "skips such steps without limit"
            )
        self.skipped_steps += 1
        if self.metrics.is_main:
            log.warning("%s: every rank skips this optimizer step (monitor.nonfinite=skip)", text)

    # --- per-step figures and stragglers --------------------------------------------------

    def end_step(self, step: int, step_time_s: float, data_wait_s: float) -> dict[str, float | str]:
        """The step's breakdown (for the metrics line); every ``straggler_every`` steps, the
        straggler check (a collective: every rank calls this every step)."""
        self.watchdog.beat(step)
        self._step = step
        sampled = self.sampler.stop()
        phases, self._phase = self._phase, dict.fromkeys(_PHASES, 0.0)
        hooked = self.comm.take()
        comm: dict[str, float | str] = {**hooked, "comm_method": "ddp_hook"} if hooked else sampled
        own = step_time_s - phases["backward_s"] - phases["sync_s"]
        exposed = hooked.get("comm_exposed_s", 0.0)  # sampled figures: step lines only
        w = self._window
        w.steps += 1
        for key, value in (
            ("step_time_s", step_time_s),
            ("data_wait_s", data_wait_s),
            ("own_s", own),
            ("compute_s", phases["forward_s"] + phases["backward_s"] - exposed),
            ("comm_exposed_s", exposed),
            ("optimizer_s", phases["optimizer_s"]),
        ):
            w.sums[key] += value
        every = self.settings.straggler_every
        if every > 0 and self.distributed and step % every == 0:
            self._check_stragglers(step)
        self.replica_check.maybe_check(step, self.models)  # silent data corruption
        return {**phases, **comm}

    def _check_stragglers(self, step: int) -> None:
        window, self._window = self._window, _Window()
        if self._hosts is None:
            self._hosts = gather_hosts(self.hostname)
        per_rank = gather_components(window.sums, self.device)
        if not self.metrics.is_main:
            return
        s, hosts = self.settings, self._hosts
        flagged = find_stragglers(
            per_rank, hosts, step, window.steps, s.straggler_factor, s.straggler_min_s
        )
        means = [{k: v / window.steps for k, v in sums.items()} for sums in per_rank]
        verdict = self._history.add(means, hosts, window.steps, flagged)
        slowest = [a.fields() for a in verdict.slowest]
        rows = _rank_rows(means, hosts)
        self.metrics.log_event("ranks", step=step, steps=window.steps, ranks=rows, slowest=slowest)
        _say(verdict, self.metrics)

    def _say_slowest(self) -> None:
        """The top-k slowest ranks by moving average, once per loop, on the main rank."""
        if not self.metrics.is_main or self._history.checks == self._said_at:
            return
        self._said_at = self._history.checks
        slowest = self._history.slowest()
        if slowest:
            log.info(
                "slowest ranks (data wait + own time, moving average of the last %d check(s)): %s",
                self._history.windows,
                "; ".join(a.text() for a in slowest),
            )


def _say(verdict: Verdict, metrics: MetricsLogger) -> None:
    """Every flag to metrics.jsonl; on the console transient flags, a rank turning chronic
    (once: its later flags would repeat it every check) and a chronic rank recovering."""
    chronic_said = {c.straggler.rank for c in verdict.became_chronic}
    for c in verdict.flags:
        metrics.log_event("straggler", **c.fields())
        if c.kind == "transient":
            log.warning("%s", c.message())
    for c in verdict.became_chronic:
        log.warning(
            "chronic %s; its later flags go to metrics.jsonl only while it stays chronic",
            c.message(),
        )
    for rank in verdict.recovered:
        if rank not in chronic_said:
            log.info("rank %d is no longer a chronic straggler", rank)


def _rank_rows(means: list[dict[str, float]], hosts: list[str]) -> list[dict[str, object]]:
    """Every rank's per-step means over the window, for the ``{"event": "ranks"}`` line."""
    rows: list[dict[str, object]] = []
    for rank, mean in enumerate(means):
        t = mean["step_time_s"]
        share = mean["data_wait_s"] / t if t else 0.0
        rows.append({"rank": rank, "host": hosts[rank], **mean, "data_wait_share": share})
    return rows
