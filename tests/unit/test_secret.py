"""The job secret (where it comes from, what it refuses) and what it signs: the rendezvous
state of meshrun's backend and the handshake's records, over a real in-process TCPStore."""

from __future__ import annotations

import json
import os
import pickle
import stat
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

import sockets
from meshrun.launch.multinode.handshake import Handshake, HandshakeError, job_prefix
from meshrun.launch.multinode.records import JoinTarget, NodeInfo
from meshrun.launch.trust.rendezvous import SignedBackend, forget_store, listen_store
from meshrun.launch.trust.secret import SECRET_FILE_ENV, resolve
from meshrun.runtime.secret import SECRET_ENV, JobSecret, SecretError, sanitize

SECRET = JobSecret(b"0123456789abcdef0123456789abcdef", "test")
OTHER = JobSecret(b"fedcba9876543210fedcba9876543210", "other")
NONCE = "0a1b2c3d4e5f6a7b"  # this launch's


# --- where the secret comes from ----------------------------------------------------------


def _stored(token: bytes) -> bytes:
    """The sealed state a handler's token names (the token also names the log slots read)."""
    return token.rpartition(b"\0")[0]


def test_the_environment_wins_then_the_file_variable_then_the_run_dir(tmp_path: Path) -> None:
    env_secret = "e" * 32
    assert resolve(str(tmp_path), {SECRET_ENV: env_secret}, create=True).key == env_secret.encode()
    assert not (tmp_path / "job.secret").exists()  # nothing written when the env has it
    path = tmp_path / "s.txt"
    path.write_text("f" * 32 + "\n")
    path.chmod(0o600)
    got = resolve(str(tmp_path), {SECRET_FILE_ENV: str(path)}, create=True)
    assert got.key == b"f" * 32 and SECRET_FILE_ENV in got.source
    made = resolve(str(tmp_path / "run"), {}, create=True)
    file = tmp_path / "run" / "job.secret"
    assert stat.S_IMODE(file.stat().st_mode) == 0o600 and len(made.key) == 64
    assert resolve(str(tmp_path / "run"), {}, create=False).key == made.key  # the others read it


def test_bad_secrets_are_refused_naming_the_fix(tmp_path: Path) -> None:
    with pytest.raises(SecretError, match=f"the job secret from env {SECRET_ENV} has 5 char"):
        resolve(str(tmp_path), {SECRET_ENV: "short"}, create=True)
    readable = tmp_path / "open.txt"
    readable.write_text("a" * 32)
    readable.chmod(0o644)
    with pytest.raises(SecretError, match=f"has mode 644.*chmod 600 {readable}"):
        resolve(str(tmp_path), {SECRET_FILE_ENV: str(readable)}, create=True)
    if os.getuid() == 0:
        readable.chmod(0o600)
        os.chown(readable, 1234, -1)
        with pytest.raises(SecretError, match="belongs to uid 1234"):
            resolve(str(tmp_path), {SECRET_FILE_ENV: str(readable)}, create=True)
    with pytest.raises(SecretError, match=f"no job secret.*{SECRET_ENV}.*{SECRET_FILE_ENV}"):
        resolve(str(tmp_path / "none"), {}, create=False)


def test_seal_binds_the_value_to_its_key_and_the_secret() -> None:
    sealed = SECRET.seal("k", "hello")
    assert SECRET.unseal("k", sealed) == "hello"
    assert SECRET.unseal("other-key", sealed) is None  # moved to another key
    assert OTHER.unseal("k", sealed) is None  # another job's secret
    assert SECRET.unseal("k", sealed[:-1] + b"!") is None  # tampered
    assert SECRET.unseal("k", b"hello") is None


def test_text_from_the_network_loses_its_control_characters() -> None:
    assert sanitize("\x1b[31mred\x1b[0m\nnext\x07") == "?[31mred?[0m?next?"
    assert sanitize("x" * 400, 10) == "x" * 10 + "..."


