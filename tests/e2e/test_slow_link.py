"""``meshrun bench comm`` across two hosts joined by a slow link: network namespaces as the
hosts (tests/netns.py), their link shaped to 100 Mb/s (and 1 Gb/s, heavy) with ``tc tbf`` at
MTU 9000, one real ``meshrun bench comm --nnodes 2`` per namespace (torchrun agent, c10d
rendezvous, Gloo).

The bandwidth it reports must be the one the throttle set, within -25% / +10% (why: at the
assert); tbf counts whole Ethernet frames, so TCP payload can reach (9000 - 52) / (9000 + 14)
= 99.3% of the rate (the ACKs of the other direction take a little more); anything far
below would say the bench measured something else than the link (latency, the fit, one
rank's own time). Needs root, iproute2 and tbf in the kernel (skips with the reason
otherwise).

1 Gb/s is within this 2-core machine's reach through a veth: plain TCP between the two hosts
moved 961-975 Mb/s over the 1 Gb/s tbf (6.6-8.4 Gb/s unshaped) at a load average of 9, and
``bench comm`` reported 935.4, 964.8 and 1002.0 Mb/s in three runs (2026-12-04; above 99.3 %
is the bucket passing the small messages at line rate). It costs ~23 s of which the link is
a fraction (two torchrun agents start): under MESHRUN_HEAVY_TESTS, the 100 Mb/s case shows
the same code path in CI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import netns

# alone: a rate measurement; `make test` runs it after the rest of the suite (Makefile).
pytestmark = [pytest.mark.slow, pytest.mark.alone]
PORT = 29541
RATES = [100_000_000, pytest.param(1_000_000_000, marks=pytest.mark.heavy, id="1000000000")]


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "100"}
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        env.pop(var, None)  # meshrun chooses the veth from the route to the endpoint
    return env


def _bench(net: netns.Hosts, i: int, tmp: Path) -> subprocess.Popen[str]:
    argv = [
        *(sys.executable, "-m", "meshrun", "bench", "comm"),
        *("--nnodes", "2", "--node-rank", str(i), "--nproc-per-node", "1"),
        *("--rdzv-endpoint", f"{net.address(0)}:{PORT}", "--join-timeout", "90"),
        *("--max-mb", "8", "--seconds", "0.3"),
        *("--out", str(tmp / "calibration.json"), "--run-dir", str(tmp / "bench")),
    ]
    return subprocess.Popen(
        net.argv(i, argv),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(),
        start_new_session=True,
    )


@pytest.mark.timeout(240)
@pytest.mark.parametrize("rate_bit", RATES)
def test_bench_comm_across_hosts_reports_the_throttled_rate(tmp_path: Path, rate_bit: int) -> None:
    with netns.hosts(2) as net:
        net.throttle(rate_bit, mtu=9000)
        procs = [_bench(net, i, tmp_path) for i in (1, 0)]  # the joining node first
        outs = []
        for proc in procs:
            out, _ = proc.communicate(timeout=200)
            outs.append((proc.returncode, out))
        drops = net.drops()
    for rc, out in outs:
        assert rc == 0, out[-4000:]
    host_out = outs[1][1]
    line = next((x for x in host_out.splitlines() if "inter-node link" in x), host_out[-3000:])
    assert "inter-node link (2 nodes, 2 processes)" in line, line
    print(line)
    doc = json.loads((tmp_path / "calibration.json").read_text())
    assert doc["source"].endswith("on 2 nodes")
    assert "comm_inter" in doc["measured"] and "comm" not in doc["measured"]
    bw_bit = doc["cluster"]["inter_bw"] * 8
    print(
        f"tbf {rate_bit / 1e6:.0f} Mb/s: bench comm reports {bw_bit / 1e6:.1f} Mb/s; drops {drops}"
    )
    # -25% / +10%: the figure moves with the machine (86.9-97.7 Mb/s in four runs alone here,
    # no packet dropped; 86.4 on CI's machine alone), while what this test must tell apart is
    # far off that band: the unshaped link is 66-84x faster, and a wrong bus factor or a
    # latency-bound fit is 2x off or more.
    assert 0.75 <= bw_bit / rate_bit <= 1.10, (bw_bit, drops)
    # The plan reads it as the inter-node link: the planner's slow-link table gets it from here.
    assert "intra_bw" not in doc["cluster"]
