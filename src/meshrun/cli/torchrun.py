"""torchrun's flags on ``meshrun launch``'s command line, added to its parser from the table in
launch/torchrun_flags.py. What a parsed set of them means for the launch (rendezvous, output
streams, node count, what cannot go with --hostfile) is launch/front/torchrun.py's.
"""

from __future__ import annotations

import argparse
from typing import Any

from meshrun.launch.torchrun_flags import FLAGS, METAVARS, Flag


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Every flag of the table on ``p`` (a group in --help); unset flags stay None."""
    group = p.add_argument_group(
        "torchrun's flags",
        "every torchrun flag, in both spellings (--nproc-per-node or --nproc_per_node), with "
        "torchrun's meaning (docs/launch.md: torchrun compatibility)",
    )
    add_replica_arguments(p)
    for flag in FLAGS:
        _add_flag(group, flag)


# The torchrun flags that place one node in a multi-node job (``meshrun bench`` takes them too).
NODE_FLAGS = ("nnodes", "node_rank", "rdzv_endpoint", "rdzv_id")


def add_node_arguments(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The table's :data:`NODE_FLAGS`, spelled and checked as on ``meshrun launch`` (unset:
    None); launch/front/request.py's ``apply_launch_flags`` turns them into ``[launch]`` keys."""
    group = p.add_argument_group("multi-node (as meshrun launch; docs/launch.md)")
    for flag in FLAGS:
        if flag.dest in NODE_FLAGS:
            _add_flag(group, flag)
    return group


def _add_flag(group: Any, flag: Flag) -> None:
    if flag.type is None:
        group.add_argument(
            *flag.options, dest=flag.dest, action="store_true", default=None, help=flag.help
        )
        return
    group.add_argument(
        *flag.options,
        dest=flag.dest,
        type=flag.type,
        choices=flag.choices,
        metavar=None if flag.choices else METAVARS.get(flag.dest, "NAME"),
        help=flag.help,
    )


def add_replica_arguments(p: argparse.ArgumentParser) -> None:
    """meshrun's own flags for replica-group fault tolerance (docs/fault_tolerance.md)."""
    group = p.add_argument_group(
        "replica groups (torchft)",
        "split the processes into groups that survive each other's failures "
        "(docs/fault_tolerance.md)",
    )
    group.add_argument(
        "--replica-groups",
        type=int,
        default=None,
        metavar="N",
        help="N replica groups of nproc-per-node / N processes each, each its "
        "own torchrun job (1 = off); without it, fault_tolerance.replica_groups > 1 makes "
        "this launch one group of that many (one launch per group)",
    )
    group.add_argument(
        "--lighthouse",
        default=None,
        metavar="HOST:PORT",
        help="torchft's lighthouse (`meshrun lighthouse`); default: meshrun "
        "starts one on loopback for this job",
    )
