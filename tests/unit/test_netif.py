"""Multi-node launch without processes: flag checks, the interface choice on this machine, the
torchrun argv it leads to, and the CLI's errors (each names the flag, the value, what is allowed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshrun.cli.main import main
from meshrun.config import Config, ConfigError, LaunchConfig
from meshrun.launch.agent.local import LaunchSpec, build_torchrun_args, network_flags, start_line
from meshrun.launch.multinode import netif
from meshrun.launch.multinode import nodes as multinode

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "ddp_minimal.py")


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


# --- flag syntax ---------------------------------------------------------------------------


def test_nnodes_and_endpoint_parse() -> None:
    assert multinode.parse_nnodes("2") == multinode.JoinTarget(2, 2)
    assert multinode.parse_nnodes("2:4").elastic
    assert multinode.parse_endpoint("10.0.0.1:29500") == ("10.0.0.1", 29500)
    assert multinode.parse_endpoint("head-node:1") == ("head-node", 1)
    assert multinode.parse_rdzv_conf("last_call_timeout=5, a=b") == {
        "last_call_timeout": "5",
        "a": "b",
    }


@pytest.mark.parametrize("text", ["0", "3:2", "two", "1:2:3", ""])
def test_bad_nnodes_names_the_flag_and_what_is_allowed(text: str) -> None:
    with pytest.raises(ConfigError, match=r"--nnodes / launch.nnodes = .* expected N or MIN:MAX"):
        multinode.parse_nnodes(text)


@pytest.mark.parametrize("text", ["10.0.0.1", "10.0.0.1:0", "10.0.0.1:70000", ":29500", "h:x"])
def test_bad_endpoint_names_the_flag_and_the_port_range(text: str) -> None:
    with pytest.raises(ConfigError, match=r"--rdzv-endpoint .* PORT in 1..65535"):
        multinode.parse_endpoint(text)


def _rdzv(
    nnodes: str, node_rank: int = 0, endpoint: str = "", rdzv_id: str = "job", conf: str = ""
) -> multinode.Rendezvous:
    launch = LaunchConfig(
        nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=endpoint, rdzv_id=rdzv_id, rdzv_conf=conf
    )
    return multinode.Rendezvous.of(launch)


def test_the_rendezvous_is_parsed_once_into_typed_values() -> None:
    rdzv = _rdzv("2:4", 1, "10.0.0.1:29500", conf="last_call_timeout=5, a=b")
    assert rdzv.nodes == multinode.JoinTarget(2, 4) and rdzv.endpoint == ("10.0.0.1", 29500)
    assert rdzv.conf == (("last_call_timeout", "5"), ("a", "b"))
    assert rdzv.endpoint_text == "10.0.0.1:29500" and rdzv.multinode
    assert not _rdzv("1").multinode and _rdzv("1:2", endpoint="10.0.0.1:1").multinode


def test_validate_checks_every_multinode_flag() -> None:
    multinode.validate(_rdzv("2", 1, "10.0.0.1:29500"))
    with pytest.raises(ConfigError, match=r"--node-rank / launch.node_rank = 2 .* expected 0..1"):
        multinode.validate(_rdzv("2", 2, "10.0.0.1:29500"))
    with pytest.raises(ConfigError, match="--nnodes 2 needs --rdzv-endpoint"):
        multinode.validate(_rdzv("2", 0, ""))
    with pytest.raises(ConfigError, match="--nnodes 2:3 needs --rdzv-endpoint"):
        multinode.validate(_rdzv("2:3", 0, ""))
    with pytest.raises(ConfigError, match=r"--rdzv-id / launch\.rdzv_id = 'a/b'"):
        multinode.validate(_rdzv("2", 0, "10.0.0.1:29500", "a/b"))
    with pytest.raises(ConfigError, match=r"--rdzv-conf / launch\.rdzv_conf = 'oops'"):
        multinode.validate(_rdzv("2", 0, "10.0.0.1:29500", conf="oops"))


def test_shared_digest_leaves_out_per_node_keys() -> None:
    a, b = Config(), Config()
    b.launch.node_rank, b.launch.interface, b.launch.join_timeout_s = 1, "eth1", 9.0
    assert multinode.shared_digest(a) == multinode.shared_digest(b)
    b.optim.lr = 1.0
    assert multinode.shared_digest(a) != multinode.shared_digest(b)
    settings = multinode.shared_settings(b)
    assert settings["optim.lr"] == 1.0 and "launch.node_rank" not in settings


# --- the CLI: errors before anything starts ------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--nnodes", "2"], "--nnodes 2 needs --rdzv-endpoint"),
        (["--nnodes", "2", "--rdzv-endpoint", "10.0.0.1:99999"], "PORT in 1..65535"),
        (["--nnodes", "2", "--rdzv-endpoint", "10.0.0.1:29500", "--node-rank", "5"], "0..1"),
        (["--nnodes", "x"], "--nnodes / launch.nnodes = 'x'"),
    ],
)
def test_cli_rejects_bad_multinode_flags(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    rc = main(["launch", *flags, "--set", f"job.run_dir={tmp_path}", EXAMPLE])
    assert rc == 2
    assert message in capsys.readouterr().err


# --- interface choice on this machine ------------------------------------------------------


def test_loopback_endpoint_uses_loopback_and_hosts_the_store() -> None:
    rdzv = _rdzv("2", 0, "127.0.0.1:29500", conf="last_call_timeout=5,join_timeout=9")
    plan = multinode.plan_network(rdzv, "", {"NCCL_SOCKET_IFNAME": "ib0"})
    assert plan.interface.is_loopback and plan.is_host
    assert plan.env == {"GLOO_SOCKET_IFNAME": plan.interface.name}  # the user's NCCL one kept
    argv = network_flags(plan, 60)
    assert _flag(argv, "--local-addr") == "127.0.0.1"
    assert _flag(argv, "--rdzv-conf") == "is_host=1,join_timeout=9,last_call_timeout=5"


def test_multi_host_job_never_gets_loopback() -> None:
    with pytest.raises(netif.NetworkError, match="cannot use the loopback interface"):
        netif.choose_interface("127.0.0.1", "lo", multi_host=True)


def test_unknown_interface_lists_the_real_ones() -> None:
    with pytest.raises(netif.NetworkError) as err:
        multinode.plan_network(_rdzv("2", 0, "127.0.0.1:29500"), "eth-nope", {})
    text = str(err.value)
    assert "--interface 'eth-nope' does not exist" in text and "lo (127.0.0.1/8)" in text


def test_torchrun_argv_and_banner_of_a_multinode_node() -> None:
    plan = multinode.NetworkPlan(
        interface=netif.Interface("eth-mr", "10.1.2.2", 24),
        rdzv_host="10.1.2.1",
        rdzv_address="10.1.2.1",
        rdzv_port=29500,
        is_host=False,
        env={"GLOO_SOCKET_IFNAME": "eth-mr", "NCCL_SOCKET_IFNAME": "eth-mr"},
        warnings=[],
    )
    launch = LaunchConfig(nnodes="2", rdzv_endpoint="10.1.2.1:29500", node_rank=1)
    spec = LaunchSpec.of(launch, procs_per_node=2, script="t.py")
    argv = build_torchrun_args(spec, port=0, network=plan)
    assert _flag(argv, "--rdzv-endpoint") == "10.1.2.1:29500"
    assert _flag(argv, "--local-addr") == "10.1.2.2"
    assert _flag(argv, "--rdzv-conf") == "is_host=0,join_timeout=300"
    assert "--node-rank" not in argv  # ignored by torchrun's c10d backend; ranks are the agent's
    line = start_line(spec, 0, "1", plan)
    assert "interface eth-mr (10.1.2.2/24), route to 10.1.2.1, this node joins" in line


def test_socket_env_never_overrides_the_user() -> None:
    iface = netif.Interface("eth0", "10.0.0.2", 24)
    assert netif.socket_env(iface, {"GLOO_SOCKET_IFNAME": "eth9"}) == {"NCCL_SOCKET_IFNAME": "eth0"}
