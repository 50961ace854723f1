"""``meshrun lighthouse``: torchft's lighthouse for a replica-group job."""

from __future__ import annotations

import argparse

__all__ = ["add_parser"]


def _cmd_lighthouse(a: argparse.Namespace) -> int:
    raise SystemExit("meshrun lighthouse: not available yet in this version")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("lighthouse", help="run torchft's lighthouse for a replica-group job")
    p.set_defaults(fn=_cmd_lighthouse)
