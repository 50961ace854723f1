"""The profiler method's analysis (monitor/comm_profile.py) on made-up event timelines, and the
summary's comm shares when only sampled steps carry the figures."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from meshrun.monitor.comm_profile import GUARD, MARK, Event, _minus, exposed_comm, merge_spans
from meshrun.monitor.metrics import MetricsLogger

MS = 1_000_000  # ns
MAIN, GLOO = 1, 2


def ev(name: str, start_ms: float, end_ms: float, thread: int = MAIN, cuda: bool = False) -> Event:
    return Event(name, int(start_ms * MS), int(end_ms * MS), thread, cuda)


def test_waiting_is_exposed_and_compute_meanwhile_is_hidden() -> None:
    events = [
        ev(MARK, 0, 100),
        ev("c10d::_allgather_base_", 10, 11),  # enqueued here...
        ev("gloo:all_gather", 12, 50, GLOO),  # ...runs until 50 on Gloo's thread
        ev("aten::mm", 20, 30),  # the main thread computes meanwhile: hidden
        ev("aten::add", 60, 70),  # no communication pending: not counted at all
    ]
    got = exposed_comm(events)
    assert got["comm_s"] == pytest.approx(0.040)
    assert got["comm_exposed_s"] == pytest.approx(0.030)
    assert got["comm_hidden_s"] == pytest.approx(0.010)


def test_runs_match_calls_in_order_and_the_guard_is_left_out() -> None:
    events = [
        ev(MARK, 0, 100),
        ev("c10d::allreduce_", 10, 11),
        ev("c10d::allreduce_", 15, 16),  # queued behind the first: pending from 15
        ev("gloo:all_reduce", 20, 30, GLOO),
        ev("gloo:all_reduce", 31, 40, GLOO),
        ev(GUARD, 60, 70),
        ev("c10d::allreduce_", 61, 62),
        ev("gloo:all_reduce", 62, 69, GLOO),
    ]
    got = exposed_comm(events)
    assert got["comm_s"] == pytest.approx(0.030)  # 10..40; the guard's 61..69 left out
    assert got["comm_exposed_s"] == pytest.approx(0.030)


def test_runs_enqueued_before_the_window_are_clipped_to_it() -> None:
    events = [
        ev(MARK, 10, 100),
        ev("gloo:all_reduce", 5, 12, GLOO),  # began before the step: 10..12
        ev("gloo:all_reduce", 15, 19, GLOO),  # no call in the step: from its own start
        ev("c10d::send", 30, 31),
        ev("gloo:send", 95, 120),  # 30..100 (its call at 30; clipped to the step)
    ]
    got = exposed_comm(events)
    assert got["comm_s"] == pytest.approx(0.002 + 0.004 + 0.070)


def test_cuda_exposed_is_nccl_time_without_other_kernels() -> None:
    events = [
        ev(MARK, 0, 100),
        ev("ncclDevKernel_AllGather_RING_LL", 0, 10, 7, cuda=True),
        ev("ampere_sgemm_128x64", 5, 20, 7, cuda=True),
    ]
    got = exposed_comm(events, cuda=True)
    assert got["comm_s"] == pytest.approx(0.010)
    assert got["comm_exposed_s"] == pytest.approx(0.005)


def test_no_marker_no_figures() -> None:
    assert exposed_comm([ev("gloo:all_reduce", 0, 5, GLOO)]) == {}


def test_minus_matches_a_pointwise_reference() -> None:
    rng = random.Random(0)
    for _ in range(500):
        a, b = (
            merge_spans(
                (x, x + rng.randint(0, 9)) for x in rng.sample(range(60), rng.randint(0, 8))
            )
            for _ in range(2)
        )
        want = {t for s, e in a for t in range(s, e) if not any(bs <= t < be for bs, be in b)}
        assert {t for s, e in _minus(a, b) for t in range(s, e)} == want, (a, b)


def test_summary_comm_shares_are_of_the_sampled_steps(tmp_path: Path) -> None:
    """Steps 1-6 of 0.1 s; 2, 4, 6 sampled with 0.02 s exposed: 20% of a sampled step, not
    the 10% an average over every step would say."""
    with MetricsLogger(tmp_path, is_main=True, progress=False) as m:
        for step in range(1, 7):
            extra: dict[str, float | str] = {"data_wait_s": 0.01}
            if step % 2 == 0:
                extra |= {"comm_s": 0.03, "comm_exposed_s": 0.02, "comm_method": "profiler_sampled"}
            m.log_step(step, loss=1.0, lr=0.1, step_time_s=0.1, samples=8, tokens=8, extra=extra)
        summary = m.summary()
    assert summary["comm_exposed_share"] == pytest.approx(0.2)
    assert summary["comm_share"] == pytest.approx(0.3)
    assert summary["data_wait_share"] == pytest.approx(0.1)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x.get("comm_method") for x in lines if "step" in x] == [None, "profiler_sampled"] * 3


def test_report_renders_when_only_sampled_steps_carry_comm(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from test_report import T0, start, step_row, write_run

    from meshrun.cli.main import main as cli_main

    records = [start(T0)]
    for step in range(1, 9):
        row = step_row(step, T0 + 0.1 * step)
        if step % 2 == 0:
            row |= {"comm_s": 0.03, "comm_exposed_s": 0.02, "comm_method": "profiler_sampled"}
        records.append(row)
    run_dir = write_run(tmp_path / "r", records)
    assert cli_main(["report", str(run_dir), "-o", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "breakdown.png").stat().st_size > 1000
    assert "<img" in (tmp_path / "out" / "report.html").read_text()
