"""Point-to-point operations in the hang report (monitor/p2p.py) and the collective positions
under a pipeline (monitor/collectives.py), from files written by real runs (no process group
here). The fixtures in tests/unit/fixtures/p2p/ were made on torch 2.13.0+cpu, Gloo, 2 processes:

- fr_gloo_p2p_rank0.json: a flight-recorder dump by capture_fr.py (beside it);
- stalled_sender/hang/: ``meshrun launch`` of tests/e2e/scripts/pp_hang_worker.py (PP 2, 1F1B,
  2 chunks, ``monitor.step_timeout_s=5``) with TEST_STALL_AT=4: stage 0 sleeps in the script
  before step 4, both watchdogs wrote their hang file;
- stopped_stage/hang/: the same with TEST_PARK_AT=4 and stage 1 SIGSTOPped in its loss function:
  only rank 0 reported, the launcher recorded rank 1 as stopped (stopped.txt);
- pp2_dp2_stalled/hang/: 4 processes, PP 2 x FSDP 2 (``--parallel.dp_shard=2``), TEST_STALL_AT=3:
  rank 0 (stage 0 of the first pipeline) sleeps before step 3; all four reported.
"""

import json
import logging
from pathlib import Path

from meshrun.monitor.collectives import Position, positions_from_json
from meshrun.monitor.p2p import P2PRecord, P2PState, _P2PFilter, p2p_lines, parse_p2p
from meshrun.monitor.watchdog import hang_report

FIXTURES = Path(__file__).parent / "fixtures" / "p2p"


def test_the_gloo_recorder_records_no_p2p_but_counts_it_in_pg_status() -> None:
    text = (FIXTURES / "fr_gloo_p2p_rank0.json").read_text()
    dump = json.loads(text)
    entries = dump["entries"]
    assert [e["profiling_name"] for e in entries] == [
        "gloo:all_reduce",
        "gloo:broadcast",
        "gloo:all_reduce",
    ]
    assert not any(e["is_p2p"] for e in entries)  # 3 isend/irecv + a batch: nothing recorded
    assert dump["pg_status"]["0"]["last_enqueued_collective"] == "8"  # 3 + 3 + 2 sends/recvs
    # So the position is the newest recorded collective, not pg_status's counter.
    assert positions_from_json(text) == {"0": Position(3, "gloo:all_reduce", "default_pg")}


def test_a_receive_without_a_send_is_named_when_both_ranks_report() -> None:
    report = hang_report(FIXTURES / "stalled_sender", since=0.0)
    assert report is not None
    print(report)
    assert "rank 1 p2p: waits in recv #7 from rank 0 (fwd_recv, tensor 4x32x64 float32" in report
    assert "rank 0 p2p: posted recv #6 from rank 1 (bwd_recv" in report  # not waiting in p2p
    assert "posted send #6 to rank 1 (fwd_send_bwd_recv" in report
    assert (
        "p2p 0->1: rank 1's recv #7 (fwd_recv) has no matching send: rank 0 last sent #6 to rank 1"
        in report
    )
    assert "p2p 1->0" not in report  # 6 gradients sent, 6 received: that direction agrees
    assert "collective #" not in report  # both ranks at the same collective


def test_a_stopped_stage_is_unknown_and_the_waiting_receive_named() -> None:
    report = hang_report(FIXTURES / "stopped_stage", since=0.0)
    assert report is not None
    print(report)
    assert "rank(s) 1 were stopped" in report
    assert "rank 0 p2p: waits in recv #7 from rank 1 (fwd_send_bwd_recv" in report
    assert "; rank(s) 1: unknown (no report)" in report
    assert "p2p 1->0" not in report and "p2p 0->1" not in report  # nothing to compare with
    # The worker took its collective position from the newest recorded collective (#6), not
    # from Gloo's counter, which counts the sends and receives too.
    assert "collective #6 (gloo:all_reduce) on process group 0 (default_pg)" in report


def test_pp_x_dp_names_the_pipeline_pair_and_the_data_parallel_collective() -> None:
    report = hang_report(FIXTURES / "pp2_dp2_stalled", since=0.0)
    assert report is not None
    print(report)
    # Rank 2 (stage 1 beside rank 0) waits for activations rank 0 never sent; the other
    # pipeline (ranks 1 and 3) finished the step and waits in the gradient all-reduce over dp.
    assert "rank 2 p2p: waits in recv #5 from rank 0 (fwd_recv" in report
    assert "group 1 (mesh_pp)" in report and "group 2 (mesh_pp)" in report
    assert (
        "p2p 0->2: rank 2's recv #5 (fwd_recv) has no matching send: rank 0 last sent #4 to rank 2"
        in report
    )
    assert report.count("p2p 1->3") + report.count("p2p 3->1") == 0  # that pipeline agrees
    assert "on process group 3 (mesh_dp): rank(s) 1, 3 at #3" in report
    assert "rank(s) 0, 2 did not reach #3" in report


def rec(kind: str, peer: int, seq: int) -> P2PRecord:
    return P2PRecord(kind, peer, seq, "fwd_send", [2, 3], "float32", "1 (mesh_pp)")


def test_sends_without_receives_are_named_as_a_range() -> None:
    states = {
        0: P2PState({("send", 1): rec("send", 1, 8)}, ("send", 1)),
        1: P2PState({("recv", 0): rec("recv", 0, 6)}, ("recv", 0)),
    }
    lines = p2p_lines(states, {0: "schedules.py:683 in _wait_batch_p2p"}, silent=[])
    assert lines[1].startswith("  rank 0 p2p: waits in send #8 to rank 1 (fwd_send, tensor 2x3")
    assert (
        lines[2]
        == "  rank 1 p2p: posted recv #6 from rank 0 (fwd_send, tensor 2x3 float32, group 1 (mesh_pp))"
    )
    assert lines[3] == (
        "  p2p 0->1: rank 0's send #7..#8 (fwd_send) has no matching recv: "
        "rank 1 last posted recv #6 from rank 0"
    )


def test_headers_without_p2p_add_no_lines() -> None:
    assert parse_p2p({"rank": 0}) is None and parse_p2p({"p2p": None}) is None
    assert p2p_lines({}, {}, silent=[1]) == []
    empty = parse_p2p({"p2p": {"last": [], "newest": None}})
    assert empty is None or p2p_lines({0: empty}, {}, silent=[]) == []


def test_the_filter_counts_ops_and_passes_other_records_as_before() -> None:
    logger = logging.getLogger("meshrun.test.p2p")  # not torch's: the filter alone
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: seen.append(r.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)  # the user's level before meshrun's DEBUG
    flt = _P2PFilter(logger)
    logger.addFilter(flt)
    logger.setLevel(logging.DEBUG)
    try:
        logger.debug("batch_p2p %s%s", "fwd_send, ", [])  # counted (nothing), not printed
        logger.debug("[0] Forwarded microbatch 1")  # the schedule's other debug lines: dropped
        logger.warning("kept")
        assert flt.snapshot() == {"last": [], "newest": None}
        logger.setLevel(logging.INFO)  # someone reconfigures logging: the count may stop
        assert "was set to INFO later" in flt.snapshot()["error"]
    finally:
        logger.removeFilter(flt)
        logger.removeHandler(handler)
    assert seen == ["kept"]
    state = parse_p2p({"p2p": {"last": [], "newest": None, "error": "counts may be short"}})
    assert state is not None
    assert p2p_lines({0: state}, {}, silent=[])[1] == "  rank 0 p2p: counts may be short"
