"""`meshrun <command>` builds only that command's parser: the same parse, usage and errors."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from meshrun.cli.main import SUBCOMMANDS, build_parser


def _commands(parser: argparse.ArgumentParser) -> list[str]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return list(action.choices)
    raise AssertionError("no subcommands")


def test_every_command_is_registered_under_its_name() -> None:
    assert _commands(build_parser()) == list(SUBCOMMANDS)
    assert _commands(build_parser("launch")) == list(SUBCOMMANDS)


@pytest.mark.parametrize(
    "argv",
    [
        ["launch", "--nproc-per-node", "2", "--set", "job.seed=3", "train.py", "--lr", "1"],
        ["launch", "--nnodes", "2", "--rdzv-endpoint", "h:29500", "-m", "pkg.train"],
        ["plan", "--nnodes", "4"],
        ["slurm", "submit", "--nnodes", "3", "x.py"],
        ["config", "show", "--world-size", "2"],
    ],
)
def test_one_command_parses_as_the_whole_parser(argv: list[str]) -> None:
    whole, alone = build_parser().parse_args(argv), build_parser(argv[0]).parse_args(argv)
    assert vars(alone) == vars(whole)


def test_errors_and_usage_are_the_same(capsys: pytest.CaptureFixture[str]) -> None:
    texts = []
    for parser in (build_parser(), build_parser("launch")):
        with pytest.raises(SystemExit):
            parser.parse_args(["launch", "--nproc-per-node", "2", "--no-such-flag"])
        texts.append(capsys.readouterr().err)
    assert texts[0] == texts[1]
    assert "--no-such-flag" in texts[0]


def test_launch_does_not_import_the_other_commands() -> None:
    code = (
        "import sys, meshrun.cli.main; meshrun.cli.main.build_parser('launch');"
        "print(sorted(m for m in sys.modules if m.split('.')[1:2] in"
        " (['plan'], ['diagnose'], ['data'], ['ft']) or m in"
        " ('meshrun.report.analysis', 'meshrun.cli.ckpt', 'rich')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
