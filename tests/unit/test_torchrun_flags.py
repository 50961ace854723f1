"""``meshrun launch`` takes torchrun's flags: the table against torch's own parser, both
spellings, what each flag becomes (pure), and the torchrun argv built from them."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.run import get_args_parser

from meshrun.cli.main import build_parser, launch_request, main
from meshrun.config import ConfigError, LaunchConfig
from meshrun.launch.agent.local import LaunchSpec, build_torchrun_args
from meshrun.launch.front import torchrun as front_torchrun
from meshrun.launch.front.command import env_defaults
from meshrun.launch.front.request import LaunchRequest, TorchrunFlags
from meshrun.launch.front.torchrun import passthrough_argv, resolve
from meshrun.launch.spec import LaunchKeys
from meshrun.launch.torchrun_flags import FLAGS, OTHER_FLAGS, REFUSED, Flag, flag_argv

pytestmark = pytest.mark.timeout(30)

TORCHRUN = get_args_parser()
TORCHRUN_OPTIONS = [a for a in TORCHRUN._actions if a.option_strings and a.dest != "help"]


def _launch_parser() -> argparse.ArgumentParser:
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices["launch"]
    raise AssertionError("no launch subcommand")


LAUNCH = _launch_parser()


def _parse(*argv: str) -> LaunchRequest:
    return launch_request(LAUNCH.parse_args([*argv, "train.py"]))


def _value(flag: Flag) -> list[str]:
    if flag.switch:
        return []
    if flag.choices:
        return [flag.choices[-1]]
    return {int: ["3"], float: ["0.5"]}.get(flag.type, ["x,y"])  # type: ignore[arg-type]


# --- the table against torch.distributed.run.get_args_parser() -----------------------------


def test_every_torchrun_option_string_is_accepted_by_meshrun_launch() -> None:
    accepted = LAUNCH._option_string_actions
    for action in TORCHRUN_OPTIONS:
        if action.dest in REFUSED:
            continue
        for option in action.option_strings:
            assert option in accepted, f"torchrun's {option} is not a meshrun launch flag"
            ours = accepted[option]
            assert ours.dest == action.dest, option
            assert (ours.nargs == 0) == (action.nargs == 0), f"{option}: switch or value"
            assert ours.choices == action.choices or list(ours.choices or []) == list(
                action.choices or []
            ), option


def test_the_table_holds_every_torchrun_flag_and_nothing_else() -> None:
    """A flag a newer torch adds fails here until torchrun_flags.FLAGS places it."""
    torch_dests = {a.dest for a in TORCHRUN_OPTIONS}
    ours = {f.dest for f in FLAGS} | set(OTHER_FLAGS) | set(REFUSED)
    assert ours == torch_dests, (
        f"new in torch: {sorted(torch_dests - ours)}; gone from torch: {sorted(ours - torch_dests)}"
    )
    by_dest = {a.dest: a for a in TORCHRUN_OPTIONS}
    for flag in FLAGS:
        assert flag.options == tuple(by_dest[flag.dest].option_strings), flag.dest
        torch_type = by_dest[flag.dest].type
        if torch_type in (int, float):  # the same type, so a bad value fails before any start
            assert flag.type is torch_type, flag.dest
    assert OTHER_FLAGS["module"] == tuple(by_dest["module"].option_strings)


def test_the_typed_flags_have_one_field_per_row_of_the_table() -> None:
    assert [f.name for f in dataclasses.fields(TorchrunFlags)] == [f.dest for f in FLAGS]


@pytest.mark.parametrize("flag", [f for f in FLAGS if len(f.options) == 2], ids=lambda f: f.dest)
def test_both_spellings_parse_to_the_same_meaning(flag: Flag) -> None:
    first, second = (_parse(option, *_value(flag)) for option in flag.options)
    assert first == second
    assert first.torchrun.value(flag) is not None


@pytest.mark.parametrize("flag", [f for f in FLAGS if f.passed], ids=lambda f: f.dest)
def test_passed_flags_reach_the_agent_as_torchrun_reads_them(flag: Flag) -> None:
    for option in flag.options:
        given = [option, *_value(flag)]
        argv = passthrough_argv(_parse(*given).torchrun)
        want = getattr(TORCHRUN.parse_args([*given, "train.py"]), flag.dest)
        assert getattr(TORCHRUN.parse_args([*argv, "train.py"]), flag.dest) == want


def test_flag_argv_reproduces_the_command_line() -> None:
    a = _parse("--nproc_per_node=4", "--tee", "3", "--run_path", "--master_port=29555")
    t = a.torchrun
    argv = [arg for f in front_torchrun.given(t) for arg in flag_argv(f, t.value(f))]
    again = _parse(*argv)
    assert all(again.torchrun.value(f) == t.value(f) for f in FLAGS)


# --- resolve: what the flags mean ---------------------------------------------------------


def test_the_typical_multinode_torchrun_line_is_static_rendezvous_at_the_master() -> None:
    a = _parse(
        "--nnodes=2",
        "--node_rank=1",
        "--master_addr=10.0.0.1",
        "--master_port=29600",
        "--nproc_per_node=8",
    )
    r = resolve(a)
    assert r.nproc_per_node == 8 and r.spec["rdzv_backend"] == "static"
    assert r.launch_flags == LaunchKeys(rdzv_endpoint="10.0.0.1:29600")
    assert a.torchrun.node_rank == 1 and a.torchrun.nnodes == "2"  # go to [launch] as given


@pytest.mark.parametrize(
    ("argv", "backend", "launch_flags"),
    [
        ((), "c10d", {}),
        # torchrun: static without a port on one node runs a local c10d rendezvous
        (("--master_addr", "10.0.0.1"), "c10d", {}),
        (("--nnodes", "2", "--master_addr", "h0"), "static", {"rdzv_endpoint": "h0:29500"}),
        (("--nnodes", "2", "--master_port", "7000"), "static", {"rdzv_endpoint": "127.0.0.1:7000"}),
        (("--rdzv-backend", "static", "--rdzv-endpoint", "h0:7000"), "static", {}),
        (("--rdzv_backend=c10d", "--rdzv_endpoint=h0:7000"), "c10d", {}),
        (("--rdzv-endpoint", "h0:7000"), "c10d", {}),  # meshrun's c10d, as before
        (("--standalone",), "c10d", {"nnodes": "1", "rdzv_endpoint": ""}),
    ],
)
def test_rendezvous(argv: tuple[str, ...], backend: str, launch_flags: dict[str, Any]) -> None:
    r = resolve(_parse(*argv))
    assert (r.spec["rdzv_backend"], r.launch_flags) == (backend, LaunchKeys(**launch_flags))


def test_standalone_ignores_rendezvous_flags_aloud() -> None:
    r = resolve(_parse("--standalone", "--rdzv-endpoint", "h0:7000", "--rdzv_backend", "c10d"))
    assert r.launch_flags == LaunchKeys(nnodes="1", rdzv_endpoint="")
    assert any("--rdzv-endpoint h0:7000" in n and "ignored" in n for n in r.notes), r.notes


def test_master_addr_without_port_on_one_node_is_said_to_be_ignored() -> None:
    r = resolve(_parse("--master_addr", "10.0.0.1"))
    assert any("--master-addr 10.0.0.1 ignored" in n for n in r.notes), r.notes


def test_master_flags_with_a_c10d_endpoint_are_said_to_be_ignored() -> None:
    r = resolve(_parse("--rdzv-endpoint", "h0:7000", "--master-port", "7001"))
    assert r.spec["rdzv_backend"] == "c10d" and r.launch_flags == LaunchKeys()
    assert any("--master-addr/--master-port ignored" in n for n in r.notes), r.notes


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--rdzv-backend", "etcd"), "--rdzv-backend 'etcd' is not available"),
        (("--standalone", "--nnodes", "2"), "--standalone runs one node, but --nnodes is '2'"),
        (("--tee", "5"), "--tee '5' is not allowed"),
        (("--redirects", "0:3,x"), "--redirects '0:3,x' is not allowed"),
        (("--nproc-per-node", "0"), "--nproc-per-node 0 is not allowed: must be >= 1"),
        (("--nproc-per-node", "many"), "--nproc-per-node 'many' is not allowed here"),
        (("--no-python", "-m"), "--no-python cannot go with -m"),
        (("--nnodes", "2", "--master-port", "70000"), "--master-port 70000 is not allowed"),
    ],
)
def test_what_cannot_apply_is_an_error_naming_the_flag(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve(_parse(*argv))


@pytest.mark.parametrize("word", ["auto", "cpu"])
def test_nproc_auto_and_cpu_count_as_torchrun_does(word: str) -> None:
    if torch.accelerator.is_available():
        pytest.skip("on an accelerator auto counts devices")
    r = resolve(_parse("--nproc-per-node", word))
    assert r.nproc_per_node == torch._utils.cpu_count()
    assert any(f"--nproc-per-node {word}: " in n for n in r.notes)


def test_nproc_gpu_without_cuda_says_why() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available")
    with pytest.raises(ConfigError, match="'gpu' is not allowed here: Cuda is not available"):
        resolve(_parse("--nproc-per-node", "gpu"))


def test_output_flags_note_when_stderr_is_not_kept() -> None:
    assert resolve(_parse()).spec["tee"] == "" and resolve(_parse()).notes == []
    r = resolve(_parse("-t", "1"))
    assert r.spec["tee"] == "1" and any("stderr of some ranks" in n for n in r.notes)
    assert resolve(_parse("--tee", "3")).notes == []


# --- build_torchrun_args: the user's value wins ---------------------------------------------


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_default_output_is_stdout_untouched_and_stderr_teed() -> None:
    argv = build_torchrun_args(LaunchSpec(procs_per_node=2, script="t.py"), port=29513)
    assert _flag(argv, "--tee") == "2" and "--redirects" not in argv
    args = TORCHRUN.parse_args(argv)
    assert (args.tee, args.redirects) == ("2", "0")


@pytest.mark.parametrize(
    ("fields", "tee", "redirects"),
    [
        ({"tee": "3"}, "3", None),
        ({"redirects": "1"}, None, "1"),
        ({"tee": "0:3", "redirects": "2"}, "0:3", "2"),
    ],
)
def test_users_tee_and_redirects_replace_meshruns(
    fields: dict[str, str], tee: str | None, redirects: str | None
) -> None:
    argv = build_torchrun_args(LaunchSpec(procs_per_node=2, script="t.py", **fields), port=1)
    assert (_flag(argv, "--tee"), _flag(argv, "--redirects")) == (tee, redirects)
    assert argv.count("--tee") <= 1


def test_users_log_dir_and_local_addr_win() -> None:
    spec = LaunchSpec(procs_per_node=2, script="t.py", log_dir_flag="/tmp/x", local_addr="10.1.1.1")
    argv = build_torchrun_args(spec, port=1)
    assert spec.log_dir == "/tmp/x" and _flag(argv, "--log-dir") == "/tmp/x"
    assert _flag(argv, "--local-addr") == "10.1.1.1" and argv.count("--local-addr") == 1


def test_static_spec_gives_torchrun_the_node_rank() -> None:
    launch = LaunchConfig(nnodes="2", node_rank=1, rdzv_endpoint="10.0.0.1:29600")
    spec = LaunchSpec.of(launch, procs_per_node=8, script="t.py", rdzv_backend="static")
    args = TORCHRUN.parse_args(build_torchrun_args(spec, port=1))
    assert (args.rdzv_backend, args.rdzv_endpoint, args.node_rank) == (
        "static",
        "10.0.0.1:29600",
        1,
    )


def test_passed_flags_go_before_the_script() -> None:
    spec = LaunchSpec(
        procs_per_node=2,
        script="t.py",
        script_args=["--lr", "1"],
        torchrun_args=["--monitor-interval", "0.5", "--no-python"],
    )
    args = TORCHRUN.parse_args(build_torchrun_args(spec, port=1))
    assert args.monitor_interval == 0.5 and args.no_python
    assert (args.training_script, args.training_script_args) == ("t.py", ["--lr", "1"])


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"torchrun_args": ["--tee", "3"]}, r"must not hold \['--tee'\]"),
        ({"torchrun_args": ["--nproc_per_node=3"]}, "must not hold"),
        ({"rdzv_backend": "etcd"}, "rdzv_backend must be c10d or static"),
        ({"rdzv_backend": "static"}, "static needs rdzv_endpoint"),
    ],
)
def test_a_spec_that_would_give_torchrun_two_values_is_refused(
    fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        build_torchrun_args(LaunchSpec(procs_per_node=2, script="t.py", **fields), port=1)


# --- the command line: errors before anything starts ----------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rdzv_backend", "etcd-v2"], "--rdzv-backend 'etcd-v2' is not available"),
        (["--hostfile", "hosts.txt", "--tee", "3"], "--tee cannot go with --hostfile"),
        (["--hostfile", "hosts.txt", "--nproc_per_node", "auto"], "auto cannot go with --hostfile"),
    ],
)
def test_meshrun_launch_refuses_with_exit_2(
    argv: list[str],
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('never runs')\n")
    (tmp_path / "hosts.txt").write_text("127.0.0.1\n")
    code = main(["launch", *argv, "train.py", f"--job.run_dir={tmp_path / 'run'}"])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run" / "logs").exists()


def test_no_python_takes_a_program_on_path(tmp_path: Path) -> None:
    from meshrun.launch.target import check_target as _check_target

    _check_target("true", None, True)  # found on PATH, as torchrun would run it
    with pytest.raises(ConfigError, match="script 'true' does not exist"):
        _check_target("true", None, None)
    with pytest.raises(ConfigError, match="program 'no-such-prog' does not exist"):
        _check_target("no-such-prog", None, True)


# --- torchrun's PET_<FLAG> environment defaults ---------------------------------------------


def test_pet_variables_fill_the_flags_not_given_as_torchrun_reads_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env = {
        "PET_NPROC_PER_NODE": "4",
        "PET_NNODES": "2",
        "PET_NODE_RANK": "1",
        "PET_MASTER_ADDR": "job-master-0",
        "PET_MASTER_PORT": "23456",
        "PET_STANDALONE": "0",
        "PET_MONITOR_INTERVAL": "0.5",
    }
    request = _parse("--nnodes", "3")  # a flag wins over its variable
    a, notes = env_defaults(request.torchrun, env)
    assert (a.nproc_per_node, a.nnodes, a.node_rank, a.master_port) == (4, "3", 1, 23456)
    assert a.standalone is None and a.monitor_interval == 0.5
    assert "--master-addr job-master-0 from PET_MASTER_ADDR" in " | ".join(notes)
    assert not any("PET_NNODES" in n for n in notes)
    for name, value in env.items():  # torchrun's parser reads them when it is built
        monkeypatch.setenv(name, value)
    theirs = get_args_parser().parse_args(["--nnodes", "3", "train.py"])
    compared = [f.dest for f in FLAGS if f.dest not in ("standalone", "nproc_per_node")]
    for dest in compared:
        if getattr(a, dest) is not None:
            assert getattr(a, dest) == getattr(theirs, dest), dest
    assert theirs.nproc_per_node == "4" and not theirs.standalone
    r = resolve(dataclasses.replace(request, torchrun=a))
    assert r.spec["rdzv_backend"] == "static"
    assert r.launch_flags == LaunchKeys(rdzv_endpoint="job-master-0:23456")


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"PET_NODE_RANK": "one"}, "PET_NODE_RANK='one' .* is not allowed: expected int"),
        ({"PET_STANDALONE": "yes"}, "PET_STANDALONE='yes' .* expected 0 or 1"),
        ({"PET_START_METHOD": "thread"}, "PET_START_METHOD='thread' is not allowed: expected"),
    ],
)
def test_a_bad_pet_variable_names_itself(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        env_defaults(_parse().torchrun, env)
