"""A script's own dotted flags (minGPT's ``--trainer.batch_size=4``) reach it untouched when
they follow a ``--``: ``split_overrides`` stops there, ``meshrun launch`` keeps the ``--`` that
argparse drops after the script, and ``meshrun.init()`` removes it from ``sys.argv``. Before
the ``--`` every dotted flag is meshrun's: an unknown one is an error that names it and says
where a script's own flag goes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshrun.cli.args import keep_separator
from meshrun.cli.main import build_parser
from meshrun.config import ConfigError, load_config, split_overrides
from meshrun.train.startup import resolve_config

SCRIPT = Path(__file__).resolve().parents[1] / "e2e" / "scripts" / "dotted_own_flags.py"
OWN = ["--trainer.batch_size=4", "--model.n_layer", "3"]


def test_split_overrides_leaves_everything_after_the_separator_to_the_script() -> None:
    overrides, rest = split_overrides(["--optim.lr=0.5", "x", "--", *OWN, "--", "--job.name=a"])
    assert overrides == [("optim.lr", "0.5")]
    assert rest == ["x", *OWN, "--", "--job.name=a"]  # the first `--` only is meshrun's


def test_an_override_cannot_take_the_separator_as_its_value() -> None:
    with pytest.raises(ConfigError, match=r"--optim\.lr=VALUE"):
        split_overrides(["--optim.lr", "--", "x"])


@pytest.mark.parametrize(
    ("flag", "named"),
    [
        ("--trainer.batch_size=4", "unknown config section 'trainer'"),
        ("--optm.lr=0.1", "Did you mean 'optim'"),  # a typo of a real section stays an error
        ("--optim.lrr=0.1", "unknown config key 'optim.lrr'"),
    ],
)
def test_an_unknown_dotted_flag_before_the_separator_is_an_error_that_says_where_to_put_it(
    flag: str, named: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, split_overrides([flag])[0])
    text = str(info.value)
    assert named in text and "put it after `--`" in text and flag.split("=")[0] in text


def test_a_toml_key_error_does_not_speak_of_flags(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[trainer]\nbatch_size = 4\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "`--`" not in str(info.value)


@pytest.mark.parametrize(
    "argv",
    [
        ["launch", "train.py", "--", *OWN],
        ["launch", "--nproc-per-node", "2", "train.py", "--optim.lr=0.5", "--", *OWN],
        ["slurm", "submit", "train.py", "--", *OWN],
        ["k8s", "render", "--image", "img", "train.py", "--", *OWN],
    ],
)
def test_the_launchers_keep_the_separator_for_the_workers(argv: list[str]) -> None:
    a = build_parser(argv[0]).parse_args(argv)
    keep_separator(argv, a)
    assert a.args[a.args.index("--") + 1 :] == OWN
    assert split_overrides(a.args)[0] in ([], [("optim.lr", "0.5")])


def test_a_separator_before_the_script_is_the_launchers_own() -> None:
    argv = ["launch", "--", "train.py", "--optim.lr=0.5"]
    a = build_parser("launch").parse_args(argv)
    keep_separator(argv, a)
    assert (a.target, a.args) == ("train.py", ["--optim.lr=0.5"])


def test_init_removes_the_separator_and_keeps_what_follows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sys, "argv", ["train.py", "--optim.lr=0.5", "--", *OWN])
    assert resolve_config(None, None).optim.lr == 0.5
    assert sys.argv == ["train.py", *OWN]
    monkeypatch.setattr(sys, "argv", ["train.py", "--", *OWN])  # no override at all
    resolve_config(None, None)
    assert sys.argv == ["train.py", *OWN]


@pytest.mark.timeout(120)
def test_a_plain_python_run_gives_the_script_its_dotted_flags(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MESHRUN_", "PET_"))}
    args = [f"--job.run_dir={tmp_path / 'run'}", "--optim.lr=0.25", "--", *OWN]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["argv"] == OWN
    assert (seen["batch_size"], seen["n_layer"], seen["lr"]) == (4, 3, 0.25)
