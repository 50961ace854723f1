"""The multi-node handshake: its decisions (pure, on records) and its protocol over a real
in-process TCPStore with one thread per "node" (no processes; the namespace runs are in
tests/e2e/test_multinode.py)."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
from torch.distributed import TCPStore

from meshrun.launch.multinode.handshake import Handshake, HandshakeError
from meshrun.launch.multinode.records import (
    JoinTarget,
    NodeInfo,
    find_problems,
    is_complete,
    missing_ranks,
    waiting_message,
)
from meshrun.runtime.ports import free_port
from meshrun.runtime.secret import JobSecret

SECRET = JobSecret(b"0123456789abcdef0123456789abcdef", "test")

BASE = NodeInfo(
    hostname="node0",
    node_rank=0,
    nproc=2,
    torch="2.13.0",
    cuda="none",
    nccl="none",
    python="3.11.9",
    meshrun="0.1.0",
    config_digest="abc",
    settings={"optim.lr": 0.1, "job.name": "x"},
)


def node(rank: int, host: str | None = None, **changes: Any) -> NodeInfo:
    return replace(BASE, hostname=host or f"node{rank}", node_rank=rank, **changes)


# --- pure decisions ------------------------------------------------------------------------


def test_agreeing_nodes_have_no_problems_and_complete() -> None:
    nodes, target = [node(0), node(1)], JoinTarget(2, 2)
    assert find_problems(nodes, target) == []
    assert is_complete(nodes, target) and missing_ranks(nodes, target) == []


def test_waiting_message_names_who_joined_and_who_is_missing() -> None:
    target = JoinTarget(3, 3)
    assert waiting_message([node(0)], JoinTarget(2, 2)) == (
        "1/2 nodes joined [node0]; waiting for node_rank 1"
    )
    assert waiting_message([node(2, "c"), node(0, "a")], target) == (
        "2/3 nodes joined [a, c]; waiting for node_rank 1"
    )
    assert not is_complete([node(0), node(2)], target)
    elastic = waiting_message([node(0)], JoinTarget(2, 4))
    assert elastic == "1/2 nodes joined [node0]; waiting for 1 more node (elastic 2:4)"


def test_duplicate_node_rank_names_both_hosts() -> None:
    problems = find_problems([node(0, "a"), node(0, "b")], JoinTarget(2, 2))
    assert len(problems) == 1
    assert "node_rank 0 is claimed by 2 nodes: a (node_rank 0), b (node_rank 0)" in problems[0]
    assert "--node-rank in [0, 2)" in problems[0]
    # Elastic jobs: the agent assigns ranks, equal --node-rank values are fine.
    assert find_problems([node(0, "a"), node(0, "b")], JoinTarget(2, 3)) == []


def test_version_and_config_mismatches_name_the_hosts_and_the_keys() -> None:
    other = node(
        1, torch="2.12.1", config_digest="def", settings={"optim.lr": 0.2, "job.name": "x"}
    )
    problems = find_problems([node(0), other], JoinTarget(2, 2))
    assert any(
        p == "torch versions differ between nodes: 2.13.0 on node0 (node_rank 0); "
        "2.12.1 on node1 (node_rank 1)"
        for p in problems
    ), problems
    config = next(p for p in problems if p.startswith("configs"))
    assert "optim.lr: 0.1 on node0, 0.2 on node1" in config
    assert "job.name" not in config  # equal keys are not listed


def test_cpu_nodes_do_not_count_as_an_nccl_mismatch() -> None:
    gpu = node(1, nccl="2.21.5")
    assert find_problems([node(0), gpu], JoinTarget(2, 2)) == []
    problems = find_problems([node(0, nccl="2.20.3"), gpu], JoinTarget(2, 2))
    assert problems and problems[0].startswith("NCCL versions differ")


def test_too_many_nodes_is_a_problem() -> None:
    problems = find_problems([node(0), node(1), node(2)], JoinTarget(1, 2))
    assert any("3 nodes joined but --nnodes allows at most 2" in p for p in problems)


def test_record_round_trips_through_json() -> None:
    assert NodeInfo.from_json(BASE.to_json()) == BASE


# --- the protocol over a real store (threads as nodes) ------------------------------------


class Nodes:
    """Runs Handshake.run for several "nodes" against one in-process store."""

    def __init__(self, target: JoinTarget, timeout_s: float = 10.0) -> None:
        self.port = free_port()
        self.target, self.timeout_s = target, timeout_s
        self.host_store = TCPStore(
            "127.0.0.1",
            self.port,
            is_master=True,
            multi_tenant=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=30),
        )
        self.results: dict[int, Any] = {}
        self.said: dict[int, list[str]] = {}

    def start(
        self, i: int, info: NodeInfo, *, is_host: bool = False, secret: JobSecret = SECRET
    ) -> threading.Thread:
        store = (
            self.host_store
            if is_host
            else TCPStore("127.0.0.1", self.port, is_master=False, timeout=timedelta(seconds=30))
        )
        self.said[i] = []
        hs = Handshake(
            store, "job", info, self.target, is_host, self.timeout_s, self.said[i].append, secret
        )

        def body() -> None:
            try:
                self.results[i] = hs.run()
            except HandshakeError as err:
                self.results[i] = err

        thread = threading.Thread(target=body, daemon=True)
        thread.start()
        return thread


@pytest.mark.timeout(60)
def test_protocol_two_nodes_agree_and_a_late_replacement_is_admitted() -> None:
    nodes = Nodes(JoinTarget(2, 2))
    threads = [nodes.start(0, node(0), is_host=True), nodes.start(1, node(1))]
    for t in threads:
        t.join(30)
    for i in (0, 1):
        joined = nodes.results[i]
        assert [n.hostname for n in sorted(joined, key=lambda n: n.node_rank)] == ["node0", "node1"]
    # A restarted node1 (its old record is still there): no duplicate-rank error, it joins.
    late = nodes.start(2, node(1, token="new"))
    late.join(30)
    assert isinstance(nodes.results[2], list), nodes.results[2]


@pytest.mark.timeout(60)
def test_protocol_mismatch_fails_on_every_node() -> None:
    nodes = Nodes(JoinTarget(2, 2))
    threads = [nodes.start(0, node(0), is_host=True), nodes.start(1, node(1, python="3.12.1"))]
    for t in threads:
        t.join(30)
    for i in (0, 1):
        err = nodes.results[i]
        assert isinstance(err, HandshakeError), err
        assert "Python versions differ" in str(err) and "node1 (node_rank 1)" in str(err)


@pytest.mark.timeout(60)
def test_protocol_gives_up_after_the_timeout_saying_who_is_missing() -> None:
    nodes = Nodes(JoinTarget(2, 2), timeout_s=2.0)
    nodes.start(0, node(0), is_host=True).join(30)
    err = nodes.results[0]
    assert isinstance(err, HandshakeError)
    assert "gave up after 2 s" in str(err)
    assert "1/2 nodes joined [node0]; waiting for node_rank 1" in str(err)
    assert nodes.said[0] == ["1/2 nodes joined [node0]; waiting for node_rank 1"]  # no flood


@pytest.mark.timeout(60)
def test_protocol_ignores_records_of_an_earlier_attempt() -> None:
    nodes = Nodes(JoinTarget(2, 2))
    # Leftovers of an earlier launch on the same store: another node claimed rank 1.
    nodes.host_store.set("meshrun/job/attempt", "old")
    nodes.host_store.add("meshrun/job/old/count", 1)
    nodes.host_store.set("meshrun/job/old/node/1", node(1, "ghost").to_json())
    host = nodes.start(0, node(0), is_host=True)
    while nodes.host_store.get("meshrun/job/attempt") == b"old":  # the host draws a new one
        time.sleep(0.05)
    for t in (host, nodes.start(1, node(1))):
        t.join(30)
    hosts = sorted(n.hostname for n in nodes.results[0])
    assert hosts == ["node0", "node1"]


@pytest.mark.timeout(60)
def test_protocol_another_rdzv_id_is_named_not_waited_for_forever() -> None:
    nodes = Nodes(JoinTarget(2, 2), timeout_s=1.5)
    nodes.host_store.set("meshrun/other/attempt", "x")  # a host running another job id
    nodes.start(1, node(1)).join(30)
    err = nodes.results[1]
    assert isinstance(err, HandshakeError)
    assert "holds no meshrun handshake for rdzv_id 'job'" in str(err)
    assert "same --rdzv-id" in str(err)


class Reads:
    """A store proxy that records which keys a node reads (``get``/``multi_get``)."""

    def __init__(self, store: TCPStore) -> None:
        self._store, self.keys = store, []

    def get(self, key: str) -> bytes:
        self.keys.append(key)
        return self._store.get(key)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.keys += keys
        return self._store.multi_get(keys)

    def __getattr__(self, op: str) -> Any:
        return getattr(self._store, op)


@pytest.mark.timeout(60)
def test_protocol_the_host_reads_each_record_once_and_the_others_none() -> None:
    """O(N) in all: a node that read every record every poll made a 1,024-node handshake
    O(N^2) (docs/scale.md). The third node comes late, so every node polls a while."""
    nodes = Nodes(JoinTarget(3, 3))
    reads: dict[int, Reads] = {}
    threads = []
    for i in range(3):
        if i == 2:
            while not any("/progress" in k for k in reads[1].keys):  # node 1 waits and polls
                time.sleep(0.05)
        client = TCPStore("127.0.0.1", nodes.port, is_master=False, timeout=timedelta(seconds=30))
        reads[i] = Reads(nodes.host_store if i == 0 else client)
        nodes.said[i] = []
        hs = Handshake(
            reads[i], "job", node(i), nodes.target, i == 0, 10.0, nodes.said[i].append, SECRET
        )  # type: ignore[arg-type]
        threads.append(
            threading.Thread(target=lambda h=hs, i=i: nodes.results.__setitem__(i, h.run()))
        )
        threads[-1].start()
    for t in threads:
        t.join(30)
    for i in range(3):
        assert [(n.hostname, n.node_rank) for n in nodes.results[i]] == [
            ("node0", 0),
            ("node1", 1),
            ("node2", 2),
        ]
    records = [k for k in reads[0].keys if "/node/" in k]
    assert sorted(records) == sorted(set(records)) and len(records) == 3, reads[0].keys
    for i in (1, 2):
        assert not [k for k in reads[i].keys if "/node/" in k], reads[i].keys
    # Node 1's first line is the host's count when node 1 first read it: the host may or may
    # not have counted node 1 yet (a race between two threads, both answers true), but node 2
    # starts only after that read, so it is never in it.
    first = nodes.said[1][0] if nodes.said[1] else ""
    assert first.startswith(("1/3 nodes joined [node0]", "2/3 nodes joined [node0, node1]")), first
    assert "node2" not in first.split(";")[0], first


def test_a_long_waiting_line_names_the_first_nodes_and_counts_the_rest() -> None:
    joined = [node(r) for r in range(0, 1000)]
    text = waiting_message(joined, JoinTarget(1024, 1024))
    assert text.startswith("1000/1024 nodes joined [node0, node1, node2, node3, node4, node5, ")
    assert "node7 and 992 more]; waiting for node_rank 1000, 1001, " in text
    assert text.endswith("1015 and 8 more")
