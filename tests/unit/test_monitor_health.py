"""The pure parts of issue 7's monitor: straggler comparison, guard packing, config keys,
the hang report from watchdog files."""

import json
import math
import time
from pathlib import Path

import pytest
import torch

from meshrun.config import Config, ConfigError, apply_overrides
from meshrun.monitor.numerics import check_loss, describe, first_nonfinite
from meshrun.monitor.stragglers import find_stragglers
from meshrun.monitor.watchdog import Watchdog, hang_report

HOSTS = ["a", "b", "c", "d"]


def rows(data_waits: list[float], own: list[float] | None = None) -> list[dict[str, float]]:
    own = own or [0.01] * len(data_waits)
    return [
        {"step_time_s": 0.05, "data_wait_s": d, "own_s": o}
        for d, o in zip(data_waits, own, strict=True)
    ]


def test_a_slow_loader_rank_is_flagged_against_the_others_median() -> None:
    found = find_stragglers(rows([0.01, 0.01, 0.30, 0.012]), HOSTS, 40, 10, 1.5, 0.005)
    assert [(s.rank, s.host, s.component, s.step) for s in found] == [(2, "c", "data_wait_s", 40)]
    assert found[0].slower_by == pytest.approx(0.30 / 0.01)
    assert "rank 2 on c at step 40" in found[0].message()


def test_jitter_below_the_absolute_floor_or_the_factor_is_not_flagged() -> None:
    # 3x slower but only 2 ms per step more: under straggler_min_s = 5 ms.
    assert find_stragglers(rows([0.01, 0.03]), HOSTS, 10, 10, 1.5, 0.005) == []
    # 50 ms more per step but only 1.2x: under the factor.
    assert find_stragglers(rows([2.5, 3.0]), HOSTS, 10, 10, 1.5, 0.005) == []
    assert find_stragglers(rows([0.0]), HOSTS, 10, 10, 1.5, 0.005) == []  # one rank: no peers


def test_two_ranks_compare_each_against_the_other() -> None:
    found = find_stragglers(rows([0.0, 0.0], own=[0.1, 0.5]), HOSTS, 20, 10, 1.5, 0.005)
    assert [(s.rank, s.component) for s in found] == [(1, "own_s")]
    assert found[0].slower_by == pytest.approx(5.0)


def test_guard_without_a_process_group_reports_the_local_loss() -> None:
    ok = check_loss(torch.tensor(3.0), 2, torch.device("cpu"), distributed=False)
    assert ok.finite and ok.loss == pytest.approx(1.5)
    bad = check_loss(torch.tensor(math.inf), 1, torch.device("cpu"), distributed=False)
    assert bad.bad_ranks == (0,) and math.isnan(bad.loss)
    assert (
        describe(bad, 7, ["host-a"]) == "non-finite loss (NaN/Inf) at step 7 on rank(s) 0 (host-a)"
    )
    none = check_loss(None, 1, torch.device("cpu"), distributed=False)
    assert none.finite and math.isnan(none.loss)


def test_the_stop_message_names_the_first_nonfinite_value_then_gradient() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    model(torch.ones(1, 2)).sum().backward()
    assert "the loss itself" in first_nonfinite([model], distributed=False)
    # A NaN gradient spreads towards the input: the one nearest the output is named.
    model[0].weight.grad.fill_(math.nan)
    model[1].bias.grad[0] = math.inf
    assert "the gradient of '1.bias' (rank 0)" in first_nonfinite([model], distributed=False)
    # A NaN value wins over every gradient (it makes them NaN).
    with torch.no_grad():
        model[2].weight[0, 1] = math.nan
    assert "parameter '2.weight' (rank 0)" in first_nonfinite([model], distributed=False)


def test_monitor_config_keys_are_checked() -> None:
    cfg = apply_overrides(
        Config(), [("monitor.nonfinite", "stop"), ("monitor.straggler_every", "5")]
    )
    assert cfg.monitor.nonfinite == "stop" and cfg.monitor.straggler_every == 5
    with pytest.raises(ConfigError, match=r"monitor\.nonfinite"):
        apply_overrides(Config(), [("monitor.nonfinite", "ignore")])
    with pytest.raises(ConfigError, match=r"monitor\.straggler_factor"):
        apply_overrides(Config(), [("monitor.straggler_factor", "0.5")])
    assert Config().monitor.nonfinite_limit == 3  # a model NaN from its start stops at step 3
    with pytest.raises(ConfigError, match=r"monitor\.nonfinite_limit = -1.*>= 0"):
        apply_overrides(Config(), [("monitor.nonfinite_limit", "-1")])


def test_hang_report_names_silent_ranks_and_where_the_others_wait(tmp_path: Path) -> None:
    dog = Watchdog(tmp_path, rank=0, world_size=3, timeout_s=5.0)
    dog._dump("eval", 12)  # what the thread writes on timeout, from this (main) thread
    (tmp_path / "hang" / "rank2.txt").write_text(
        (tmp_path / "hang" / "rank0.txt").read_text().replace('"rank": 0', '"rank": 2', 1)
    )
    report = hang_report(tmp_path, since=0.0)
    assert report is not None
    assert "rank(s) 1 did not report" in report
    assert "rank 0 (" in report and "in phase eval after step 12" in report
    assert "your code: test_monitor_health.py:" in report
    assert hang_report(tmp_path, since=time.time() + 60) is None  # older files are ignored


def test_a_hang_in_a_phase_reports_the_phase_limit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A hung eval under monitor.phase_timeout_s = 120 once reported "timeout_s": 300 (the step
    # timeout) although its deadline had been 120 s.
    dog = Watchdog(tmp_path, rank=0, world_size=2, timeout_s=300.0)
    with dog.phase("eval", 120.0):
        dog._dump("eval", 8)  # what the thread writes when the phase's deadline passes
    header = json.loads((tmp_path / "hang" / "rank0.txt").read_text().partition("\n")[0])
    assert (header["phase"], header["timeout_s"]) == ("eval", 120.0)
    assert "made no progress for 120 s (phase eval, after step 8)" in capsys.readouterr().out
    dog.beat(9)  # back in the step loop: the step timeout again
    dog._dump("train", 9)
    header = json.loads((tmp_path / "hang" / "rank0.txt").read_text().partition("\n")[0])
    assert header["timeout_s"] == 300.0
    dog.disarm()


def test_a_disabled_watchdog_starts_no_thread(tmp_path: Path) -> None:
    dog = Watchdog(tmp_path, rank=0, world_size=1, timeout_s=0.0)
    dog.beat(1)
    with dog.phase("eval", 10.0):
        pass
    assert dog._thread is None
