"""Stragglers told apart (monitor/straggler_history.py), without processes: a rank slow at
most recent checks is chronic, a one-off stall transient; the moving averages and the top-k
slowest ranks; the [monitor] keys that set the thresholds."""

import pytest

from meshrun.config import Config, ConfigError, apply_overrides
from meshrun.monitor.straggler_history import StragglerHistory, Verdict
from meshrun.monitor.stragglers import COMPONENTS, find_stragglers

HOSTS = ["a", "b", "c", "d"]
STEPS = 10  # steps per check


def means(own: list[float], data: list[float] | None = None) -> list[dict[str, float]]:
    """Per-step means of one check, every component present (as gathered)."""
    data = data or [0.001] * len(own)
    return [
        {**dict.fromkeys(COMPONENTS, 0.0), "own_s": o, "data_wait_s": d, "step_time_s": 0.2}
        for o, d in zip(own, data, strict=True)
    ]


def check(history: StragglerHistory, step: int, own: list[float]) -> Verdict:
    """One check as StepMonitor runs it: flag against the others' median, then classify."""
    rows = means(own)
    sums = [{k: v * STEPS for k, v in r.items()} for r in rows]
    flagged = find_stragglers(sums, HOSTS, step, STEPS, 1.5, 0.005)
    return history.add(rows, HOSTS, STEPS, flagged)


def kinds(v: Verdict) -> list[tuple[int, str, str]]:
    return [(c.straggler.rank, c.straggler.component, c.kind) for c in v.flags]


def test_a_rank_slow_at_every_check_turns_chronic_a_one_off_stall_stays_transient() -> None:
    h = StragglerHistory(windows=5, chronic=3, top_k=2)
    # Rank 1 is 100 ms slower at every check; rank 3 stalls once, at the second check.
    plan = {2: [0.01, 0.11, 0.01, 0.5]}
    verdicts = [check(h, 10 * i, plan.get(i, [0.01, 0.11, 0.01, 0.01])) for i in range(1, 7)]
    assert kinds(verdicts[0]) == [(1, "own_s", "transient")]  # one check: not yet chronic
    assert kinds(verdicts[1]) == [(1, "own_s", "transient"), (3, "own_s", "transient")]
    assert kinds(verdicts[2]) == [(1, "own_s", "chronic")]  # 3 of the last 3
    assert [c.straggler.rank for c in verdicts[2].became_chronic] == [1]
    for v in verdicts[3:]:  # still chronic; said once only
        assert kinds(v) == [(1, "own_s", "chronic")] and v.became_chronic == []
    assert verdicts[2].flags[0].fields()["flagged"] == 3
    assert "chronic: flagged at 3 of the last 3 check(s)" in verdicts[2].flags[0].message()
    # The stall has left rank 3's window after 5 more checks; rank 3 was never chronic.
    assert all(c.kind == "transient" for v in verdicts for c in v.flags if c.straggler.rank == 3)


def test_a_chronic_rank_recovers_once_its_slow_checks_leave_the_window() -> None:
    h = StragglerHistory(windows=4, chronic=3, top_k=1)
    for i in range(4):
        check(h, i, [0.01, 0.2, 0.01, 0.01])
    recovered = [check(h, 10 + i, [0.01] * 4).recovered for i in range(3)]
    # 3, then 2 of the last 4 flagged: chronic until the second quiet check.
    assert recovered == [[], [1], []]


def test_moving_averages_weight_checks_by_their_steps_and_rank_the_slowest() -> None:
    h = StragglerHistory(windows=2, chronic=2, top_k=2)
    h.add(means([0.0, 0.03, 0.02, 0.0]), HOSTS, 10, [])
    h.add(means([0.0, 0.00, 0.02, 0.0]), HOSTS, 30, [])
    assert h.average(1).means["own_s"] == pytest.approx((0.03 * 10 + 0.0 * 30) / 40)
    assert [a.rank for a in h.slowest()] == [2, 1]  # 20 ms over both, 7.5 ms on average
    h.add(means([0.1, 0.0, 0.0, 0.0]), HOSTS, 10, [])  # the first check leaves the window
    assert [a.rank for a in h.slowest()] == [0, 2]
    assert h.slowest()[0].fields()["host"] == "a"
    assert "rank 0 on a (data_wait 1.0 ms, own 25.0 ms per step)" in h.slowest()[0].text()
    assert StragglerHistory(windows=2, chronic=1, top_k=0).slowest() == []


def test_straggler_threshold_keys_are_checked_naming_the_key() -> None:
    cfg = apply_overrides(
        Config(), [("monitor.straggler_windows", "8"), ("monitor.straggler_chronic", "6")]
    )
    assert (cfg.monitor.straggler_windows, cfg.monitor.straggler_chronic) == (8, 6)
    with pytest.raises(ConfigError, match=r"monitor\.straggler_chronic = 6 exceeds"):
        apply_overrides(Config(), [("monitor.straggler_chronic", "6")])
    with pytest.raises(ConfigError, match=r"monitor\.straggler_windows"):
        apply_overrides(Config(), [("monitor.straggler_windows", "0")])
    with pytest.raises(ConfigError, match=r"monitor\.straggler_top_k"):
        apply_overrides(Config(), [("monitor.straggler_top_k", "-1")])
