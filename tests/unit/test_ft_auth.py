"""Replica groups refuse strangers, below the job (docs/fault_tolerance.md, "Strangers"):

- the tagged replica ids (ft/auth.py): this job's verify, another key's, a stranger's and a
  tampered one do not, and the ids keep torchft's order and trailing digits;
- the quorum check on results shaped as torchft's: a stranger, a real id replayed with
  another store or heal address, or replayed as it was (its group then takes part twice);
- the heal transport (ft/transport.py) between two real HTTP servers on loopback: a state a
  step of AdamW made round-trips; a request without the secret gets 403; an answer not signed
  with it is refused unread; a signed answer that holds a pickle gadget is refused by
  ``weights_only=True`` and the gadget never runs; a step other than the quorum's is refused;
- the quorum client (ft/manager.py) against torchft's real lighthouse and manager servers: a
  stranger's request, heartbeating, lands in the first quorum; both groups refuse it and get
  the next one, of the two groups alone.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import os
import threading
import time
import urllib.request
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("torchft")

from meshrun.ft.auth import Member, parse_id, quorum_problem, replica_id
from meshrun.ft.manager import CheckedClient, bind_host, free_port
from meshrun.ft.transport import HealError, SignedTransport

KEY = b"k" * 64
OTHER = b"o" * 64
T = timedelta(seconds=10)


def _member(g: int) -> Member:
    return Member(g, f"http://127.0.0.1:{4000 + g}", f"127.0.0.1:{5000 + g}")


def test_ids_verify_with_the_job_key_only_and_keep_torchfts_order() -> None:
    from torchft.manager import extract_trailing_digits

    ids = [replica_id(KEY, _member(g)) for g in range(12)]
    for g, text in enumerate(ids):
        assert parse_id(KEY, f"{text}:0f3c-uuid") == _member(g)
        assert parse_id(OTHER, text) is None
        assert extract_trailing_digits(text) == g  # torchft's global ranks
        assert ":" not in text  # torchft splits ids on ':'
    assert sorted(ids) == ids  # participant g is group g
    forged = replica_id(OTHER, _member(0))
    assert parse_id(KEY, forged) is None
    swapped = ids[0].split(".")
    swapped[1] = replica_id(KEY, _member(1)).split(".")[1]  # another member's addresses
    assert parse_id(KEY, ".".join(swapped)) is None
    assert parse_id(KEY, "stranger_0") is None


def _result(ids: list[str], **more: Any) -> SimpleNamespace:
    base = {
        "quorum_id": 3,
        "store_address": "127.0.0.1:5000",
        "heal": False,
        "recover_src_replica_rank": None,
        "recover_src_manager_address": "",
    }
    return SimpleNamespace(replica_ids=ids, **{**base, **more})


def test_the_quorum_check_names_a_stranger_and_replayed_addresses() -> None:
    ids = [replica_id(KEY, _member(g)) + ":uuid" for g in range(2)]
    assert quorum_problem(KEY, _result(ids)) == ""
    heal = {"heal": True, "recover_src_replica_rank": 1}
    good = _result(ids, recover_src_manager_address="http://127.0.0.1:4001", **heal)
    assert quorum_problem(KEY, good) == ""
    stranger = quorum_problem(KEY, _result([*ids, "stranger_0\x1b[31m"]))
    assert stranger == "participant 'stranger_0?[31m' carries no valid tag of this job"
    # A real id replayed by a stranger with its own addresses: torchft hands over the
    # stranger's store or manager address under the real id.
    assert "store" in quorum_problem(KEY, _result(ids, store_address="10.9.9.9:1"))
    lie = _result(ids, recover_src_manager_address="http://10.9.9.9:1", **heal)
    assert "not the one group 1 signed" in quorum_problem(KEY, lie)
    # A real id recorded and replayed as it was (with a forged step, which the id does not
    # carry): the group takes part twice, and the quorum is refused whatever its max_step.
    replay = _result([*ids, replica_id(KEY, _member(1)) + ":other-uuid"], max_step=100000)
    assert quorum_problem(KEY, replay) == "group 1 takes part twice (a replay of its id)"


def _train_state() -> dict[str, Any]:
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)
    return {
        "user": {
            "default": {
                "source": "group 0",
                "step": 7,
                "models": [model.state_dict()],
                "optimizer": opt.state_dict(),
                "schedulers": [sched.state_dict()],
                "scaler": None,
                "sampler": {"consumed": 112, "epoch": 0},
            }
        },
        "torchft": {"step": 7, "batches_committed": 14},
    }


@pytest.fixture
def pair() -> Any:
    sender, receiver = SignedTransport(KEY, "127.0.0.1", T), SignedTransport(KEY, "127.0.0.1", T)
    yield sender, receiver
    sender.shutdown()
    receiver.shutdown()


def test_a_heal_round_trips_without_pickle(pair: Any) -> None:
    sender, receiver = pair
    state = _train_state()
    sender.send_checkpoint([1], 7, state, T)
    got = receiver.recv_checkpoint(0, sender.metadata(), 7, T)
    assert got["torchft"] == state["torchft"]
    assert (
        got["user"]["default"]["optimizer"]["param_groups"]
        == state["user"]["default"]["optimizer"]["param_groups"]
    )
    for key, tensor in state["user"]["default"]["models"][0].items():
        assert torch.equal(got["user"]["default"]["models"][0][key], tensor)
    assert sender.metadata().startswith("http://127.0.0.1:")
    # Another job's transport: its request is refused, and the state is not served to it.
    stranger = SignedTransport(OTHER, "127.0.0.1", T)
    try:
        with pytest.raises(HealError, match="answered 403"):
            stranger.recv_checkpoint(0, sender.metadata(), 7, T)
    finally:
        stranger.shutdown()
    with pytest.raises(HealError, match="the peer sent step 7, the quorum said 8"):
        sender.send_checkpoint([1], 8, state, T)  # served as step 8, holding step 7
        receiver.recv_checkpoint(0, sender.metadata(), 8, T)


class _Gadget:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (os.mkdir, (self.path,))


def _fake_peer(body: bytes, signature: str) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            if signature:
                self.send_header("X-Meshrun-Mac", signature)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.parametrize("signed", [False, True])
def test_a_crafted_heal_answer_runs_nothing(tmp_path: Path, signed: bool) -> None:
    marker = tmp_path / "ran"
    buf = io.BytesIO()
    torch.save({"torchft": {"step": 7}, "user": _Gadget(str(marker))}, buf)
    body = buf.getvalue()
    # Signed: a peer holding the secret (or a bug) cannot run code either: weights_only.
    mac = hmac.new(KEY, b"meshrun-ft-heal-state\0" + b"7\0" + body, hashlib.sha256).hexdigest()
    server = _fake_peer(body, mac if signed else "")
    receiver = SignedTransport(KEY, "127.0.0.1", T)
    try:
        address = f"http://127.0.0.1:{server.server_address[1]}/checkpoint/"
        with pytest.raises(Exception) as err:
            receiver.recv_checkpoint(0, address, 7, T)
        if signed:
            assert isinstance(err.value, HealError) and "weights_only=True refuses" in str(
                err.value
            )
            assert "Weights only load failed" in str(err.value.__cause__)
        else:
            assert isinstance(err.value, HealError) and "not signed" in str(err.value)
        assert not marker.exists()
    finally:
        server.shutdown()
        receiver.shutdown()


@pytest.mark.timeout(120)
def test_groups_refuse_the_quorum_a_stranger_entered_and_get_one_without_it() -> None:
    from torchft._torchft import LighthouseClient, LighthouseServer, ManagerServer

    lighthouse = LighthouseServer(
        bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=500, heartbeat_timeout_ms=1000
    )
    address = f"http://127.0.0.1:{lighthouse.address().rsplit(':', 1)[1]}"
    members = [
        Member(g, f"http://127.0.0.1:{free_port('127.0.0.1')}", f"127.0.0.1:{5000 + g}")
        for g in range(2)
    ]
    servers = [
        ManagerServer(
            replica_id=f"{replica_id(KEY, m)}:uuid{m.group}",
            lighthouse_addr=address,
            hostname="127.0.0.1",
            bind=m.manager.removeprefix("http://"),
            store_addr=m.store,
            world_size=1,
            heartbeat_interval=timedelta(milliseconds=100),
            connect_timeout=T,
            quorum_retries=0,
        )
        for m in members
    ]
    stranger = LighthouseClient(address, connect_timeout=T)
    seen: dict[Any, Any] = {}
    answered = threading.Event()

    def ask_as_stranger() -> None:
        seen["stranger"] = stranger.quorum(
            replica_id="stranger_0",
            timeout=T,
            step=100000,
            address="http://127.0.0.1:1",
            world_size=1,
            store_address="127.0.0.1:1",
            shrink_only=False,
        )
        answered.set()

    def beat() -> None:  # a live stranger heartbeats until it is answered
        while not answered.wait(0.1):
            stranger.heartbeat("stranger_0")

    threading.Thread(target=ask_as_stranger, daemon=True).start()
    threading.Thread(target=beat, daemon=True).start()
    while b"[1/1 participants healthy]" not in urllib.request.urlopen(f"{address}/status").read():
        time.sleep(0.05)  # until the lighthouse holds the stranger's request
    threads = [threading.Thread(target=_ask, args=(s, g, seen)) for g, s in enumerate(servers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert "stranger_0" in [p.replica_id for p in seen["stranger"].participants]
        for g in range(2):
            result, refused = seen[g]
            assert refused and "'stranger_0' carries no valid tag" in refused[0], refused
            assert len(result.replica_ids) == 2 and not result.heal
            assert [parse_id(KEY, i) for i in result.replica_ids] == members
    finally:
        for server in servers:
            server.shutdown()
        lighthouse.shutdown()


def _ask(server: Any, g: int, seen: dict[Any, Any]) -> None:
    from torchft._torchft import ManagerClient

    refused: list[str] = []
    client = CheckedClient(ManagerClient(server.address(), connect_timeout=T), KEY, refused)
    result = client._quorum(
        group_rank=0,
        step=5,
        checkpoint_metadata="",
        shrink_only=False,
        timeout=timedelta(seconds=30),
        init_sync=False,
        commit_failures=0,
    )
    seen[g] = (result, refused)


def test_servers_bind_loopback_for_one_node_and_the_route_toward_the_lighthouse_else() -> None:
    from meshrun.launch.multinode.netif import list_interfaces

    assert bind_host("127.0.0.1:29510") == bind_host("localhost:29510") == "127.0.0.1"
    others = [i.address for i in list_interfaces() if not i.is_loopback]
    if not others:
        pytest.skip("this host has no interface but loopback")
    # A lighthouse on another interface's address: the servers listen there, on it only.
    assert bind_host(f"{others[0]}:29510") == others[0]
    transport = SignedTransport(KEY, others[0], T)
    try:
        assert transport._server.server_address[0] == others[0]
        assert transport.metadata().startswith(f"http://{others[0]}:")
    finally:
        transport.shutdown()
