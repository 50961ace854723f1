"""`meshrun report` on a replica-group run: records written by hand in the format the metrics
logger and ft/replica.py write (step lines with live_groups/committed, ft_groups,
ft_uncommitted, ft_heal), then the goodput split, the events table and the loss figure."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from test_report import STEP_S, T0, restarted_run, start, step_row, write_run

from meshrun.report.analysis import analyse, load_run

LOST_S = 0.4  # the uncommitted attempt of step 4: from step 3's line to its ft_uncommitted


def ft_row(step: int, t: float, step_time: float = STEP_S, live: int = 2) -> dict[str, Any]:
    return {**step_row(step, t, step_time), "live_groups": live, "committed": True}


def ft_run(path: Path) -> Path:
    """Steps 1-3 with 2 groups; step 4's all-reduce fails (a peer died) after 0.4 s; the
    survivor re-forms alone and redoes step 4 (its line covers both attempts: 0.7 s); at step
    6 the restarted group joins and heals from group 0; steps 7-8 with 2 groups again."""
    t = T0 + 1.0
    recs: list[dict[str, Any]] = [start(T0)]
    for s in range(1, 4):
        t += STEP_S
        recs.append(ft_row(s, t))
    recs.append(
        {
            "event": "ft_uncommitted",
            "time": t + LOST_S,
            "step": 4,
            "live_groups": 2,
            "error": "RuntimeError: Connection reset by peer",
        }
    )
    recs.append(
        {"event": "ft_groups", "time": t + 0.5, "step": 3, "live_groups": 1, "change": "left"}
    )
    t += 0.7
    recs.append(ft_row(4, t, 0.7, live=1))
    for s in (5, 6):
        t += STEP_S
        recs.append(ft_row(s, t, live=1))
    recs.append({"event": "ft_groups", "time": t, "step": 6, "live_groups": 2, "change": "joined"})
    recs.append(
        {
            "event": "ft_heal",
            "time": t,
            "step": 6,
            "bytes": 123456,
            "seconds": 0.25,
            "source": "group 0",
            "live_groups": 2,
        }
    )
    for s in (7, 8):
        t += STEP_S
        recs.append(ft_row(s, t))
    recs.append(
        {"event": "summary", "time": t + 0.3, "steps": 8.0, "total_time_s": 7 * STEP_S + 0.7}
    )
    return write_run(path, recs)


def test_uncommitted_step_time_is_lost_with_its_own_label(tmp_path: Path) -> None:
    fig = analyse(load_run(ft_run(tmp_path / "ft")))
    g = fig.goodput
    assert fig.median_step_s == pytest.approx(STEP_S)
    assert g.uncommitted_s == pytest.approx(LOST_S)
    parts = g.parts()
    assert parts["uncommitted steps (replica groups)"] == pytest.approx(LOST_S)
    assert g.wall_s == pytest.approx(1.0 + 7 * STEP_S + 0.7 + 0.3)
    assert math.fsum(parts.values()) == pytest.approx(g.wall_s)
    # Step 4's line took 0.7 s, 0.4 s of it the lost attempt: the 8 steps' own time is the rest.
    assert g.useful_s == pytest.approx(7 * STEP_S + 0.7 - LOST_S)
    assert [e["event"] for e in fig.ft_events] == [
        "ft_uncommitted",
        "ft_groups",
        "ft_groups",
        "ft_heal",
    ]


def test_uncommitted_step_after_the_last_line_comes_out_of_outside_time(tmp_path: Path) -> None:
    recs = [start(T0), ft_row(1, T0 + 1.0), ft_row(2, T0 + 1.1)]
    recs.append(
        {
            "event": "ft_uncommitted",
            "time": T0 + 1.6,
            "step": 3,
            "live_groups": 2,
            "error": "timeout",
        }
    )
    g = analyse(load_run(write_run(tmp_path / "end", recs))).goodput
    assert g.uncommitted_s == pytest.approx(0.5)
    assert math.fsum(g.parts().values()) == pytest.approx(g.wall_s)
    # Wall 1.6 s: 0.2 s in steps, 0.5 s the uncommitted attempt, the start-up 0.9 s outside.
    assert g.outside_s == pytest.approx(0.9)


def test_report_html_has_the_events_table_and_a_plain_run_does_not(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from meshrun.report.html import write_report

    write_report([ft_run(tmp_path / "ft")], tmp_path / "out_ft")
    html = (tmp_path / "out_ft" / "report.html").read_text()
    assert "Fault-tolerance events (replica groups)" in html
    assert "<td>6</td><td>healed (2 groups live)</td><td>group 0</td><td>123,456</td>" in html
    assert "<td>0.250</td>" in html
    assert "step not committed (2 groups live): RuntimeError: Connection reset by peer" in html
    assert "a group left (1 groups live)" in html and "a group joined (2 groups live)" in html
    assert "<td>uncommitted steps (replica groups)</td><td>0.40</td>" in html

    plain = analyse(load_run(restarted_run(tmp_path / "plain")))
    assert plain.ft_events == [] and plain.goodput.uncommitted_s is None
    assert not any("uncommitted" in k for k in plain.goodput.parts())
    write_report([tmp_path / "plain"], tmp_path / "out_plain")
    html = (tmp_path / "out_plain" / "report.html").read_text()
    assert "Fault-tolerance" not in html and "uncommitted" not in html


def test_a_restarted_group_that_healed_ran_only_the_steps_after_its_heal(tmp_path: Path) -> None:
    """The healed group's own file: steps 1-4, killed, restarted, healed to step 7 from group
    0, steps 8-10. Steps 5-7 came from the peer: in its model, but not run (nor redone) here."""
    recs: list[dict[str, Any]] = [start(T0)]
    recs += [ft_row(s, T0 + 1.0 + s * STEP_S) for s in range(1, 5)]
    t = T0 + 10.0
    recs += [
        start(t),
        {
            "event": "ft_heal",
            "time": t + 0.5,
            "step": 7,
            "bytes": 6940,
            "seconds": 0.2,
            "source": "group 0",
            "live_groups": 2,
        },
    ]
    recs += [ft_row(s, t + 0.5 + (s - 7) * STEP_S) for s in range(8, 11)]
    g = analyse(load_run(write_run(tmp_path / "healed", recs))).goodput
    assert g.useful_s == pytest.approx(7 * STEP_S)  # 4 + 3 steps run by this group
    assert g.redone_s == pytest.approx(0.0, abs=1e-9)
    assert g.restarts_s == pytest.approx(10.0 - 1.4)  # step 4's line to the restart
    assert math.fsum(g.parts().values()) == pytest.approx(g.wall_s)
