"""The launch spec: the ``[launch]`` text parsed once into typed values, and the torchrun argv
those values give (the same as when the spec was a LaunchConfig carrying the strings)."""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from meshrun.config import LaunchConfig, launch_values
from meshrun.launch.agent import local
from meshrun.launch.spec import LaunchSpec

PARSERS = ("nnodes_range", "parse_endpoint", "parse_rdzv_conf")
LOGS = os.path.join("runs/launch", "logs")


def _count_parses(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Wrap the ``[launch]`` parsers wherever meshrun holds them (their module and every module
    that imported the name), counting each call."""
    calls: Counter[str] = Counter()
    for name in PARSERS:
        original = getattr(launch_values, name)

        def counted(*args: Any, _f: Callable[..., Any] = original, _n: str = name) -> Any:
            calls[_n] += 1
            return _f(*args)

        for module in list(sys.modules.values()):
            if module.__name__.startswith("meshrun") and getattr(module, name, None) is original:
                monkeypatch.setattr(module, name, counted)
    return calls


def test_a_multinode_launch_parses_its_launch_text_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    launch = LaunchConfig(  # the config: checked (parsed) when made, as from a file
        nnodes="2", rdzv_endpoint="127.0.0.1:29500", rdzv_conf="last_call_timeout=5"
    )
    calls = _count_parses(monkeypatch)
    spec = LaunchSpec.of(launch, procs_per_node=2, script="t.py", run_dir=str(tmp_path))
    # What launch_local does before the agent starts: the checks and the network plan, the run
    # directory's lock, torchrun's argv and the banner.
    network = local._plan_network(spec, spec.rendezvous)
    assert network is not None and network.is_host  # loopback: this machine hosts the store
    with local._claim(spec, spec.rendezvous, network):
        argv = local.build_torchrun_args(spec, 0, network)
        local.start_line(spec, 0, "1", network)
    assert calls == Counter(dict.fromkeys(PARSERS, 1))
    assert argv[argv.index("--rdzv-conf") + 1] == "is_host=1,join_timeout=300,last_call_timeout=5"


def test_the_spec_keeps_the_configs_count_apart_from_its_own() -> None:
    launch = LaunchConfig()  # nproc_per_node = 0: auto, resolved by the command line
    assert LaunchSpec.of(launch, procs_per_node=3).procs_per_node == 3
    with pytest.raises(ValueError, match="nproc_per_node must be >= 1, got 0"):
        local.build_torchrun_args(LaunchSpec.of(launch, script="t.py"), port=1)


# torchrun's argv for a few configs, as meshrun built it before the spec was composed.
ARGV_CASES = {
    "one node": (
        {},
        {"script": "t.py", "script_args": ["--lr", "1"]},
        "--rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29513 --rdzv-id meshrun --nnodes 1 "
        f"--nproc-per-node 4 --max-restarts 0 --log-dir {LOGS} --tee 2 --local-addr 127.0.0.1 "
        "t.py --lr 1",
    ),
    "c10d with rdzv_conf": (
        {
            "nnodes": "2",
            "rdzv_endpoint": "127.0.0.1:29500",
            "rdzv_conf": "last_call_timeout=5, is_host=0",
            "join_timeout_s": 60.0,
        },
        {"script": "t.py"},
        "--rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29500 --rdzv-id meshrun --nnodes 2 "
        f"--nproc-per-node 4 --max-restarts 0 --log-dir {LOGS} --tee 2 --local-addr 127.0.0.1 "
        "--rdzv-conf is_host=0,join_timeout=60,last_call_timeout=5 t.py",
    ),
    "elastic c10d": (
        {"nnodes": "2:4", "rdzv_endpoint": "127.0.0.1:29501", "rdzv_conf": "a=b"},
        {"module": "pkg.train"},
        "--rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29501 --rdzv-id meshrun --nnodes 2:4 "
        f"--nproc-per-node 4 --max-restarts 0 --log-dir {LOGS} --tee 2 --local-addr 127.0.0.1 "
        "--rdzv-conf is_host=1,join_timeout=300,a=b -m pkg.train",
    ),
    "static": (
        {"nnodes": "2", "rdzv_endpoint": "10.0.0.1:29600", "node_rank": 1},
        {"script": "t.py", "rdzv_backend": "static"},
        "--rdzv-backend static --rdzv-endpoint 10.0.0.1:29600 --rdzv-id meshrun --nnodes 2 "
        f"--nproc-per-node 4 --max-restarts 0 --log-dir {LOGS} --tee 2 --node-rank 1 t.py",
    ),
}


@pytest.mark.parametrize("case", ARGV_CASES)
def test_typed_values_give_torchrun_the_argv_the_config_text_gave(case: str) -> None:
    keys, fields, expected = ARGV_CASES[case]
    spec = LaunchSpec.of(LaunchConfig(**keys), procs_per_node=4, **fields)
    rdzv = spec.rendezvous
    # One node and the static backend take no network plan; the loopback c10d ones do.
    network = local._plan_network(spec, rdzv) if fields.get("rdzv_backend") != "static" else None
    assert local.build_torchrun_args(spec, 29513, network) == expected.split()
