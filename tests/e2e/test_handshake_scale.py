"""benchmarks/handshake_scale.py at CI size: the launch's checked handshake with 32 simulated
nodes, 256 under the heavy mark (threads, no agents), against a real TCPStore server, records
signed and carrying the default config's shared settings. The host reads each record once; the others read only its
decision, so each record is read once (each node reading every record every poll was 701
store operations and 1.2 MiB per node at 256 nodes; docs/scale.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _each_record_read_once_by_the_host(monkeypatch: pytest.MonkeyPatch, nodes: int) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import handshake_scale

    row = handshake_scale.measure(nodes, timeout_s=240.0)
    # Counted reads, not operations: a waiting node's polls grow with the wall time.
    assert row["records_read_by_host"] == row["distinct_read_by_host"] == nodes, row
    assert row["records_read_by_others"] == 0, row


@pytest.mark.timeout(300)
def test_32_nodes_handshake_reads_each_record_once(monkeypatch: pytest.MonkeyPatch) -> None:
    _each_record_read_once_by_the_host(monkeypatch, 32)


# heavy: the 32-node test above counts the same reads. The handshake of 256 nodes takes about
# 1 s, but connecting 256 store clients took 53 s in make test: about one connection in 25
# to 50 waits 5 s on a reverse DNS query this machine's resolver drops (docs/scale.md).
@pytest.mark.heavy
@pytest.mark.timeout(600)
def test_256_nodes_handshake_reads_each_record_once(monkeypatch: pytest.MonkeyPatch) -> None:
    _each_record_read_once_by_the_host(monkeypatch, 256)
