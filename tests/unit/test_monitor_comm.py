"""Pure parts of the exposed-communication timer (monitor/comm.py), the flight-recorder
positions in the hang report (monitor/collectives.py) and the host network figures
(monitor/host.py); no process group."""

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from meshrun.monitor.collectives import Position, collective_lines, positions_from_json
from meshrun.monitor.comm import CommTimer
from meshrun.monitor.host import HostStats, parse_net_dev
from meshrun.monitor.watchdog import Watchdog, hang_report


class FakeClock:
    """A host clock the test moves by hand: the timer's figures are then exact, whatever the
    machine's speed or load."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_exposed_is_the_wait_after_the_last_launch_and_comm_the_union() -> None:
    clock = FakeClock()
    timer = CommTimer(torch.device("cpu"), clock=clock)
    pending: list[torch.futures.Future[torch.Tensor]] = []

    def hook(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        pending.append(fut)
        return fut

    timed = timer.wrap(hook)
    assert timer.installed and timed.__name__ == "timed_hook"
    outs = [timed(None, None)]  # t=0: bucket 1 launched, then "compute" goes on
    clock.now += 0.050
    pending[0].set_result(torch.ones(1))  # t=0.05: bucket 1 done behind compute
    clock.now += 0.010
    outs.append(timed(None, None))  # t=0.06: the last bucket: all gradients computed
    clock.now += 0.030  # backward waits for it: exposed
    pending[1].set_result(torch.ones(1))  # t=0.09
    assert all(torch.equal(o.wait(), torch.ones(1)) for o in outs)  # values pass through
    timer.backward_ends()
    got = timer.take()
    assert got["comm_exposed_s"] == pytest.approx(0.030, abs=1e-9), got
    assert got["comm_s"] == pytest.approx(0.080, abs=1e-9), got  # the union: the 10 ms gap out
    assert got["comm_hidden_s"] == pytest.approx(0.050, abs=1e-9), got


def test_overlapping_buckets_count_once_and_backwards_add_up() -> None:
    clock = FakeClock()
    timer = CommTimer(torch.device("cpu"), clock=clock)
    pending: list[torch.futures.Future[torch.Tensor]] = []

    def hook(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        pending.append(torch.futures.Future())
        return pending[-1]

    timed = timer.wrap(hook)
    for _ in range(2):  # two backwards (accumulation) in one optimizer step
        pending.clear()
        timed(None, None)  # t=0
        clock.now += 0.010
        timed(None, None)  # t=0.01, overlapping the first
        clock.now += 0.020
        pending[0].set_result(torch.ones(1))  # t=0.03
        clock.now += 0.005
        pending[1].set_result(torch.ones(1))  # t=0.035
        timer.backward_ends()
    got = timer.take()
    assert got["comm_s"] == pytest.approx(2 * 0.035, abs=1e-9), got  # not 0.03 + 0.025 each
    assert got["comm_exposed_s"] == pytest.approx(2 * 0.025, abs=1e-9), got
    assert timer.take() == {"comm_s": 0.0, "comm_exposed_s": 0.0, "comm_hidden_s": 0.0}


def test_a_bucket_that_never_completes_is_left_out() -> None:
    clock = FakeClock()
    timer = CommTimer(torch.device("cpu"), clock=clock)
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    futures = iter([done, torch.futures.Future()])
    timed = timer.wrap(lambda state, bucket: next(futures))
    timed(None, None)
    clock.now += 0.020
    done.set_result(torch.ones(1))
    timed(None, None)  # its all-reduce failed: no completion time
    timer.backward_ends()
    got = timer.take()
    assert got["comm_s"] == pytest.approx(0.020, abs=1e-9), got


def test_no_hook_means_no_figures() -> None:
    assert CommTimer(torch.device("cpu")).take() == {}


def fr_dump(seq: int, op: str = "gloo:all_reduce") -> str:
    """The shape of torch 2.13's _dump_fr_trace_json (Gloo), trimmed to the fields read."""
    return json.dumps(
        {
            "pg_status": {
                "0": {"last_enqueued_collective": str(seq), "last_completed_collective": "1"},
                "1": {"last_enqueued_collective": "3", "last_completed_collective": "3"},
            },
            "entries": [
                {
                    "pg_id": 0,
                    "process_group": ["0", "default_pg"],
                    "collective_seq_id": s,
                    "profiling_name": "gloo:all_gather" if s < seq else op,
                    "is_p2p": False,
                }
                for s in range(max(1, seq - 2), seq + 1)
            ],
        }
    )


