"""A launch prepared before any process is spawned, from the typed :class:`LaunchSpec`: the
checks of the world (the layout against its size, the checkpoint to resume), the values left
unset that are derived here (the global batch, a resumed run's batch, the run directory), the
split of this node's processes into replica groups, the run directory claimed for one job,
and the resolved config the workers will read. ``meshrun launch``, ``meshrun demo`` and
``meshrun ray launch`` prepare through here; the command line only parses and prints.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

from meshrun.config import (
    Config,
    ConfigError,
    resolve_global_batch,
    set_value,
    validate_for_world,
    write_config,
)
from meshrun.launch.multinode.records import JoinTarget
from meshrun.launch.spec import LaunchSpec

__all__ = ["group_nproc", "launch", "nproc_per_node", "prepare", "resolve"]


def prepare(cfg: Config, nproc: int, nodes: JoinTarget) -> Path:
    """Validate for the world size and write the resolved config the workers will read: what
    was left unset and is derived here (global batch, run directory) is written as the number
    or path it became, and said on stderr. ``nodes``: N or MIN:MAX (``meshrun ray launch``'s
    workers as one-process nodes)."""
    resolve(cfg, nproc, nodes)
    return write_config(cfg, cfg.resolved_run_dir() / "config.toml")


def resolve(cfg: Config, nproc: int, nodes: JoinTarget) -> None:
    """:func:`prepare` up to the write: every check, and the values derived."""
    world = nproc * nodes.max_nodes  # an elastic MIN:MAX job: its largest world
    validate_for_world(cfg, world)
    from meshrun.checkpoint.on_disk import resume_path_error  # pure: no torch import

    if why := resume_path_error(cfg.checkpoint.resume):  # before any process is spawned
        raise ConfigError(why)
    _resolve_batch(cfg, nproc, nodes)
    if not cfg.job.run_dir:  # a directory appears in the cwd: say where and how to move it
        cfg.job.run_dir = str(cfg.resolved_run_dir())
        print(
            f"meshrun launch: job.run_dir unset: the run writes its config, logs, metrics and "
            f"checkpoints to {cfg.job.run_dir} (in {Path.cwd()}); set --job.run_dir=DIR to "
            "change it",
            file=sys.stderr,
        )


def _resolve_batch(cfg: Config, nproc: int, nodes: JoinTarget) -> None:
    """An unset global batch becomes a number, said on stderr: the one of the checkpoint the
    run resumes (kept on a new world size), else micro_batch x data-parallel size. An elastic
    MIN:MAX job gets one number for every world it may take after a restart: its largest
    world's, or, where a smaller world's size does not divide that, the lcm's."""
    from meshrun.checkpoint.resumed_batch import resume_global_batch  # pure: no torch import

    low, high = nodes.min_nodes, nodes.max_nodes
    worlds = [nproc * n for n in range(low, high + 1)] or [nproc * high]
    if note := resume_global_batch(cfg):
        print(f"meshrun launch: {note}", file=sys.stderr)
        validate_for_world(cfg, nproc * high)  # the saved number must divide here too
    elif note := resolve_global_batch(cfg, worlds):
        elastic = f" over the worlds of --nnodes {nodes.text}" if len(worlds) > 1 else ""
        print(f"meshrun launch: {note}{elastic}", file=sys.stderr)


def launch(
    cfg: Config,
    nproc: int,
    script: str | None,
    module: str | None,
    script_args: list[str],
    **spec_fields: Any,  # more LaunchSpec fields (meshrun launch: torchrun's flags)
) -> int:
    """Check and resolve ``cfg`` for ``nproc`` processes per node, claim its run directory,
    write the resolved config there and run the job through torchrun's agent."""
    from meshrun.launch.agent.local import launch_local
    from meshrun.launch.multinode.nodes import shared_digest, shared_settings
    from meshrun.launch.rundir import claim_run_dir

    set_value(cfg, "launch.nproc_per_node", nproc)  # the resolved config records the count
    # The [launch] text parsed here, once, for everything below (the checks of the world too).
    spec = LaunchSpec.of(cfg.launch, procs_per_node=nproc, **spec_fields)
    resolve(cfg, group_nproc(cfg, spec), spec.rendezvous.nodes)
    run_dir = cfg.resolved_run_dir()
    config_path = run_dir / "config.toml"
    spec = dataclasses.replace(  # what to run, and the resolved config's digest and path
        spec,
        script=script,
        module=module,
        script_args=script_args,
        config_digest=shared_digest(cfg),
        shared_config=shared_settings(cfg),
        config_path=str(config_path),
        run_dir=str(run_dir),
    )
    # One job per run directory: a busy one is refused before anything is written in it.
    with claim_run_dir(run_dir, spec.rendezvous):
        write_config(cfg, config_path)
        return launch_local(spec)


def group_nproc(cfg: Config, spec: LaunchSpec) -> int:
    """The processes per node of one replica group, which the layout and the derived global
    batch are checked against. ``--replica-groups N`` splits this node's processes into N
    groups (and records N in the config); without it, ``fault_tolerance.replica_groups > 1``
    makes this launch one group of that many, started once per group (each with its own
    ``group_index``)."""
    groups, nproc = spec.replica_groups, spec.procs_per_node
    if groups <= 1:
        return nproc
    if nproc % groups:
        raise ConfigError(
            f"--replica-groups {groups} does not divide --nproc-per-node {nproc}: each group "
            f"gets nproc-per-node / N processes; use a divisor of {nproc}"
        )
    if spec.rendezvous.nodes.max_nodes != 1:
        raise ConfigError(
            f"--replica-groups starts every group on this node, but --nnodes is "
            f"{cfg.launch.nnodes!r}: across nodes start one `meshrun launch` per group with "
            "--lighthouse HOST:PORT and --fault_tolerance.group_index=G "
            "(docs/fault_tolerance.md)"
        )
    set_value(cfg, "fault_tolerance.replica_groups", groups)
    return nproc // groups


def nproc_per_node(flag: int | None, cfg: Config) -> int:
    """Processes per node: ``flag``, else ``launch.nproc_per_node``, else GPUs (else 2)."""
    from meshrun.launch.agent.local import default_nproc_per_node

    n = flag if flag is not None else cfg.launch.nproc_per_node or default_nproc_per_node()
    if n < 1:
        raise ConfigError(f"--nproc-per-node {n} is not allowed: must be >= 1")
    return n
