"""The hostfile parser and the command lines ``meshrun launch --hostfile`` builds (pure)."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

import pytest

from meshrun.cli.main import build_parser, launch_request
from meshrun.config import Config, load_config
from meshrun.launch.hostfile.hosts import (
    HostEntry,
    HostfileError,
    HostfilePlan,
    parse_hostfile,
    parse_hostfile_text,
)
from meshrun.launch.hostfile.plan import (
    forwarded_env,
    plan_from_request,
    ssh_options,
)
from meshrun.launch.hostfile.remote import (
    GUARD_MODULE,
    READ_SECRET,
    node_argv,
    remote_command,
    ssh_argv,
)

pytestmark = pytest.mark.timeout(30)


# --- the hostfile ------------------------------------------------------------------------


def test_hosts_users_ports_slots_comments_and_blank_lines() -> None:
    text = """
# the cluster
node-a                     # defaults
alice@node-b:2222 slots=4

10.0.0.7 slots=2
"""
    hosts = parse_hostfile_text(text, "hosts.txt")
    assert hosts == [
        HostEntry("node-a", line=3),
        HostEntry("node-b", "alice", 2222, 4, line=4),
        HostEntry("10.0.0.7", slots=2, line=6),
    ]
    assert [h.destination for h in hosts] == ["node-a", "alice@node-b", "10.0.0.7"]
    assert [h.label for h in hosts] == ["node-a", "node-b:2222", "10.0.0.7"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a\nb slots=0\n", "hosts.txt:2: slots='0' must be a whole number >= 1"),
        ("a\n\nb slots=x\n", "hosts.txt:3: slots='x' must be a whole number >= 1"),
        ("a gpus=2\n", "hosts.txt:1: unknown field 'gpus=2'; the only field is slots=N"),
        ("a:99999\n", "hosts.txt:1: ssh port 99999 is not in 1..65535"),
        ("a\nb@c@d\n", "hosts.txt:2: 'b@c@d' is not a host"),
        ("a\n# x\na\n", "hosts.txt:3: host 'a' is already listed on line 1"),
        ("# only comments\n\n", "hosts.txt: no hosts"),
    ],
)
def test_errors_name_the_file_the_line_and_the_problem(text: str, message: str) -> None:
    with pytest.raises(HostfileError) as err:
        parse_hostfile_text(text, "hosts.txt")
    assert message in str(err.value)


def test_the_same_host_on_two_ssh_ports_is_two_hosts() -> None:
    hosts = parse_hostfile_text("box:2201\nbox:2202\n")
    assert [h.label for h in hosts] == ["box:2201", "box:2202"]


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(HostfileError, match=r"--hostfile '.*nope.txt' cannot be read"):
        parse_hostfile(tmp_path / "nope.txt")


# --- ssh and the remote command ------------------------------------------------------------


def _plan(**kw: object) -> HostfilePlan:
    base: dict[str, object] = dict(
        hosts=[HostEntry("node-a", line=1), HostEntry("node-b", "bob", 2222, line=2)],
        nproc_per_node=2,
        launch_args=["-m", "meshrun.demo", "--size", "tiny"],
        cwd="/shared/my project",
        python="/opt/venv/bin/python",
        rdzv_id="job-1",
    )
    base.update(kw)
    return HostfilePlan(**base)  # type: ignore[arg-type]


def test_ssh_argv_batch_mode_timeout_port_user_and_user_options_first() -> None:
    entry = HostEntry("node-b", "bob", 2222)
    opts = ssh_options(["IdentityFile=/k/id", "ConnectTimeout=2"], {"MESHRUN_SSH": "-F '/my cfg'"})
    assert opts == ["-o", "IdentityFile=/k/id", "-o", "ConnectTimeout=2", "-F", "/my cfg"]
    argv = ssh_argv(entry, opts, "true")
    assert argv[0] == "ssh" and argv[-2:] == ["bob@node-b", "true"]
    assert argv[1:7] == opts  # ssh keeps the first value: the user's ConnectTimeout wins
    assert argv[7:11] == ["-o", "BatchMode=yes", "-o", "ConnectTimeout=5"]
    assert argv[11:13] == ["-p", "2222"]
    assert "-tt" not in argv and "StrictHostKeyChecking" not in " ".join(argv)


@pytest.mark.parametrize("bad", ["-i", "IdentityFile", "-o=x"])
def test_ssh_opt_must_be_key_value(bad: str) -> None:
    with pytest.raises(HostfileError, match=f"--ssh-opt '{bad}': expected an ssh option"):
        ssh_options([bad], {})


def test_node_argv_gives_each_host_its_rank_and_the_first_host_as_endpoint() -> None:
    plan = _plan()
    for rank in (0, 1):
        argv = node_argv(plan, rank)
        assert argv[:4] == ["/opt/venv/bin/python", "-m", "meshrun", "launch"]
        flags = dict(zip(argv[4:14:2], argv[5:14:2], strict=True))
        assert flags == {
            "--nnodes": "2",
            "--node-rank": str(rank),
            "--rdzv-endpoint": "node-a:29500",
            "--rdzv-id": "job-1",
            "--nproc-per-node": "2",
        }
        assert argv[14:] == ["-m", "meshrun.demo", "--size", "tiny"]
    assert "--nproc-per-node" not in node_argv(_plan(nproc_per_node=None), 0)
    assert "10.1.1.1:7000" in node_argv(_plan(rdzv_endpoint="10.1.1.1:7000"), 1)


def test_remote_command_quotes_everything_and_round_trips() -> None:
    nasty = ["--note", 'it\'s $HOME; rm -rf / `x` "q"', "--data.path=/a b/c"]
    plan = _plan(launch_args=["train.py", *nasty], env={"NCCL_DEBUG": "INFO", "X_Y": "a b"})
    command = remote_command(plan, 1)
    assert command.startswith("cd '/shared/my project' && exec sh -c ")
    words = shlex.split(command.split(" && ", 1)[1])
    guard = ["/opt/venv/bin/python", "-m", GUARD_MODULE, "--"]
    reader = ["exec", "sh", "-c", READ_SECRET, "sh"]  # the secret comes over stdin
    assert words == [*reader, "env", "NCCL_DEBUG=INFO", "X_Y=a b", *guard, *node_argv(plan, 1)]
    assert words[-3:] == nasty


def test_forwarded_env_takes_what_configures_the_job_and_no_secrets() -> None:
    environ = {
        "MESHRUN_CHECKPOINT_DIR": "/ckpt",
        "MESHRUN_API_TOKEN": "t",
        "MESHRUN_SSH": "-i k",  # the launcher's own
        "MESHRUN_CONFIG": "/old/config.toml",  # each host writes its own
        "NCCL_DEBUG": "INFO",
        "NCCL_IB_HCA": "mlx5",
        "GLOO_SOCKET_IFNAME": "eth1",
        "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
        "OMP_NUM_THREADS": "4",
        "PYTHONPATH": "/src",
        "AWS_SECRET_ACCESS_KEY": "s",
        "WANDB_API_KEY": "w",
        "HOME": "/root",
        "PATH": "/usr/bin",
        "CUDA_VISIBLE_DEVICES": "0",
    }
    assert forwarded_env(environ) == {
        "GLOO_SOCKET_IFNAME": "eth1",
        "MESHRUN_CHECKPOINT_DIR": "/ckpt",
        "NCCL_DEBUG": "INFO",
        "NCCL_IB_HCA": "mlx5",
        "OMP_NUM_THREADS": "4",
        "PYTHONPATH": "/src",
        "PYTHONUNBUFFERED": "1",
        "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
    }


# --- from the command line -----------------------------------------------------------------


def _args(tmp_path: Path, hostfile: str, *argv: str) -> tuple[argparse.Namespace, Config]:
    path = tmp_path / "hosts.txt"
    path.write_text(hostfile)
    a = build_parser().parse_args(["launch", "--hostfile", str(path), *argv])
    return a, load_config(None, a.set)


def test_plan_from_the_launch_flags(tmp_path: Path) -> None:
    a, cfg = _args(
        tmp_path,
        "n0 slots=2\nn1 slots=2\n",
        *("--max-restarts", "1", "--interface", "eth1", "--set", "optim.lr=0.1"),
        *("--ssh-opt", "IdentityFile=/k", "train.py", "--steps", "5"),
    )
    plan = plan_from_request(launch_request(a), cfg, {"NCCL_DEBUG": "WARN"}, "/w", "/py")
    assert plan.nproc_per_node == 2 and plan.endpoint == "n0:29500"
    assert plan.rdzv_id.startswith("meshrun-")
    assert plan.launch_args == [
        *("--max-restarts", "1", "--interface", "eth1", "--set", "optim.lr=0.1"),
        *("train.py", "--steps", "5"),
    ]
    assert plan.ssh_args == ["-o", "IdentityFile=/k"]
    assert plan.env == {"NCCL_DEBUG": "WARN", "PYTHONUNBUFFERED": "1"}


@pytest.mark.parametrize(
    ("hostfile", "flags", "message"),
    [
        ("a\nb\n", ["--node-rank", "1"], "--node-rank cannot go with --hostfile"),
        ("a\nb\n", ["--nnodes", "3"], "--nnodes '3' does not match --hostfile"),
        ("a\nb\n", ["--nnodes", "1:2"], "elastic MIN:MAX is not available"),
        ("a slots=2\nb\n", ["--nproc-per-node", "1"], "hosts have different process counts"),
        ("a\nb\nc\n", ["--nproc-per-node", "1"], "data.global_batch"),
    ],
)
def test_conflicts_fail_before_any_ssh(
    tmp_path: Path, hostfile: str, flags: list[str], message: str
) -> None:
    # data.global_batch 24 on 3 x 1 processes divides; 32 (below, 3 hosts) does not.
    a, cfg = _args(tmp_path, hostfile, *flags, "--set", "data.global_batch=32", "train.py")
    with pytest.raises(Exception, match=message):
        plan_from_request(launch_request(a), cfg, {}, "/w", "/py")


def test_ssh_opt_without_a_hostfile_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from meshrun.cli.main import main

    script = tmp_path / "train.py"
    script.write_text("")
    assert main(["launch", "--ssh-opt", "IdentityFile=/k", str(script)]) == 2
    assert (
        "--ssh-opt configures the ssh to each host: it needs --hostfile" in capsys.readouterr().err
    )