def test_the_one_sanitizer_keeps_printable_ascii_only() -> None:
    # runtime/secret.py's sanitizer serves the launcher and the replica groups alike: the
    # stricter of the two it replaced. C1 controls (\x9b is a one-byte CSI), DEL, tab, new line
    # and every non-ASCII code point (U+202E reverses what follows it on screen) become '?'.
    raw = "ok\x1b]52;c;ZXZpbA==\x07\x1b[2J\rfake\x9b\nnext\tcol\x00\x7f caf\u00e9 \u202egnp.exe"
    assert sanitize(raw) == "ok?]52;c;ZXZpbA==??[2J?fake??next?col?? caf? ?gnp.exe"
    assert sanitize(" ~printable~ ") == " ~printable~ "


# --- the signed rendezvous backend ----------------------------------------------------------


class RunsCode:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (str(self.path), "w"))


@pytest.fixture
def store() -> Any:
    server = listen_store("127.0.0.1", 0, 30)
    yield server
    forget_store(server)


def _state(round_: int = 1) -> _RendezvousState:
    state = _RendezvousState()
    node = _NodeDesc("10.0.0.1", 42, 0)
    state.round, state.complete, state.participants = round_, True, {node: 0}
    state.wait_list = {_NodeDesc("10.0.0.2", 7, 1)}
    state.last_heartbeats = {node: datetime(2026, 1, 1, tzinfo=timezone.utc)}
    state.deadline = datetime(2026, 1, 1, 0, 1, tzinfo=timezone.utc)
    return state


def _fields(state: _RendezvousState) -> dict[str, Any]:
    return dict(vars(state))


@pytest.mark.timeout(60)
def test_the_state_round_trips_as_signed_json_and_no_pickle_is_stored(store: Any) -> None:
    backend = SignedBackend(store, "job", SECRET, NONCE, say=lambda _: None)
    assert backend.get_state() is None
    result = backend.set_state(pickle.dumps(_state()))
    assert result is not None and result[2] is True
    assert _fields(pickle.loads(result[0])) == _fields(_state())
    raw = bytes(store.get("meshrun.rdzv/job"))
    text = SECRET.unseal("meshrun.rdzv/job", raw)
    assert text is not None and json.loads(text)["participants"] == [["10.0.0.1", 42, 0, 0]]
    # A second node with the same secret reads the same state.
    other = SignedBackend(TCPStore("127.0.0.1", store.port, is_master=False), "job", SECRET, NONCE)
    got = other.get_state()
    assert got is not None and _fields(pickle.loads(got[0])) == _fields(_state())


@pytest.mark.timeout(60)
def test_a_forged_pickle_is_refused_named_and_replaced_by_the_last_good_state(
    store: Any, tmp_path: Path
) -> None:
    said: list[str] = []
    backend = SignedBackend(store, "job", SECRET, NONCE, say=said.append)
    good = backend.set_state(pickle.dumps(_state()))
    assert good is not None
    marker = tmp_path / "ran"
    store.set("meshrun.rdzv/job", pickle.dumps(RunsCode(marker)))
    got = backend.get_state()
    assert not marker.exists()
    assert got is not None and _fields(pickle.loads(got[0])) == _fields(_state())
    assert (
        len(said) == 1 and "refused rendezvous state not signed with this job's secret" in said[0]
    )
    assert bytes(store.get("meshrun.rdzv/job")) == _stored(good[1])  # put back
    # Another job's secret, valid JSON, claiming addresses: refused too, the claim sanitized.
    forged = OTHER.seal(
        "meshrun.rdzv/job",
        json.dumps(
            {
                "format": 2,
                "run_id": "job",
                "launch": NONCE,
                "seq": 99,
                "participants": [["\x1b[2Jevil", 1, 0, 0]],
            }
        ),
    )
    store.set("meshrun.rdzv/job", forged)
    assert backend.get_state() is not None
    assert "claims to be from ?[2Jevil" in said[-1]


