"""``meshrun compare [--nproc N] [--steps K] [--layout KEY=VAL,...]... SCRIPT [args]``: the
flags of diagnose/compare_launch.py's :func:`run_compare`."""

from __future__ import annotations

import argparse
from pathlib import Path

from meshrun.cli.args import Subparsers, add_command
from meshrun.diagnose.compare_launch import DEFAULT_LAYOUTS, CompareSpec, run_compare


def cmd_compare(a: argparse.Namespace) -> int:
    spec = CompareSpec(
        script=a.script,
        script_args=list(a.args),
        nproc=a.nproc,
        steps=a.steps,
        layouts=a.layout or list(DEFAULT_LAYOUTS),
        tolerance=a.tolerance,
        out=Path(a.out) if a.out else None,
        config=a.config,
    )
    return run_compare(spec)


def add_parser(sub: Subparsers) -> None:
    p = add_command(
        sub,
        "compare",
        cmd_compare,
        help="check a script under parallel layouts: its losses, parameters and gradients "
        "against one process's, step by step",
        description="Run SCRIPT for K optimizer steps on one process, then under each layout "
        "on N processes (through meshrun launch, one run at a time), with the same global "
        "batch, seed and data; print per layout each step's relative loss difference, the "
        "first step beyond the tolerance and there the parameters whose values or gradients "
        "differ most. Exit 0 when every layout agrees, 1 otherwise, 2 on bad input. The "
        "script must be deterministic: docs/porting.md, 'Checking your port'.",
    )
    p.add_argument("--nproc", type=int, default=2, help="processes of each layout (default 2)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps compared (default 3)")
    p.add_argument(
        "--layout",
        action="append",
        metavar="KEY=VAL,...",
        help="a layout in meshrun plan's syntax: zero=3, tp=2, pp=2,schedule=1f1b, "
        "dp_replicate=2,zero=3 (repeatable; default: zero=0 and zero=3)",
    )
    p.add_argument(
        "--tolerance",
        type=float,
        default=1e-5,
        help="largest relative loss difference that agrees (default 1e-5, for fp32)",
    )
    p.add_argument("--out", help="directory for the runs (default: a new temporary directory)")
    p.add_argument("--config", help="TOML config file, as meshrun launch --config")
    p.add_argument("script", help="the training script")
    p.add_argument(
        "args",
        nargs=argparse.REMAINDER,
        help="arguments for the script: meshrun's --section.key=value overrides and its own",
    )
