"""The single-node launcher: torchrun argv (pure), the failure summary (pure, on files),
and real launches of 2 Gloo workers through torchrun's elastic agent.

Each real launch costs a few seconds of worker imports on 2 cores, so there are only a
handful; everything that can be checked without processes is.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from meshrun.config import LaunchConfig
from meshrun.launch.agent.failures import (
    describe_exit,
    find_attempt_dir,
    order_failures,
    summarize_failures,
)
from meshrun.launch.agent.local import (
    LaunchSpec,
    build_torchrun_args,
    default_nproc_per_node,
    launch_local,
    start_line,
)
from meshrun.runtime.ports import free_port

SCRIPTS = Path(__file__).parent / "scripts"


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


# --- build_torchrun_args: pure --------------------------------------------------------


@pytest.mark.timeout(60)  # a hang guard: torch's first import alone can take 10 s here
def test_args_for_a_script_on_one_node() -> None:
    spec = LaunchSpec(procs_per_node=4, script="train.py", script_args=["--lr", "3e-4"])
    argv = build_torchrun_args(spec, port=29513)
    assert _flag(argv, "--rdzv-backend") == "c10d"
    assert _flag(argv, "--rdzv-endpoint") == "127.0.0.1:29513"
    assert _flag(argv, "--nproc-per-node") == "4"
    assert _flag(argv, "--nnodes") == "1"
    assert _flag(argv, "--max-restarts") == "0"
    assert _flag(argv, "--tee") == "2"  # stderr only: stdout is left as torchrun leaves it
    assert _flag(argv, "--log-dir") == os.path.join("runs/launch", "logs")
    assert _flag(argv, "--local-addr") == "127.0.0.1"
    assert argv[-3:] == ["train.py", "--lr", "3e-4"]
    assert "-m" not in argv


@pytest.mark.timeout(60)  # a hang guard: torch's first import alone can take 10 s here
def test_args_for_a_module_with_an_explicit_endpoint() -> None:
    spec = LaunchSpec.of(
        LaunchConfig(nnodes="2", rdzv_endpoint="node0:29400", max_restarts=3),
        procs_per_node=8,
        module="pkg.train",
        script_args=["--steps", "10"],
        run_dir="runs/x",
    )
    argv = build_torchrun_args(spec, port=1234)
    assert argv[-4:] == ["-m", "pkg.train", "--steps", "10"]
    assert _flag(argv, "--rdzv-endpoint") == "node0:29400"  # the port is for one node only
    assert _flag(argv, "--nproc-per-node") == "8"
    assert _flag(argv, "--nnodes") == "2"
    assert _flag(argv, "--max-restarts") == "3"
    assert _flag(argv, "--log-dir") == os.path.join("runs/x", "logs")
    assert "--local-addr" not in argv  # many nodes: torch must advertise a reachable address


@pytest.mark.timeout(60)  # a hang guard: torch's first import alone can take 10 s here
def test_args_are_accepted_by_torchrun_parser() -> None:
    from torch.distributed.run import get_args_parser

    spec = LaunchSpec(procs_per_node=2, module="pkg.train", script_args=["--flag"])
    args = get_args_parser().parse_args(build_torchrun_args(spec, port=29513))
    assert args.module and args.training_script == "pkg.train"
    assert args.training_script_args == ["--flag"]
    assert args.nproc_per_node == "2" and args.rdzv_endpoint == "127.0.0.1:29513"


@pytest.mark.timeout(60)  # a hang guard: torch's first import alone can take 10 s here
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one of script or module"),
        ({"script": "a.py", "module": "a"}, "exactly one of script or module"),
        ({"script": "a.py", "procs_per_node": 0}, "nproc_per_node must be >= 1, got 0"),
    ],
)
def test_bad_spec_names_the_field(kwargs: dict[str, Any], message: str) -> None:
    spec = LaunchSpec(**{"procs_per_node": 2, **kwargs})
    with pytest.raises(ValueError, match=message):
        build_torchrun_args(spec, port=1)


@pytest.mark.timeout(60)  # a hang guard: torch's first import alone can take 10 s here
def test_helpers() -> None:
    assert 0 < free_port() < 65536
    assert default_nproc_per_node() >= 1
    spec = LaunchSpec(procs_per_node=2, script="t.py", config_path="runs/x/config.toml")
    assert start_line(spec, 29513, "1") == (
        "meshrun launch: 2 processes x 1 node | rendezvous 127.0.0.1:29513 | "
        "OMP_NUM_THREADS=1 | config runs/x/config.toml | logs "
        + os.path.join("runs/launch", "logs")
    )


# --- the failure summary: pure on failure records plus files ---------------------------


@dataclass
class FakeFailure:
    local_rank: int
    exitcode: int
    timestamp: int = 1_700_000_000
    pid: int = 4242
    error_file: str = "<N/A>"
    # torch's placeholder when a rank wrote no error file
    error_file_data: dict[str, Any] = field(default_factory=lambda: {"message": "<NONE>"})


def _write_stderr(attempt: Path, local_rank: int, text: str, mtime: float) -> None:
    folder = attempt / str(local_rank)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "stderr.log").write_text(text)
    os.utime(folder / "stderr.log", (mtime, mtime))


@pytest.mark.timeout(60)  # a hang guard: torch's first import alone can take 10 s here
def test_summary_prefers_the_real_cause_over_a_same_second_victim(tmp_path: Path) -> None:
    # Both exit in the same second, rank 0 first in the dict (where torch's own
    # get_first_failure would pick it); rank 1 wrote its traceback earlier.
    attempt = tmp_path / "meshrun_abc" / "attempt_0"
    _write_stderr(attempt, 0, "[rank0]: RuntimeError: Connection closed by peer\n", 1000.5)
    _write_stderr(attempt, 1, "[rank1]: Traceback\n[rank1]: ValueError: bad shard\n", 1000.2)
    failures = {0: FakeFailure(0, exitcode=1), 1: FakeFailure(1, exitcode=1)}
    report = summarize_failures(failures, str(attempt), host="node7")
    assert report.first_rank == 1
    assert report.exit_code == 1
    assert "rank 1 failed first (host node7)" in report.text
    assert "    ValueError: bad shard" in report.text  # "[rankN]: " prefix dropped
    assert "  error : ValueError: bad shard" in report.text  # from the log, no error file
    assert "rank 0 (exit code 1): RuntimeError: Connection closed by peer" in report.text
    assert "<NONE>" not in report.text


@pytest.mark.timeout(60)  # a hang guard: torch's first import alone can take 10 s here
def test_summary_puts_agent_sigterms_last_and_explains_sigkill(tmp_path: Path) -> None:
    failures = {
        0: FakeFailure(0, exitcode=-signal.SIGTERM, timestamp=5),
        3: FakeFailure(3, exitcode=-signal.SIGKILL, timestamp=9),
    }
    assert order_failures(failures, None) == [3, 0]
    report = summarize_failures(failures, None, host="h")
    assert report.exit_code == 1  # a signal still fails the launch
    assert "signal SIGKILL (killed: out of memory?" in report.text
    assert "rank 0 (SIGTERM)" in report.text
    # A SIGKILLed rank runs no Python code: no advice to decorate a script that may be.
    assert "a rank ended by SIGKILL writes no error file" in report.text
    assert describe_exit(137).startswith("exit code 137 = signal SIGKILL")
    assert describe_exit(3) == "exit code 3"


@pytest.mark.timeout(60)  # a hang guard: torch's first import alone can take 10 s here
def test_summary_keeps_to_one_screen(tmp_path: Path) -> None:
    attempt = tmp_path / "meshrun_abc" / "attempt_0"
    _write_stderr(attempt, 0, "".join(f"line {i}\n" for i in range(500)), 1.0)
    failures: dict[int, FakeFailure] = {0: FakeFailure(0, exitcode=2)}
    failures |= {r: FakeFailure(r, exitcode=-signal.SIGTERM) for r in range(1, 64)}
    text = summarize_failures(failures, str(attempt), host="h").text
    assert len(text.splitlines()) <= 60
    assert "line 499" in text and "line 400" not in text
    assert "and ranks 9, 10" in text


@pytest.mark.timeout(60)  # a hang guard: torch's first import alone can take 10 s here
def test_find_attempt_dir_skips_older_runs(tmp_path: Path) -> None:
    (tmp_path / "meshrun_old" / "attempt_0").mkdir(parents=True)
    for n in (0, 1, 10):
        (tmp_path / "meshrun_new" / f"attempt_{n}").mkdir(parents=True)
    found = find_attempt_dir(str(tmp_path), "meshrun", known={"meshrun_old"})
    assert found == str(tmp_path / "meshrun_new" / "attempt_10")
    assert find_attempt_dir(str(tmp_path / "missing"), "meshrun") is None


# --- the agent itself failing, and Ctrl-C (agent replaced: no processes) ----------------


@pytest.mark.timeout(30)
def test_agent_failure_is_one_line_and_environment_is_restored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

    def timeout(args: object) -> None:
        os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = "SIGTERM"  # as the agent does
        raise RendezvousTimeoutError("the rendezvous timed out\nafter 600 s")

    monkeypatch.setattr(torchrun, "run", timeout)
    before = dict(os.environ)
    spec = LaunchSpec(procs_per_node=2, script="t.py", run_dir=str(tmp_path))
    assert launch_local(spec) == 1
    err = capfd.readouterr().err
    assert (
        "meshrun launch: the torchrun agent failed: "
        "RendezvousTimeoutError: the rendezvous timed out after 600 s"
    ) in err
    assert "Traceback" not in err
    assert dict(os.environ) == before

    def interrupt(args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(torchrun, "run", interrupt)
    assert launch_local(spec) == 130


# --- real launches: 2 workers on Gloo through torchrun ----------------------------------


def _launch_failing(script: str, run_dir: Path) -> int:
    spec = LaunchSpec(procs_per_node=2, script=str(SCRIPTS / script), run_dir=str(run_dir))
    return launch_local(spec)


def _summary(err: str) -> str:
    # The summary is the block framed by two rules at the end of stderr.
    start = err.index("meshrun launch: rank ")
    return err[start:]


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_failing_rank_is_named_with_its_traceback(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    code = _launch_failing("raise_on_rank1.py", tmp_path)
    err = capfd.readouterr().err
    assert code == 1
    summary = _summary(err)
    assert "rank 1 failed first" in summary
    assert "rank 0 failed first" not in err
    assert "boom from rank 1" in summary
    assert "load_shard_for_rank1" in summary  # the nested function, from @record's error file
    assert "from the error file written by @record" in summary
    assert re.search(r"also stopped \(likely victims\):\n\s+rank 0 \(", summary)
    assert len(summary.splitlines()) <= 60


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_traceback_comes_from_the_log_without_record(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    code = _launch_failing("raise_on_rank1_norecord.py", tmp_path)
    err = capfd.readouterr().err
    assert code == 1
    summary = _summary(err)
    assert "rank 1 failed first" in summary
    assert "lines of its stderr" in summary
    assert "load_shard_for_rank1" in summary
    assert "  error : RuntimeError: boom from rank 1" in summary
    # The log the summary read is the one torchrun wrote for local rank 1 of this run.
    assert re.search(r"log   : .*/logs/meshrun_\w+/attempt_0/1/stderr\.log", summary)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_success_passes_config_and_threads_to_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    config = tmp_path / "config.toml"
    config.write_text("[train]\nsteps = 1\n")
    spec = LaunchSpec(
        procs_per_node=2,
        script=str(SCRIPTS / "plain_ddp_ok.py"),
        config_path=str(config),
        run_dir=str(tmp_path / "run"),
    )
    assert launch_local(spec) == 0
    out, err = capfd.readouterr()
    expected_threads = str(max(1, len(os.sched_getaffinity(0)) // 2))
    assert re.findall(r"OMP_NUM_THREADS=(\S*)", out) == [expected_threads] * 2
    assert re.findall(r"MESHRUN_CONFIG=(\S*)", out) == [str(config)] * 2
    assert f"OMP_NUM_THREADS={expected_threads} | config {config}" in err
    assert "OMP_NUM_THREADS" not in os.environ and "MESHRUN_CONFIG" not in os.environ
    # Every rank's stderr is also kept where the summary looks for it; stdout, as torchrun's
    # own default, only goes to the console.
    logs = sorted((tmp_path / "run" / "logs").glob("meshrun_*/attempt_0/*/stderr.log"))
    assert [p.parent.name for p in logs] == ["0", "1"]
    assert not list((tmp_path / "run" / "logs").glob("meshrun_*/attempt_0/*/stdout.log"))
    assert "all_reduce ok on rank 1 of 2" in out


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_ctrl_c_stops_the_workers_and_returns_130(tmp_path: Path) -> None:
    # In a subprocess: the signal must reach a launcher, not pytest.
    code = (
        "import sys\n"
        "from meshrun.launch.agent.local import LaunchSpec, launch_local\n"
        f"spec = LaunchSpec(procs_per_node=2, script={str(SCRIPTS / 'sleep_until_stopped.py')!r},"
        f" run_dir={str(tmp_path)!r})\n"
        "sys.exit(launch_local(spec))\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    pids: list[int] = []
    while len(pids) < 2:
        line = proc.stdout.readline()
        assert line, "launcher exited before the workers were ready"
        # Both workers share the pipe: under PYTHONUNBUFFERED one worker's line can land inside the other's.
        pids += [int(pid) for pid in re.findall(r"ready pid=(\d+)", line)]
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 130
    for pid in pids:
        assert not _alive(pid), f"worker {pid} survived Ctrl-C"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has exited; only its parent has not reaped it yet