@pytest.mark.timeout(60)
def test_an_older_signed_state_written_back_is_refused(store: Any) -> None:
    said: list[str] = []
    backend = SignedBackend(store, "job", SECRET, NONCE, say=said.append)
    first = backend.set_state(pickle.dumps(_state(1)))
    assert first is not None
    second = backend.set_state(pickle.dumps(_state(2)), first[1])
    assert second is not None and second[2] is True
    store.set("meshrun.rdzv/job", _stored(first[1]))  # a replay of what anyone could read
    got = backend.get_state()
    assert got is not None and pickle.loads(got[0]).round == 2
    assert "an older state written back" in said[-1]
    # The same signed state moved under another job id (same secret) does not verify there.
    store.set("meshrun.rdzv/job2", _stored(second[1]))
    said.clear()
    other = SignedBackend(store, "job2", SECRET, NONCE, say=said.append)
    assert other.get_state() is None and "not signed" in said[0]


@pytest.mark.timeout(60)
def test_a_state_signed_in_an_earlier_launch_with_the_same_secret_is_refused(store: Any) -> None:
    """The run directory's job.secret is reused by the next launch: a state recorded in the
    earlier one (a closed rendezvous, a high seq) verifies its HMAC but not its nonce."""
    said: list[str] = []
    earlier = SignedBackend(store, "job", SECRET, "1111222233334444", say=said.append)
    closed = _state(7)
    closed.closed = True
    recorded = earlier.set_state(pickle.dumps(closed))
    assert recorded is not None
    store.delete_key("meshrun.rdzv/job")
    backend = SignedBackend(store, "job", SECRET, NONCE, say=said.append)
    mine = backend.set_state(pickle.dumps(_state(1)))
    assert mine is not None and mine[2] is True
    store.set(
        "meshrun.rdzv/job", _stored(recorded[1])
    )  # the replay, seq far ahead of this launch's
    got = backend.get_state()
    assert got is not None and pickle.loads(got[0]).closed is False
    assert pickle.loads(got[0]).round == 1
    assert (
        "refused rendezvous state signed in another launch (nonce 1111222233334444, this "
        f"launch's is {NONCE}" in said[-1]
    ), said
    assert bytes(store.get("meshrun.rdzv/job")) == _stored(mine[1])  # put back


@pytest.mark.timeout(60)
def test_a_deleted_state_is_put_back_at_once_and_said() -> None:
    """One delete_key on the store: the next read neither blocks until the store's timeout
    (every agent stuck, restarts gone) nor forgets the job: the last good state comes back."""
    server = listen_store("127.0.0.1", 0, 5)  # a blocking get would fail after 5 s
    try:
        said: list[str] = []
        backend = SignedBackend(server, "job", SECRET, NONCE, say=said.append)
        other = SignedBackend(  # a full read at every poll: the corruption below is read
            TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=5)),
            "job",
            SECRET,
            NONCE,
            say=said.append,
            full_read_every=timedelta(0),
        )
        good = backend.set_state(pickle.dumps(_state(3)))
        assert good is not None
        server.delete_key("meshrun.rdzv/job")
        started = time.monotonic()
        got = backend.get_state()
        assert time.monotonic() - started < 2
        assert got is not None and _fields(pickle.loads(got[0])) == _fields(_state(3))
        assert bytes(server.get("meshrun.rdzv/job")) == _stored(good[1])
        assert said[:1] == [
            "the rendezvous state meshrun.rdzv/job was deleted from the store; put back the "
            "last good signed state this node holds, the job goes on (whoever can reach the "
            "store's port can delete keys: keep it on a trusted network, docs/security.md)"
        ]
        # Deleted again, then a write with the token the handler holds: the store answers it
        # with the token itself, and the handler would retry it forever; put back instead.
        server.delete_key("meshrun.rdzv/job")
        result = backend.set_state(pickle.dumps(_state(4)), good[1])
        assert result is not None and result[2] is False and _stored(result[1]) == _stored(good[1])
        assert bytes(server.get("meshrun.rdzv/job")) == _stored(good[1]) and len(said) == 2
        result = backend.set_state(pickle.dumps(_state(4)), result[1])
        assert result is not None and result[2] is True
        got = other.get_state()  # another node reads the state written
        assert got is not None and pickle.loads(got[0]).round == 4
        # A corrupted value: refused and replaced the same way.
        server.set("meshrun.rdzv/job", b"\x00garbage")
        # TCPStore's set sends without waiting for an answer: read it back on the same
        # connection, so the other node's read comes after it, not maybe before.
        assert bytes(server.get("meshrun.rdzv/job")) == b"\x00garbage"
        got = other.get_state()
        assert got is not None and pickle.loads(got[0]).round == 4
        assert "refused rendezvous state not signed" in said[-1]
    finally:
        forget_store(server)


