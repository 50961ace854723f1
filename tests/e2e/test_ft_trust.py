"""A replica-group job refuses strangers (docs/fault_tolerance.md, "Strangers"): a real
`meshrun launch --replica-groups 2` (its own lighthouse, real torchrun agents and Gloo
workers), and from this test, while the groups wait before step PAUSE's quorum (a file says
so; no timing window), one quorum request to the job's lighthouse through torchft's own
``LighthouseClient``, as the stranger of issue 26 sent it: ``replica_id="stranger_0"``,
``step=100000``, its own addresses, heartbeating until its request is answered.

At 210a125 the lighthouse put it in a quorum with the real groups; they tried to heal from it
and to join its store, stalled 60 s, and group 1 died. Now each group sees the stranger's id
carries no tag of this job, refuses that quorum (an ``ft_refused`` event and one warning line
naming it), asks again, and both groups train every step with the losses, bit for bit, of
the same job without a stranger. While the groups wait, every listening socket of the job's
processes is listed: none is bound to every interface. The same holds for two groups on two
network-namespace hosts (each socket on loopback or its host's address).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from test_ft import FT_KEYS, KEYS, WORKER, _losses, _rows

import sockets

pytestmark = pytest.mark.slow
STEPS = 12
PAUSE = 5


def _command(run_dir: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "meshrun",
        "launch",
        "--nproc-per-node",
        "2",
        "--replica-groups",
        "2",
        str(WORKER),
        f"--job.run_dir={run_dir}",
        f"--optim.steps={STEPS}",
        *KEYS,
        *FT_KEYS,
    ]


def _env(**more: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", **more}


def _wait_for(what: str, ready: Any, proc: subprocess.Popen[bytes], log: Path) -> Any:
    deadline = time.monotonic() + 300
    while not (found := ready()):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(
                f"{what}: never came (launch rc {proc.poll()})\n" + log.read_text()[-3000:]
            )
        time.sleep(0.1)
    return found


class Stranger:
    """One quorum request to the lighthouse, heartbeating (as a live replica does) until it
    is answered; ``quorum`` is the answer."""

    def __init__(self, lighthouse: str) -> None:
        from torchft._torchft import LighthouseClient

        self.client = LighthouseClient(lighthouse, connect_timeout=timedelta(seconds=10))
        self.quorum: Any = None
        self.error: BaseException | None = None
        self.answered = threading.Event()
        threading.Thread(target=self._ask, daemon=True).start()
        threading.Thread(target=self._beat, daemon=True).start()

    def _ask(self) -> None:
        try:
            self.quorum = self.client.quorum(
                replica_id="stranger_0",
                timeout=timedelta(seconds=200),
                address="http://127.0.0.1:1",
                store_address="127.0.0.1:1",
                step=100000,
                world_size=1,
                shrink_only=False,
            )
        except BaseException as err:  # the test reports it
            self.error = err
        self.answered.set()

    def _beat(self) -> None:
        while not self.answered.wait(0.1):
            self.client.heartbeat("stranger_0")


def _lighthouse(log: Path) -> str | None:
    found = re.search(r"lighthouse on (127\.0\.0\.1:\d+)", log.read_text())
    return f"http://{found.group(1)}" if found else None


def _stranger_waits(lighthouse: str) -> bool:
    """The lighthouse holds the stranger's request as its one participant (the groups,
    paused, have not asked yet)."""
    page = urllib.request.urlopen(f"{lighthouse}/status", timeout=10).read().decode()
    return "[1/1 participants healthy]" in page


@pytest.mark.timeout(900)
def test_a_stranger_quorum_request_is_refused_and_both_groups_train_to_the_end(
    tmp_path: Path,
) -> None:
    plain = subprocess.run(
        _command(tmp_path / "plain"),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert plain.returncode == 0, plain.stderr[-3000:]

    run_dir, log = tmp_path / "attacked", tmp_path / "attacked.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            _command(run_dir),
            env=_env(FT_PAUSE_AT=str(PAUSE)),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        with sockets.Watch(proc.pid, every_s=0.5) as watch:
            lighthouse = _wait_for("the lighthouse line", lambda: _lighthouse(log), proc, log)
            for g in (0, 1):
                _wait_for(
                    f"group {g} paused", (run_dir / f"group{g}" / "paused.rank0").exists, proc, log
                )
            watch.seen |= sockets.listeners(proc.pid)  # every server is up while they wait
            stranger = Stranger(lighthouse)
            _wait_for("the stranger's request held", lambda: _stranger_waits(lighthouse), proc, log)
            (run_dir / "go").write_text("1")
            assert proc.wait(timeout=400) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()

    assert stranger.answered.wait(30) and stranger.error is None, stranger.error
    ids = [p.replica_id for p in stranger.quorum.participants]
    print("the stranger's quorum:", ids)
    assert "stranger_0" in ids and any(i.startswith("meshrun_group_") for i in ids)
    refused = [e for g in (0, 1) for e in _events(run_dir / f"group{g}", "ft_refused")]
    print("refused:", refused)
    assert refused and all("'stranger_0'" in str(e["reason"]) for e in refused)
    assert all(int(e["step"]) == PAUSE for e in refused)
    assert "carries no valid tag of this job; asking again" in log.read_text()
    for g in (0, 1):
        attacked, clean = _losses(run_dir / f"group{g}"), _losses(tmp_path / "plain" / f"group{g}")
        assert sorted(attacked) == list(range(1, STEPS + 1))
        assert attacked == clean, (attacked, clean)  # bit for bit: the same steps, the same data
        checksum = json.loads((run_dir / f"group{g}" / "checksum.rank0.json").read_text())
        assert checksum["step"] == STEPS
    print(sockets.describe(watch.seen))
    # The lighthouse (the launcher); per group its agent's store, and in its worker the
    # worker store, the manager server, the heal server and Gloo's listeners.
    assert len({s.port for s in watch.seen}) >= 11, sockets.describe(watch.seen)
    assert not sockets.wildcard(watch.seen), sockets.describe(watch.seen)
    assert {s.address for s in watch.seen} == {"127.0.0.1"}, sockets.describe(watch.seen)


def _events(run_dir: Path, name: str) -> list[dict[str, object]]:
    return [r for r in _rows(run_dir / "metrics.jsonl") if r.get("event") == name]


@pytest.mark.timeout(600)
def test_groups_on_two_hosts_listen_on_their_address_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two namespace hosts, one group each (`meshrun launch --nnodes 1 --rdzv-endpoint` its
    own address), the lighthouse on host 0 (`meshrun lighthouse --bind` its address), one
    secret: both groups train every step, and every socket listens on loopback or the host's
    address, none on every interface."""
    from test_multinode import nodes

    import netns

    netns.require()
    monkeypatch.setenv("MESHRUN_JOB_SECRET", "0123456789abcdef" * 4)
    with nodes(2) as cluster:
        lighthouse = f"{cluster.net.address(0)}:29510"
        keeper = subprocess.Popen(
            cluster.net.argv(
                0,
                [
                    sys.executable,
                    "-m",
                    "meshrun",
                    "lighthouse",
                    "--bind",
                    lighthouse,
                    "--heartbeat-timeout-ms",
                    "1000",
                    "--join-timeout-ms",
                    "1000",
                ],
            ),
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        watches = {"lighthouse": sockets.Watch(keeper.pid, every_s=0.5).__enter__()}
        for g in (0, 1):
            endpoint = f"{cluster.net.address(g)}:29500"
            cluster.start(
                g,
                "--nnodes",
                "1",
                "--node-rank",
                "0",
                "--rdzv-endpoint",
                endpoint,
                "--nproc-per-node",
                "1",
                str(WORKER),
                f"--job.run_dir={tmp_path / f'group{g}'}",
                f"--optim.steps={STEPS}",
                *KEYS,
                *FT_KEYS,
                "--fault_tolerance.replica_groups=2",
                f"--fault_tolerance.group_index={g}",
                f"--fault_tolerance.lighthouse={lighthouse}",
            )
            watches[g] = sockets.Watch(cluster.procs[g].pid, every_s=0.5).__enter__()
        outs = [cluster.wait(g, 400) for g in (0, 1)]
        keeper.terminate()
        keeper.wait(30)
        for watch in watches.values():
            watch.__exit__()
        addresses = {g: cluster.net.address(g) for g in (0, 1)}
    for rc, out in outs:
        assert rc == 0, out[-4000:]
    for g in (0, 1):
        assert sorted(_losses(tmp_path / f"group{g}")) == list(range(1, STEPS + 1))
    for name, watch in watches.items():
        print(f"{name}:\n{sockets.describe(watch.seen)}")
        assert not sockets.wildcard(watch.seen), sockets.describe(watch.seen)
        host = addresses[0 if name == "lighthouse" else int(name)]
        assert {s.address for s in watch.seen} <= {host, "127.0.0.1"}, sockets.describe(watch.seen)
    # The manager and heal servers listen on the host's address (the route to the lighthouse).
    assert sum(s.address == addresses[1] for s in watches[1].seen) >= 2
