"""``meshrun bench`` across nodes, without processes: the multi-node flags become the same
``[launch]`` keys ``meshrun launch`` makes (and get its checks), and a run across nodes lands
in the calibration file as the inter-node rate, beside one node's run."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from meshrun.cli.diagnose import _bench_config, _bench_spec
from meshrun.cli.main import build_parser
from meshrun.config import ConfigError
from meshrun.diagnose.bench_request import BenchRequest
from meshrun.diagnose.calibration import (
    inter_lines,
    inter_record,
    sustained_bw,
    write_calibration,
)

CPU = SimpleNamespace(type="cpu")


def _args(*flags: str) -> object:
    return build_parser("bench").parse_args(["bench", "comm", *flags])


def test_multinode_flags_become_launch_keys_checked_as_in_launch(tmp_path: Path) -> None:
    a = _args(
        *("--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "10.0.0.1:29500"),
        *("--interface", "eth1", "--join-timeout", "30", "--run-dir", str(tmp_path)),
    )
    cfg, nodes = _bench_config(a, 2)
    ln = cfg.launch
    assert (nodes, ln.nnodes, ln.node_rank, ln.rdzv_endpoint) == (2, "2", 1, "10.0.0.1:29500")
    assert (ln.interface, ln.join_timeout_s) == ("eth1", 30.0)
    assert cfg.data.global_batch == 4  # one sample per process of the whole world
    spec = _bench_spec(cfg, 2, BenchRequest(out="c.json", nodes=nodes), str(tmp_path))
    assert spec.rendezvous.nodes.text == "2" and spec.procs_per_node == 2 and spec.config_digest
    assert json.loads(spec.script_args[0])["nodes"] == 2
    # launch's own refusals, naming its flags
    with pytest.raises(ConfigError, match="needs --rdzv-endpoint"):
        _bench_config(_args("--nnodes", "2"), 1)
    with pytest.raises(ConfigError, match="--node-rank"):
        _bench_config(_args("--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"), 1)
    with pytest.raises(ConfigError, match="one world"):
        _bench_config(_args("--nnodes", "1:2", "--rdzv-endpoint", "h:1"), 1)


def _row(op: str, size: int, seconds: float) -> dict[str, object]:
    return {"op": op, "bytes": size, "time_s": seconds, "algbw": size / seconds, "busbw": 0.0}


# Measured over a 100 Mb/s tbf link (2 ranks): small messages pass from the bucket, faster
# than the line through the large ones.
SHAPED = [
    _row("all_reduce", 4096, 1622e-6),
    _row("all_reduce", 16384, 2044e-6),
    _row("all_reduce", 65536, 5373e-6),
    _row("all_reduce", 262144, 21950e-6),
    _row("all_reduce", 1048576, 88700e-6),
    _row("all_reduce", 4194304, 341442e-6),
    _row("all_gather", 1048576, 55694e-6),
    _row("all_gather", 4194304, 260776e-6),
]
for _r in SHAPED:
    _r["busbw"] = _r["bytes"] / _r["time_s"]


def test_the_sustained_rate_is_the_link_not_the_bucket() -> None:
    # (4 MiB - 256 KiB) / (341.4 ms - 22.0 ms) = 98.5 Mb/s; 2 ranks: bus factor 1.
    assert sustained_bw(SHAPED, 2) * 8 == pytest.approx(98.46e6, rel=1e-3)
    one = [_row("all_reduce", 2**20, 0.1)]
    one[0]["busbw"] = 7.0
    assert sustained_bw(one, 2) == 7.0  # one size: its measured bus bandwidth


def test_a_run_across_nodes_sets_the_inter_rate_and_keeps_one_nodes_intra(
    tmp_path: Path,
) -> None:
    out = tmp_path / "c.json"
    intra = [_row("all_reduce", 2**20, 1e-3), _row("all_reduce", 2**22, 4e-3)]
    for r in intra:
        r["busbw"] = r["bytes"] / r["time_s"]
    write_calibration(str(out), {"comm": intra}, 2, CPU)
    record = inter_record(SHAPED, 2, 2)
    write_calibration(str(out), {"comm_inter": record}, 2, CPU, nodes=2)
    doc = json.loads(out.read_text())
    assert doc["source"] == "meshrun bench on 2 cpu processes on 2 nodes"
    assert doc["cluster"]["inter_bw"] * 8 == pytest.approx(98.46e6, rel=1e-3)
    assert doc["cluster"]["intra_bw"] == pytest.approx(2**20 / 1e-3)  # one node's, kept
    assert set(doc["measured"]) == {"comm", "comm_inter"}
    (line,) = inter_lines(record)
    assert line.startswith("inter-node link (2 nodes, 2 processes): all_reduce bus bandwidth 98.5")
