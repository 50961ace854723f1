"""Goodput: where a run's wall time went, in parts that add up to it.

Wall time runs from the first ``start`` record (written when ``meshrun.init()`` has set up the
process group) to the last record of the file; process start-up before that (imports) is not
seen. Every part is *measured*, never a count times a typical step time (a median times the
step count exceeds the time the steps took whenever the machine slows mid-run):

- the step loop's time, per process start: the summary line's ``total_time_s`` (every step's
  measured time), or the logged steps' times scaled to the steps run when the process died
  before its summary. Checkpoint saves blocking inside a step and replica-group attempts that
  did not commit are taken out of it; the rest is split over the steps run at its mean: the
  useful ones (in the final model: not skipped by the numerics guard, not redone after a
  restart), the non-finite skips and the redone ones;
- checkpoint saves (``checkpoint`` lines' ``blocked_s``: inside steps or after the loop);
- evaluation (``eval`` lines' ``seconds``: ``run.evaluate``, which the step times leave out);
- restarts: from the last record of a process to the ``start`` line of the next (the crash,
  the launcher's restart, the imports);
- uncommitted steps under replica groups (from the record before each ``ft_uncommitted`` line
  to it: the failed attempt, which leaves no step line);
- outside the step loop: the rest (set-up after ``init``, resuming, the end of the run).

Steps a restarted replica group received from a peer (``ft_heal``) are in its model but not in
its time: neither useful nor redone there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshrun.report.records import RunData, Session

__all__ = ["FT_EVENTS", "Goodput", "goodput"]

# The events replica-group fault tolerance writes (ft/replica.py), in the report's table.
FT_EVENTS = ("ft_groups", "ft_uncommitted", "ft_heal")


@dataclass
class Goodput:
    """Where the wall time went (seconds); the parts add up to ``wall_s``."""

    wall_s: float
    useful_s: float
    skipped_s: float  # steps skipped by the numerics guard
    redone_s: float  # steps done again after a restart
    checkpoint_s: float  # training blocked by checkpoint saves
    eval_s: float  # run.evaluate
    restarts_s: float  # from a process's last record to the next process's start line
    outside_s: float  # outside the step loop: after init, resuming, the end
    # Steps the replica-group quorum did not commit; None for a run without replica groups,
    # whose table then reads as it always did.
    uncommitted_s: float | None = None

    @property
    def share(self) -> float:
        return self.useful_s / self.wall_s if self.wall_s > 0 else math.nan

    def parts(self) -> dict[str, float]:
        out = {
            "useful steps": self.useful_s,
            "non-finite skips": self.skipped_s,
            "redone after restart": self.redone_s,
            "checkpoint saves": self.checkpoint_s,
            "evaluation": self.eval_s,
            "restarts": self.restarts_s,
            "outside the step loop": self.outside_s,
        }
        if self.uncommitted_s is not None:
            out["uncommitted steps (replica groups)"] = self.uncommitted_s
        return out


@dataclass
class _Loop:
    """The step loops' totals over every process start."""

    executed: int = 0  # steps run (a redone step twice)
    steps_s: float = 0.0  # measured time inside steps
    ckpt_in: float = 0.0  # of it, checkpoint saves blocking inside a step


def _loop_totals(data: RunData) -> _Loop:
    out = _Loop()
    healed_in, _ = _healed_steps(data)
    for s, gap in zip(data.sessions, healed_in, strict=True):
        first, last = _session_steps(s)
        ran = (last - first + 1 if last else 0) - gap
        out.executed += ran
        out.steps_s += _session_step_time(s, ran)
        # A save after step S blocks inside step S+1's time; the last one is after the loop.
        out.ckpt_in += sum(e["blocked_s"] for e in s.of("checkpoint") if e["after_step"] < last)
    return out


def goodput(data: RunData) -> Goodput:
    """The wall time of ``data`` split into measured parts (the module docstring)."""
    wall = _wall_time(data)
    loop = _loop_totals(data)
    # Steps a healed replica group took from a peer are in its model but not its time.
    distinct = max(int(r["step"]) for r in data.rows) - _healed_steps(data)[1]
    skipped = len(data.events("nonfinite"))
    ckpt_all = sum(float(e["blocked_s"]) for e in data.events("checkpoint"))
    evals = sum(float(e.get("seconds", 0.0)) for e in data.events("eval"))
    restarts = _restart_time(data)
    lost_in, lost_out = _uncommitted_time(data)
    work = max(loop.steps_s - loop.ckpt_in - lost_in, 0.0)
    per_step = work / loop.executed if loop.executed > 0 else 0.0
    outside = wall - loop.steps_s - (ckpt_all - loop.ckpt_in) - lost_out - evals - restarts
    return Goodput(
        wall_s=wall,
        useful_s=(distinct - skipped) * per_step,
        skipped_s=skipped * per_step,
        redone_s=(loop.executed - distinct) * per_step,
        checkpoint_s=ckpt_all,
        eval_s=evals,
        restarts_s=restarts,
        outside_s=max(outside, 0.0),  # clocks of one host: at worst a rounding below 0
        uncommitted_s=lost_in + lost_out if _has_replica_groups(data) else None,
    )