class StateOps:
    """The store, counting the operations on the rendezvous state's key."""

    def __init__(self, store: Any, key: str = "meshrun.rdzv/job") -> None:
        self.store, self.key, self.ops = store, key, 0

    def __getattr__(self, op: str) -> Any:
        call = getattr(self.store, op)

        def counted(*args: Any) -> Any:
            first = args[0] if args else None
            self.ops += first == self.key or (isinstance(first, list) and self.key in first)
            return call(*args)

        return counted


@pytest.mark.timeout(60)
def test_a_read_and_a_lost_write_are_one_store_operation_each(store: Any) -> None:
    """Every node polls the state and most of a large join's writes lose: a check before each
    read and a second read after each lost write tripled a 64-node rendezvous's operations."""
    mine, theirs = StateOps(store), StateOps(store)
    backend = SignedBackend(mine, "job", SECRET, NONCE, say=lambda _: None)
    other = SignedBackend(theirs, "job", SECRET, NONCE, say=lambda _: None)
    first = backend.set_state(pickle.dumps(_state(1)))
    assert first is not None and first[2] is True
    theirs.ops = 0
    got = other.get_state()
    assert got is not None and pickle.loads(got[0]).round == 1 and theirs.ops == 1
    mine.ops = 0
    second = backend.set_state(pickle.dumps(_state(2)), first[1])
    assert second is not None and second[2] is True and mine.ops == 1
    theirs.ops = 0
    lost = other.set_state(pickle.dumps(_state(3)), first[1])  # a stale token: it loses
    assert lost is not None and lost[2] is False and _stored(lost[1]) == _stored(second[1])
    assert pickle.loads(lost[0]).round == 2 and theirs.ops == 1