def test_positions_come_from_the_last_enqueued_collective_per_group() -> None:
    pos = positions_from_json(fr_dump(42))
    assert pos["0"] == Position(42, "gloo:all_reduce", "default_pg")
    assert pos["1"] == Position(3, "?", "")  # its entry has left the buffer


def test_lines_name_the_rank_that_did_not_reach_the_collective() -> None:
    at = {0: positions_from_json(fr_dump(42)), 1: positions_from_json(fr_dump(41))}
    (line,) = collective_lines(at, silent=[])
    assert "collective #42 (gloo:all_reduce) on process group 0 (default_pg)" in line
    assert "rank(s) 0 at #42, rank 1 at #41: rank(s) 1 did not reach #42" in line
    (line,) = collective_lines({0: at[0]}, silent=[1])
    assert "rank(s) 0 at #42; rank(s) 1: unknown (no report)" in line
    assert collective_lines({0: at[0], 1: at[0]}, silent=[]) == []  # all agree: nothing


def test_hang_report_includes_the_flight_recorder_positions(tmp_path: Path) -> None:
    Watchdog(tmp_path, rank=0, world_size=2, timeout_s=5.0)._dump("train", 9)
    path = tmp_path / "hang" / "rank0.txt"
    head, _, stacks = path.read_text().partition("\n")
    info = json.loads(head)
    assert "groups" in info["collectives"], info  # read for real (no group here: empty)
    for rank, seq in ((0, 42), (1, 41)):
        info |= {
            "rank": rank,
            "collectives": {
                "groups": {"0": Position(seq, "gloo:all_reduce", "default_pg").to_json()}
            },
        }
        (tmp_path / "hang" / f"rank{rank}.txt").write_text(json.dumps(info) + "\n" + stacks)
    report = hang_report(tmp_path, since=0.0)
    assert report is not None
    assert "rank(s) 0 at #42, rank 1 at #41: rank(s) 1 did not reach #42" in report, report


NET_DEV = """Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed
    lo: 9999999 10    0    0    0     0          0         0 9999999 10    0    0    0     0       0          0
  eth0: 1000    5    0    0    0     0          0         0     300    2    0    0    0     0       0          0
  eth1:   24    1    0    0    0     0          0         0      76    1    0    0    0     0       0          0
"""


def test_network_bytes_leave_out_loopback() -> None:
    assert parse_net_dev(NET_DEV) == (1024, 376)


def test_host_stats_give_network_rates_after_a_baseline(monkeypatch: Any, tmp_path: Path) -> None:
    fake = tmp_path / "net_dev"
    fake.write_text(NET_DEV)
    monkeypatch.setattr("meshrun.monitor.host._NET_DEV", fake)
    clock = FakeClock()  # host.py's time.monotonic, for this module only
    monkeypatch.setattr("meshrun.monitor.host.time", SimpleNamespace(monotonic=clock))
    stats = HostStats(torch.device("cpu"))
    assert stats.sample() == {}  # the first sample is the baseline; no GPU keys on CPU
    fake.write_text(NET_DEV.replace("1000", str(1000 + 2 * 2**20)))
    clock.now += 0.5
    got = stats.sample()
    assert set(got) == {"net_rx_mb_s", "net_tx_mb_s"} and got["net_tx_mb_s"] == 0.0
    assert got["net_rx_mb_s"] == pytest.approx(4.0), got  # 2 MiB in 0.5 s
    assert stats.sample() == {}  # no time passed: no rate (never a division by zero)