def _restart_time(data: RunData) -> float:
    """From each process's last record to the next one's ``start`` line."""
    total = 0.0
    for before, after in zip(data.sessions, data.sessions[1:], strict=False):
        records = [*before.rows, *before.events]
        if after.start is not None and records:
            last = max(float(r["time"]) for r in records)
            total += max(float(after.start["time"]) - last, 0.0)
    return total


def _has_replica_groups(data: RunData) -> bool:
    return any("live_groups" in r for r in data.rows) or any(
        e.get("event") in FT_EVENTS for s in data.sessions for e in s.events
    )


def _healed_steps(data: RunData) -> tuple[list[int], int]:
    """Steps received by ``ft_heal`` rather than run: (per session, those inside its step
    range; all). A restarted group heals before its first step; a live one between steps."""
    inside, total, prev_last = [], 0, 0
    for s in data.sessions:
        gap = 0
        for e in s.of("ft_heal"):
            before = [int(r["step"]) for r in s.rows if float(r["time"]) <= float(e["time"])]
            base = max(before) if before else prev_last
            gap += max(int(e["step"]) - base, 0) if before else 0
            total += max(int(e["step"]) - base, 0)
        inside.append(gap)
        prev_last = max(prev_last, int(s.rows[-1]["step"])) if s.rows else prev_last
    return inside, total


def _uncommitted_time(data: RunData) -> tuple[float, float]:
    """Seconds of uncommitted steps (from the record before each ``ft_uncommitted`` event to
    it): (inside the step time of the next committed step, after a session's last step)."""
    inside = after = 0.0
    for s in data.sessions:
        last_row = float(s.rows[-1]["time"]) if s.rows else -math.inf
        for e in s.of("ft_uncommitted"):
            t = float(e["time"])
            before = [float(r["time"]) for r in [*s.rows, *s.events] if float(r["time"]) < t]
            if s.start is not None:
                before.append(float(s.start["time"]))
            lost = t - max(before) if before else 0.0
            if t < last_row:
                inside += lost
            else:
                after += lost
    return inside, after


def _wall_time(data: RunData) -> float:
    first = data.sessions[0]
    if first.start is not None:
        t0 = float(first.start["time"])
    else:  # no start record: from the beginning of the first logged step
        t0 = float(first.rows[0]["time"]) - float(first.rows[0]["step_time_s"])
    t1 = max(float(r["time"]) for s in data.sessions for r in [*s.rows, *s.events])
    return max(t1 - t0, 0.0)


def _session_steps(s: Session) -> tuple[int, int]:
    """(first, last) optimizer step this session ran; (0, 0) if none. Rows may be every
    ``log_every``-th step only, so the first comes from the resume line or the fresh start."""
    if not s.rows:
        return 0, 0
    last = int(s.rows[-1]["step"])
    resumed = s.of("resume")
    healed = [e for e in s.of("ft_heal") if float(e["time"]) <= float(s.rows[0]["time"])]
    if healed:  # a restarted replica group continues at the step it healed to
        first = int(healed[-1]["step"]) + 1
    elif resumed:
        first = int(resumed[0]["from_step"]) + 1
    elif s.start is not None:
        first = 1  # started without a checkpoint
    else:  # a file without start lines: the first logged step is all we know
        first = int(s.rows[0]["step"])
    return min(first, int(s.rows[0]["step"])), last


def _session_step_time(s: Session, executed: int) -> float:
    """Seconds inside steps: the summary's total when the session ended cleanly, else the
    logged steps' times scaled to the steps executed (rows may be every log_every-th)."""
    summary = s.of("summary")
    if summary and "total_time_s" in summary[-1]:
        return float(summary[-1]["total_time_s"])
    logged = [float(r["step_time_s"]) for r in s.rows]
    return math.fsum(logged) * executed / len(logged) if logged else 0.0
