"""Every meshrun command stops with the same one-line shape, ``meshrun COMMAND: error: ...``,
written in one place (``runtime/logs.say_error``): a command that formats its own would drift."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshrun.runtime.logs import say_error

SRC = Path(__file__).resolve().parents[2] / "src" / "meshrun"


def test_only_say_error_writes_the_error_line() -> None:
    writers = [
        p.relative_to(SRC).as_posix()
        for p in sorted(SRC.rglob("*.py"))
        if ": error: {" in p.read_text()
    ]
    assert writers == ["runtime/logs.py"]


def test_the_line_names_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    say_error("ckpt export", ValueError("no such checkpoint"))
    assert capsys.readouterr().err == "meshrun ckpt export: error: no such checkpoint\n"