@pytest.mark.timeout(60)
def test_a_poll_reads_the_state_only_once_the_log_holds_a_new_mark(store: Any) -> None:
    """Every waiting node polls about once a second: reading the whole state each time moved
    O(N) bytes a poll, O(N^2) a second through the store. A won write of the state appends a
    signed mark to the join log; a poll reads the log (one check when nothing is new) and the
    state only when a new mark came, or once per full-read interval: a mark deleted before
    anyone read it delays a node by that interval at most, and a stranger's value in a slot
    is not a mark (until 2026-12-07 the mark was a plain key read at every poll)."""
    ops = StateOps(store)
    slow = SignedBackend(ops, "job", SECRET, NONCE, full_read_every=timedelta(seconds=60))
    quick = SignedBackend(store, "job", SECRET, NONCE, full_read_every=timedelta(seconds=0.2))
    writer = SignedBackend(store, "job", SECRET, NONCE)
    first = writer.set_state(pickle.dumps(_state(1)))
    assert first is not None
    ops.ops = 0
    rounds = [pickle.loads(got[0]).round for got in [slow.get_state() for _ in range(4)] if got]
    assert rounds == [1, 1, 1, 1] and ops.ops == 1  # one read of the state, three of the log
    second = writer.set_state(pickle.dumps(_state(2)), first[1])
    assert second is not None and second[2] is True
    got = slow.get_state()
    assert got is not None and pickle.loads(got[0]).round == 2 and ops.ops == 2
    got = quick.get_state()
    assert got is not None and pickle.loads(got[0]).round == 2
    # A write whose mark is deleted before the nodes read it: seen by the next full read.
    third = writer.set_state(pickle.dumps(_state(3)), second[1])
    assert third is not None and third[2] is True
    mark_slot = writer._log.next - 1
    store.delete_key(f"meshrun.rdzv/job/log/{mark_slot}")
    got = slow.get_state()
    assert got is not None and pickle.loads(got[0]).round == 2  # within its 60 s
    time.sleep(0.25)
    got = quick.get_state()
    assert got is not None and pickle.loads(got[0]).round == 3  # past its 0.2 s: read in full
    # A stranger's value in the log's next slot: no mark, no read of the state; the next
    # write's mark comes after it.
    store.set(f"meshrun.rdzv/job/log/{mark_slot}", b"\x00garbage")
    got = slow.get_state()
    assert got is not None and pickle.loads(got[0]).round == 2 and ops.ops == 2
    fourth = writer.set_state(pickle.dumps(_state(4)), third[1])
    assert fourth is not None and fourth[2] is True
    got = slow.get_state()
    assert got is not None and pickle.loads(got[0]).round == 4 and ops.ops == 3


@pytest.mark.timeout(60)
def test_the_store_listens_on_the_address_given_only(store: Any) -> None:
    mine = [s for s in sockets.listeners(os.getpid()) if s.port == store.port]
    assert [s.address for s in mine] == ["127.0.0.1"], sockets.describe(set(mine))


# --- the handshake refuses what is not signed -----------------------------------------------


def _node(rank: int) -> NodeInfo:
    return NodeInfo(f"node{rank}", rank, 1, "t", "c", "n", "p", "m", "d", token=f"t{rank}")


def _run(
    store: Any,
    info: NodeInfo,
    is_host: bool,
    secret: JobSecret,
    said: list[str],
    out: dict[int, Any],
    timeout_s: float = 10,
) -> threading.Thread:
    hs = Handshake(store, "job", info, JoinTarget(2, 2), is_host, timeout_s, said.append, secret)

    def body() -> None:
        try:
            out[info.node_rank] = hs.run()
        except HandshakeError as err:
            out[info.node_rank] = err

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread


@pytest.mark.timeout(60)
def test_a_node_with_another_secret_is_refused_and_named_by_the_host(store: Any) -> None:
    said: dict[int, list[str]] = {0: [], 1: []}
    out: dict[int, Any] = {}
    client = TCPStore("127.0.0.1", store.port, is_master=False)
    host = _run(store, _node(0), True, SECRET, said[0], out, timeout_s=3)
    while not store.check(["meshrun/job/attempt"]):  # the host has drawn its attempt
        time.sleep(0.05)
    _run(client, _node(1), False, OTHER, said[1], out, timeout_s=3).join(30)
    host.join(30)
    assert isinstance(out[1], HandshakeError) and "not signed with this node's job secret" in str(
        out[1]
    )
    assert any("refused a handshake record from node1 (node_rank 1)" in s for s in said[0]), said
    assert isinstance(out[0], HandshakeError) and "give it the same secret" in str(out[0])


