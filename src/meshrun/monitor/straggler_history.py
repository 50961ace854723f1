"""Stragglers told apart: a rank slow at most of the recent straggler checks is *chronic*
(a slower host, a throttled GPU, a bad link: it costs every step until someone acts), a rank
slow at one check is *transient* (a one-off stall: a page-cache miss, a noisy neighbour).

Pure: it receives each check's per-rank figures (what ``stragglers.gather_components``
gathered, as per-step means) and the ranks ``find_stragglers`` flagged, and keeps, per rank,
the last ``windows`` checks: which were flagged, and the figures, whose step-weighted mean is
the rank's moving average of each step component. No process group, no clock: the unit
tests drive it with made-up windows.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from meshrun.monitor.stragglers import COMPARED, COMPONENTS, Straggler

__all__ = ["Classified", "RankAverage", "StragglerHistory", "Verdict"]


@dataclass(frozen=True)
class Classified:
    """A flag of this check with its kind: ``flagged`` of the last ``windows`` checks."""

    straggler: Straggler
    kind: str  # "chronic" or "transient"
    flagged: int
    windows: int

    def fields(self) -> dict[str, object]:
        """The ``{"event": "straggler", ...}`` line's fields."""
        return {
            **self.straggler.fields(),
            "kind": self.kind,
            "flagged": self.flagged,
            "windows": self.windows,
        }

    def message(self) -> str:
        return (
            f"{self.straggler.message()}; {self.kind}: flagged at {self.flagged} of the last "
            f"{self.windows} check(s)"
        )


@dataclass(frozen=True)
class RankAverage:
    """One rank's moving averages (seconds per step over its remembered checks)."""

    rank: int
    host: str
    means: dict[str, float]
    flagged: int  # checks flagged among the remembered ones
    kind: str  # "chronic", "transient" (flagged, not chronic) or "" (not flagged)

    @property
    def slowness_s(self) -> float:
        """What ranks are ordered by: the components where a rank waits for no peer."""
        return sum(self.means[c] for c in COMPARED)

    def fields(self) -> dict[str, object]:
        return {
            "rank": self.rank,
            "host": self.host,
            **self.means,
            "flagged": self.flagged,
            "kind": self.kind,
        }

    def text(self) -> str:
        parts = ", ".join(f"{c.removesuffix('_s')} {self.means[c] * 1e3:.1f} ms" for c in COMPARED)
        kind = f"; {self.kind}" if self.kind else ""
        return f"rank {self.rank} on {self.host} ({parts} per step{kind})"


@dataclass(frozen=True)
class Verdict:
    """What one check concluded."""

    flags: list[Classified]
    became_chronic: list[Classified]  # the rank's first check as chronic: said on the console
    recovered: list[int]  # ranks chronic before and not any more
    slowest: list[RankAverage]  # the top-k by moving average, slowest first


@dataclass
class _Rank:
    flags: deque[bool]
    windows: deque[tuple[int, Mapping[str, float]]]  # (steps, per-step means)
    chronic: bool = False


@dataclass
class StragglerHistory:
    """The last ``windows`` checks of every rank; ``chronic``: flags among them that make a
    rank chronic; ``top_k``: slowest ranks listed per check."""

    windows: int
    chronic: int
    top_k: int
    checks: int = 0  # checks recorded so far
    _ranks: dict[int, _Rank] = field(default_factory=dict)
    _hosts: list[str] = field(default_factory=list)

    def add(
        self,
        means: Sequence[Mapping[str, float]],
        hosts: Sequence[str],
        steps: int,
        flagged: Sequence[Straggler],
    ) -> Verdict:
        """Record one check: every rank's per-step means over its ``steps`` steps, the flags
        ``find_stragglers`` raised on them; classify the flags and rank the ranks."""
        self.checks += 1
        self._hosts = list(hosts)
        slow = {s.rank for s in flagged}
        was_chronic = {r for r, h in self._ranks.items() if h.chronic}
        for rank, row in enumerate(means):
            h = self._ranks.setdefault(
                rank, _Rank(deque(maxlen=self.windows), deque(maxlen=self.windows))
            )
            h.flags.append(rank in slow)
            h.windows.append((steps, dict(row)))
            h.chronic = sum(h.flags) >= self.chronic
        flags = [self._classify(s) for s in flagged]
        seen: set[int] = set()
        became = []
        for c in flags:  # one console line per rank turning chronic, not per component
            if c.kind == "chronic" and c.straggler.rank not in was_chronic | seen:
                seen.add(c.straggler.rank)
                became.append(c)
        recovered = sorted(r for r in was_chronic if not self._ranks[r].chronic)
        return Verdict(flags, became, recovered, self.slowest())

    def _classify(self, s: Straggler) -> Classified:
        h = self._ranks[s.rank]
        return Classified(s, "chronic" if h.chronic else "transient", sum(h.flags), len(h.flags))

    def average(self, rank: int) -> RankAverage:
        """``rank``'s moving averages: its remembered checks' figures, weighted by steps."""
        h = self._ranks[rank]
        total = sum(n for n, _ in h.windows)
        means = {c: sum(n * row.get(c, 0.0) for n, row in h.windows) / total for c in COMPONENTS}
        flagged = sum(h.flags)
        kind = "chronic" if h.chronic else "transient" if flagged else ""
        host = self._hosts[rank] if rank < len(self._hosts) else "?"
        return RankAverage(rank, host, means, flagged, kind)

    def slowest(self) -> list[RankAverage]:
        """The ``top_k`` ranks with the largest moving average of data wait + own time
        (slowest first; ties by rank)."""
        ranked = sorted(
            (self.average(r) for r in self._ranks), key=lambda a: (-a.slowness_s, a.rank)
        )
        return ranked[: self.top_k]
