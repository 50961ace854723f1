"""Arguments several subcommands share (launch, scale-test, slurm submit, k8s render), and the
two shapes every command group's module in ``cli/`` registers its commands with.

Its own module so the subsystems' ``add_parser`` functions can use it without importing
``meshrun.cli.main``, which imports them.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import TypeAlias

# A string: argparse's class takes no subscript at run time, only in the type checker.
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
Command: TypeAlias = Callable[[argparse.Namespace], int]


def key_value(text: str) -> tuple[str, str]:
    """``--set SECTION.KEY=VALUE`` as a (key, value) pair."""
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"--set {text!r}: expected SECTION.KEY=VALUE")
    key, value = text.split("=", 1)
    return key, value


def add_set(p: argparse.ArgumentParser) -> None:
    """``--set SECTION.KEY=VALUE`` (repeatable) into ``a.set`` as (key, value) pairs."""
    p.add_argument("--set", action="append", default=[], type=key_value, help="SECTION.KEY=VALUE")


def add_target(
    p: argparse.ArgumentParser, target_help: str = "script path, or module name with -m"
) -> None:
    """``[-m] TARGET ARGS...``: a script (or module) and everything after it, for the script."""
    p.add_argument("-m", "--module", action="store_true", help="TARGET is a module (python -m)")
    p.add_argument("target", nargs="?", help=target_help)
    p.add_argument(
        "args",
        nargs=argparse.REMAINDER,
        help="arguments for the script: meshrun's --section.key=value overrides and the "
        "script's own; after a `--` all are the script's, as written (--trainer.x=1 too)",
    )


def add_network_flags(p: argparse._ActionsContainer) -> None:
    """``--interface`` and ``--join-timeout``: how a multi-node job reaches its peers (``meshrun
    launch`` and ``meshrun bench``; both become ``[launch]`` keys through the same overrides)."""
    p.add_argument(
        "--interface", help="multi-node: network interface (default: the route to the endpoint)"
    )
    p.add_argument(
        "--join-timeout",
        type=float,
        help="multi-node: seconds to wait for all nodes to join (default 300)",
    )


def keep_separator(argv: Sequence[str], a: argparse.Namespace) -> None:
    """Give back the ``--`` argparse drops right after TARGET (``train.py -- --x=1``): it is
    the script's separator (everything after it is the script's own, docs/porting.md), and
    the workers' ``meshrun.init()`` must see it as a ``--`` later in the line would be seen."""
    args, target = getattr(a, "args", None), getattr(a, "target", None)
    if args is None or not target:
        return
    head = len(argv) - len(args)  # REMAINDER: the script's arguments end the line
    if head >= 2 and argv[head - 1] == "--" and argv[head - 2] == target:
        a.args = ["--", *args]


def add_command(
    sub: Subparsers, name: str, fn: Command, help: str, description: str | None = None
) -> argparse.ArgumentParser:
    """``meshrun [GROUP] NAME``: a subcommand that runs ``fn(args)``; the caller adds its flags."""
    p = sub.add_parser(name, help=help, description=description)
    p.set_defaults(fn=fn)
    return p


def add_group(sub: Subparsers, name: str, help: str) -> Subparsers:
    """``meshrun NAME SUBCOMMAND``: a command that only holds subcommands (``slurm submit``)."""
    p = sub.add_parser(name, help=help)
    return p.add_subparsers(dest=f"{name}_cmd", required=True)