@pytest.mark.timeout(60)
def test_a_stranger_who_reads_the_attempt_cannot_stop_the_handshake(store: Any) -> None:
    """Whoever reaches the store's port can read the attempt token. Until 2026-12-07 the
    record counter was ``meshrun/<id>/<attempt>/count``: a stranger's non-number there failed
    every node's ``add`` and stopped the launch, and a stranger's value in the attempt key
    stopped a node that had not read it yet."""
    said: dict[int, list[str]] = {0: [], 1: []}
    out: dict[int, Any] = {}
    store.set("meshrun/job/attempt", b"0" * 64 + b" 0badc0de")  # before the host: junk
    client = TCPStore("127.0.0.1", store.port, is_master=False)
    node1 = _run(client, _node(1), False, SECRET, said[1], out, timeout_s=20)
    while not said[1]:  # node 1 has seen the junk, says so, and waits
        time.sleep(0.05)
    assert "not signed with this node's job secret" in said[1][0] and "waiting" in said[1][0]
    # The host starts: the plain attempt is readable by all; a stranger breaks its counter.
    host = _run(store, _node(0), True, SECRET, said[0], out, timeout_s=20)
    while store.get("meshrun/job/attempt").endswith(b"0badc0de"):
        time.sleep(0.01)
    token = SECRET.unseal("meshrun/job/attempt", store.get("meshrun/job/attempt"))
    store.set(f"meshrun/job/{token}/count", "not a number")
    store.set("meshrun/job/attempt", "stop")
    for thread in (host, node1):
        thread.join(30)
    for rank in (0, 1):
        assert [n.hostname for n in sorted(out[rank], key=lambda n: n.node_rank)] == [
            "node0",
            "node1",
        ], out[rank]


@pytest.mark.timeout(60)
def test_an_unsigned_error_is_ignored_and_a_signed_one_is_printed_clean(store: Any) -> None:
    said: list[str] = []
    out: dict[int, Any] = {}
    host = _run(store, _node(0), True, SECRET, said, out, timeout_s=20)
    while not store.check(["meshrun/job/attempt"]):  # the host has drawn its attempt
        time.sleep(0.05)
    token = SECRET.unseal("meshrun/job/attempt", store.get("meshrun/job/attempt"))
    assert token is not None
    # A stranger's (no MAC), where only the secret names the key: a node given the secret
    # but not this launch's, or a bug.
    store.set(f"{job_prefix(SECRET, 'job', token)}/error", "\x1b[2Jstop the job")
    client = TCPStore("127.0.0.1", store.port, is_master=False)
    _run(client, _node(1), False, SECRET, [], out).join(30)
    host.join(30)
    assert [n.hostname for n in sorted(out[0], key=lambda n: n.node_rank)] == ["node0", "node1"]
    assert any("refused the handshake's error" in s for s in said), said


@pytest.mark.timeout(60)
def test_a_signed_error_stops_the_nodes_and_is_printed_without_escapes(store: Any) -> None:
    out: dict[int, Any] = {}
    host = _run(store, _node(0), True, SECRET, [], out, timeout_s=20)
    while not store.check(["meshrun/job/attempt"]):  # the host has drawn its attempt
        time.sleep(0.05)
    token = SECRET.unseal("meshrun/job/attempt", store.get("meshrun/job/attempt"))
    assert token is not None
    key = f"{job_prefix(SECRET, 'job', token)}/error"
    store.set(key, SECRET.seal(key, "node2 says \x1b[2Jno"))
    host.join(30)
    assert isinstance(out[0], HandshakeError) and str(out[0]) == "node2 says ?[2Jno"


# --- the workers' store (rank 0 in meshrun.init) ---------------------------------------------


@pytest.mark.timeout(60)
def test_rank_0_hosts_the_workers_store_on_master_addr_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from datetime import timedelta

    from meshrun.runtime.ports import free_port
    from meshrun.train.startup import _worker_store

    for key, value in {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    worker = _worker_store(timedelta(seconds=5), spans_nodes=False)
    mine = [s for s in sockets.listeners(os.getpid()) if s.port == worker.port]
    assert [s.address for s in mine] == ["127.0.0.1"], sockets.describe(set(mine))
    # Across nodes, a MASTER_ADDR that resolves to loopback here is refused, named.
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    with pytest.raises(RuntimeError, match=r"MASTER_ADDR=localhost .*resolves to 127\.0\.0\.1"):
        _worker_store(timedelta(seconds=5), spans_nodes=True)
