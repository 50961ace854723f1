"""``meshrun ray launch``: the same script on a Ray cluster, started by Ray Train's TorchTrainer."""

from __future__ import annotations

import argparse

__all__ = ["add_parser"]


def _cmd_launch(a: argparse.Namespace) -> int:
    raise SystemExit("meshrun ray launch: not available yet in this version")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("ray", help="run a training script on a Ray cluster (the `ray` extra)")
    rsub = p.add_subparsers(dest="ray_cmd", required=True)
    launch = rsub.add_parser("launch", help="start the script in Ray Train workers")
    launch.set_defaults(fn=_cmd_launch)
