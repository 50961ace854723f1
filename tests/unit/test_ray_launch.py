"""``meshrun ray launch`` without Ray running: flag and config checks that stop a job before
Ray starts, the backend Ray is told to use, the failure summary from the workers' files, and
Ray imported only when a job starts (the `ray` extra named when it is missing)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from meshrun.cli.main import main
from meshrun.cli.ray import ray_backend
from meshrun.config import Config, ConfigError
from meshrun.launch.ray.failures import DIED, read_failures, summarize


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--workers", "0"], "--workers 0 is not allowed: must be >= 1"),
        (["--workers", "2", "--min-workers", "3"], "--min-workers 3 is not allowed"),
        (["--workers", "2", "--cpus-per-worker", "0"], "--cpus-per-worker 0.0 is not allowed"),
        (["--workers", "2", "--gpus-per-worker", "-1"], "--gpus-per-worker -1.0 is not allowed"),
        (["--workers", "2", "--max-restarts", "-1"], "--max-restarts -1 is not allowed"),
    ],
)
def test_bad_flags_are_refused_naming_the_flag(
    flags: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    assert main(["ray", "launch", *flags, str(script)]) == 2
    assert message in capsys.readouterr().err


def test_a_missing_script_and_a_bad_override_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["ray", "launch", "--workers", "2", str(tmp_path / "nope.py")]) == 2
    assert "does not exist" in capsys.readouterr().err
    script = tmp_path / "train.py"
    script.write_text("")
    argv = ["ray", "launch", "--workers", "2", str(script), "--data.micro_batch=-1"]
    assert main(argv) == 2
    assert "data.micro_batch" in capsys.readouterr().err


def test_the_backend_ray_is_told_is_the_one_meshrun_would_choose() -> None:
    cfg = Config()
    assert ray_backend(cfg, 0) == "gloo"
    assert ray_backend(cfg, 1) == "nccl"
    cfg.job.device = "cpu"
    assert ray_backend(cfg, 1) == "gloo"
    cfg.job.device, cfg.job.backend = "auto", "nccl"
    with pytest.raises(ConfigError, match="needs GPUs, but --gpus-per-worker is 0"):
        ray_backend(cfg, 0)


def _rank_files(logs: Path, rank: int, exit_code: int | None, error: str | None) -> None:
    d = logs / f"rank{rank}"
    d.mkdir(parents=True)
    where = {"rank": rank, "local_rank": rank, "node_rank": 0, "host": f"node{rank}", "pid": 7}
    (d / "where.json").write_text(json.dumps(where))
    if exit_code is not None:
        (d / "exit.json").write_text(json.dumps({"code": exit_code, "time": 100.0 + rank}))
    if error:
        stack = f'Traceback (most recent call last):\n  File "train.py", line 3\n{error}'
        data = {"message": {"message": error, "extraInfo": {"py_callstack": stack}}}
        (d / "error.json").write_text(json.dumps(data))


def test_the_rank_that_died_is_named_first_and_its_peer_as_a_victim(tmp_path: Path) -> None:
    _rank_files(tmp_path, 0, 1, "RuntimeError: Connection closed by peer")
    _rank_files(tmp_path, 1, None, None)  # SIGKILLed: no exit record, no error file
    failures = {0: RuntimeError("rank 0 ... exited with code 1"), 1: RuntimeError("actor died")}
    text, code = summarize(read_failures(tmp_path, failures))
    print(text)
    assert "meshrun ray launch: rank 1 failed first (host node1)" in text
    assert f"cause : {DIED}" in text
    assert "Ray's error for this worker:\n    actor died" in text
    assert "rank 0 on node0 (exit code 1): RuntimeError: Connection closed by peer" in text
    assert code == 1


def test_an_exception_is_summarised_with_its_traceback_and_exit_code(tmp_path: Path) -> None:
    _rank_files(tmp_path, 0, 3, None)
    _rank_files(tmp_path, 1, 1, "ValueError: bad batch")
    failures = {1: RuntimeError("x"), 0: RuntimeError("y")}
    text, code = summarize(read_failures(tmp_path, failures))
    assert "rank 0 failed first (host node0)" in text  # exited first (time 100 < 101)
    assert "cause : exit code 3" in text
    assert code == 3
    text, _ = summarize(read_failures(tmp_path, {1: RuntimeError("x")}))
    assert "error : ValueError: bad batch" in text
    assert "traceback (from the error file written by @record):\n    Traceback" in text


def test_meshrun_and_its_cli_do_not_import_ray() -> None:
    code = "import sys, meshrun, meshrun.cli.main; meshrun.cli.main.build_parser(); print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


def test_without_ray_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from meshrun.launch.ray.job import import_ray

    monkeypatch.setitem(sys.modules, "ray", None)  # what an environment without ray sees
    with pytest.raises(ConfigError, match=r"install the `ray` extra, pip install 'meshrun\[ray\]'"):
        import_ray()
