"""Replica groups on two network-namespace hosts listen on their address only
(docs/security.md): one group per host, each `meshrun launch --nnodes 1 --rdzv-endpoint` its own
address, the lighthouse on host 0 (`meshrun lighthouse --bind` its address), one job secret.
Both groups train every step and every listening socket of every process is on loopback or its
host's address, none bound to every interface. The same job on one host refusing a stranger's
quorum request, its sockets all on loopback, is tests/e2e/test_ft.py's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_ft import FT_KEYS, KEYS, WORKER, _losses

import sockets

pytestmark = pytest.mark.slow
STEPS = 12


def _env(**more: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", **more}


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
