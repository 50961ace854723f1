"""The ``meshrun`` command line, run as a subprocess the way a user runs it.

The config errors of ``meshrun launch`` must stop it before torchrun starts a worker: each
such test checks the exit code (2), the time, the message naming the key, and that no
worker ran and no per-rank log folder was created. Each run costs a torch import (a few s).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshrun.config import Config, load_config, to_toml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

CLI_TIMEOUT_S = 90


def meshrun(*args: str, cwd: Path) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run ``python -m meshrun ARGS`` in ``cwd``; return the result and the wall time."""
    env = {k: v for k, v in os.environ.items() if k != "MESHRUN_CONFIG"}
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "meshrun", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
    )
    return proc, time.monotonic() - start


# --- help and config ---------------------------------------------------------------------


def test_help_lists_the_subcommands(tmp_path: Path) -> None:
    proc, _ = meshrun("--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    for command in ("demo", "launch", "config"):
        assert command in proc.stdout
    assert proc.stdout.startswith("usage: meshrun")


def test_config_init_writes_a_template_that_show_prints_and_that_loads(tmp_path: Path) -> None:
    path = tmp_path / "conf" / "meshrun.toml"
    path.parent.mkdir()
    init, _ = meshrun("config", "init", str(path), cwd=tmp_path)
    assert init.returncode == 0, init.stderr
    assert f"wrote {path}" in init.stdout
    text = path.read_text()
    assert text.startswith("# meshrun configuration")
    assert "[optim]" in text
    assert load_config(path) == Config()

    show, _ = meshrun("config", "show", str(path), cwd=tmp_path)
    assert show.returncode == 0, show.stderr
    assert show.stdout == to_toml(Config())
    assert tomllib.loads(show.stdout)["data"]["global_batch"] == 0  # unset: derived at launch


def test_config_init_refuses_to_overwrite_without_force(tmp_path: Path) -> None:
    path = tmp_path / "meshrun.toml"
    path.write_text("# mine\n")
    proc, _ = meshrun("config", "init", str(path), cwd=tmp_path)
    assert proc.returncode == 2
    assert "already exists" in proc.stderr
    assert "--force" in proc.stderr
    assert path.read_text() == "# mine\n"

    forced, _ = meshrun("config", "init", str(path), "--force", cwd=tmp_path)
    assert forced.returncode == 0, forced.stderr
    assert load_config(path) == Config()
    assert path.read_text() != "# mine\n"


def test_config_show_applies_overrides_over_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[data]\nglobal_batch = 64\nmicro_batch = 2\n")
    proc, _ = meshrun(
        "config", "show", str(path), "--data.global_batch=128", "--optim.lr=0.5", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    shown = tomllib.loads(proc.stdout)
    assert shown["data"]["global_batch"] == 128  # the override beats the file
    assert shown["data"]["micro_batch"] == 2  # the file beats the default
    assert shown["optim"]["lr"] == 0.5
    assert "lr = 0.5" in proc.stdout.splitlines()


def test_config_show_with_a_bad_key_exits_2_naming_it(tmp_path: Path) -> None:
    proc, _ = meshrun("config", "show", "--optim.lrr=0.5", cwd=tmp_path)
    assert proc.returncode == 2
    assert "optim.lrr" in proc.stderr
    assert "Did you mean 'lr'?" in proc.stderr
    assert proc.stdout == ""


# --- launch: config errors stop it before any worker starts --------------------------------

TRAIN_SCRIPT = """\
import os, pathlib
pathlib.Path(os.environ.get("MARKER_DIR", "."), f"ran_{os.environ.get('RANK', 'x')}").touch()
"""


@pytest.mark.parametrize(
    ("script_args", "expected", "run_dir_via"),
    [
        (["--data.bogus=1"], ["data.bogus", "unknown config key"], "set"),
        (["--data.micro_batch=four"], ["data.micro_batch", "'four'", "an integer"], "override"),
        (["--parallel.dp_shard=3"], ["dp_shard=3", "world size is 2"], "set"),
        (
            ["--data.global_batch=30", "--data.micro_batch=4"],
            ["data.global_batch = 30", "4 x 2 = 8"],
            "override",
        ),
        (["--optim.decay", "step"], ["optim.decay", "'step'", "'cosine'"], "set"),
    ],
    ids=["unknown-key", "bad-type", "mesh-product", "batch-not-divisible", "bad-choice"],
)
def test_launch_config_errors_exit_2_before_spawning(
    tmp_path: Path, script_args: list[str], expected: list[str], run_dir_via: str
) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    run_dir = tmp_path / "run"
    if run_dir_via == "set":
        head, tail = ["--set", f"job.run_dir={run_dir}"], []
    else:
        head, tail = [], [f"--job.run_dir={run_dir}"]
    proc, _ = meshrun(
        "launch", "--nproc-per-node", "2", *head, str(script), *script_args, *tail, cwd=tmp_path
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("meshrun launch: error:"), proc.stderr
    for text in expected:
        assert text in proc.stderr
    _assert_nothing_started(tmp_path, run_dir)


def test_launch_of_a_missing_script_exits_2_before_spawning(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    missing = tmp_path / "no_such_train.py"
    proc, _ = meshrun(
        "launch", "--nproc-per-node", "2", str(missing), f"--job.run_dir={run_dir}", cwd=tmp_path
    )
    assert proc.returncode == 2
    assert "does not exist" in proc.stderr
    assert str(missing) in proc.stderr
    _assert_nothing_started(tmp_path, run_dir)


def test_launch_with_a_bad_config_file_key_exits_2(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    config = tmp_path / "bad.toml"
    config.write_text(f'[job]\nrun_dir = "{tmp_path / "run"}"\n\n[parallel]\nzero = 5\n')
    proc, _ = meshrun(
        "launch", "--nproc-per-node", "2", "--config", str(config), str(script), cwd=tmp_path
    )
    assert proc.returncode == 2
    assert "parallel.zero = 5" in proc.stderr and "<= 3" in proc.stderr
    _assert_nothing_started(tmp_path, tmp_path / "run")


def _assert_nothing_started(cwd: Path, run_dir: Path) -> None:
    assert not (run_dir / "logs").exists()  # torchrun's per-rank logs
    assert not (run_dir / "config.toml").exists()  # validation precedes writing the config
    assert not (cwd / "runs").exists()  # nothing fell back to the default run directory
    assert not list(cwd.glob("ran_*"))  # no worker ran the script


# --- demo --------------------------------------------------------------------------------


def test_demo_with_an_unknown_key_exits_2_naming_it(tmp_path: Path) -> None:
    proc, _ = meshrun("demo", "--run-dir", str(tmp_path / "demo"), "--data.bogus=1", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.startswith("meshrun demo: error:")
    assert "data.bogus" in proc.stderr
    assert not (tmp_path / "demo").exists()
    assert not (tmp_path / "runs").exists()
