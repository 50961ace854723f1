"""The ``meshrun`` command line: argparse subcommands, each a few lines calling the library.

Everything that can be checked before a process is spawned is checked here: the config (keys,
types, ranges), the mesh against the world size, the batch arithmetic, the script's path.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from meshrun._version import __version__
from meshrun.cli.args import Subparsers, add_network_flags, add_set, add_target, keep_separator
from meshrun.cli.out import quiet_on_broken_pipe
from meshrun.cli.torchrun import apply_launch_flags as apply_launch_flags
from meshrun.cli.torchrun import launch_flag_overrides as launch_flag_overrides
from meshrun.config import (
    Config,
    ConfigError,
    dp_size_for_world,
    load_config,
    resolve_global_batch,
    set_value,
    split_overrides,
    to_toml,
    validate_for_world,
    write_config,
)
from meshrun.launch.multinode.handshake import JoinTarget
from meshrun.launch.spec import LaunchSpec, parse_nnodes
from meshrun.launch.target import DEMO_CONFIG, DEMO_MODULE, default_config
from meshrun.runtime.logs import say_error


def _prepare(cfg: Config, nproc: int, nnodes: str) -> Path:
    """Validate for the world size and write the resolved config the workers will read: what
    was left unset and is derived here (global batch, run directory) is written as the number
    or path it became, and said on stderr. ``nnodes``: N or MIN:MAX (``meshrun ray launch``'s
    workers as one-process nodes)."""
    _resolve(cfg, nproc, parse_nnodes(nnodes))
    return write_config(cfg, cfg.resolved_run_dir() / "config.toml")


def _resolve(cfg: Config, nproc: int, nodes: JoinTarget) -> None:
    """:func:`_prepare` up to the write: every check, and the values derived."""
    world = nproc * nodes.max_nodes  # an elastic MIN:MAX job: its largest world
    validate_for_world(cfg, world)
    from meshrun.checkpoint.layout import resume_path_error  # pure: no torch import

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


def _launch(
    cfg: Config,
    nproc: int,
    script: str | None,
    module: str | None,
    script_args: list[str],
    **spec_fields: Any,  # more LaunchSpec fields (meshrun launch: torchrun's flags)
) -> int:
    from meshrun.launch.local import launch_local
    from meshrun.launch.multinode.nodes import shared_digest, shared_settings
    from meshrun.launch.rundir import claim_run_dir

    set_value(cfg, "launch.nproc_per_node", nproc)  # the resolved config records the count
    # The [launch] text parsed here, once, for everything below (the checks of the world too).
    spec = LaunchSpec.of(cfg.launch, procs_per_node=nproc, **spec_fields)
    _resolve(cfg, _group_nproc(cfg, nproc, spec_fields), spec.rendezvous.nodes)
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


def _group_nproc(cfg: Config, nproc: int, spec_fields: Mapping[str, Any]) -> int:
    """The processes per node of one replica group, which the layout and the derived global
    batch are checked against. ``--replica-groups N`` splits this node's processes into N
    groups (and records N in the config); without it, ``fault_tolerance.replica_groups > 1``
    makes this launch one group of that many, started once per group (each with its own
    ``group_index``)."""
    groups = int(spec_fields.get("replica_groups") or 0)
    if groups <= 1:
        return nproc
    if nproc % groups:
        raise ConfigError(
            f"--replica-groups {groups} does not divide --nproc-per-node {nproc}: each group "
            f"gets nproc-per-node / N processes; use a divisor of {nproc}"
        )
    if cfg.launch.nnodes != "1":
        raise ConfigError(
            f"--replica-groups starts every group on this node, but --nnodes is "
            f"{cfg.launch.nnodes!r}: across nodes start one `meshrun launch` per group with "
            "--lighthouse HOST:PORT and --fault_tolerance.group_index=G "
            "(docs/fault_tolerance.md)"
        )
    set_value(cfg, "fault_tolerance.replica_groups", groups)
    return nproc // groups


def _nproc(flag: int | None, cfg: Config) -> int:
    from meshrun.launch.local import default_nproc_per_node

    n = flag if flag is not None else cfg.launch.nproc_per_node or default_nproc_per_node()
    if n < 1:
        raise ConfigError(f"--nproc-per-node {n} is not allowed: must be >= 1")
    return n


# --- subcommands ---------------------------------------------------------------------------


def cmd_launch(a: argparse.Namespace) -> int:
    from meshrun.cli import torchrun as cli_torchrun

    if a.doctor:
        from meshrun.cli.diagnose import use_doctor_worker

        use_doctor_worker(a)
    target = a.target
    if not target:
        raise ConfigError("meshrun launch needs a script (train.py) or -m MODULE")
    module = target if a.module else None
    for note in cli_torchrun.env_defaults(a, os.environ):  # PET_NPROC_PER_NODE=8 ...
        print(f"meshrun launch: {note}", file=sys.stderr)
    _check_target(target, module, a.no_python)
    if a.secret_file:  # = MESHRUN_JOB_SECRET_FILE for every launcher below, checked now
        _use_secret_file(a.secret_file)
    args = list(a.args)
    overrides, _ = split_overrides(args)
    # --replica-groups N is recorded first, so the other keys are checked against N groups
    # (fault_tolerance.min_replicas = 2 is valid with two groups, not with the default one).
    groups = getattr(a, "replica_groups", None) or 0
    flag = [("fault_tolerance.replica_groups", str(groups))] if groups > 1 else []
    cfg = load_config(a.config or default_config(module), [*flag, *a.set, *overrides])
    if a.hostfile:  # one meshrun launch per listed host, over ssh (docs/hostfile.md)
        from meshrun.cli.launch import launch_from_args

        if why := cli_torchrun.hostfile_refusal(a):
            raise ConfigError(why)
        # Checked here as on each host; the hostfile decides the topology (cli/launch.py).
        apply_launch_flags(cfg, a, topology=False)
        return launch_from_args(a, cfg)
    if a.ssh_opt:
        raise ConfigError("--ssh-opt configures the ssh to each host: it needs --hostfile FILE")
    torchrun = cli_torchrun.resolve(a)  # torchrun's flags: what they mean for this launch
    for note in torchrun.notes:
        print(f"meshrun launch: {note}", file=sys.stderr)
    a.nproc_per_node = torchrun.nproc_per_node
    for key, value in torchrun.launch_flags.items():  # --standalone, --master-addr/port
        setattr(a, key, value)
    _maybe_from_slurm(cfg, a)  # inside an allocation: unset topology flags from SLURM
    apply_launch_flags(cfg, a)
    script = None if module else target
    nproc = _nproc(None, cfg)
    return _launch(cfg, nproc, script, module, args, **torchrun.spec)


def _check_target(target: str, module: str | None, no_python: bool | None) -> None:
    import shutil

    if module is not None or Path(target).is_file():
        return
    if no_python and shutil.which(target):  # --no-python: a program, found as torchrun would
        return
    what = "program" if no_python else "script"
    raise ConfigError(f"{what} {target!r} does not exist")


def _use_secret_file(path: str) -> None:
    from meshrun.launch.secret import use_secret_file
    from meshrun.runtime.secret import SecretError

    try:
        use_secret_file(path, os.environ)
    except SecretError as err:
        raise ConfigError(str(err)) from None


def _maybe_from_slurm(cfg: Config, a: argparse.Namespace) -> None:
    import os

    from meshrun.launch.slurm.job import apply_to_launch

    apply_to_launch(a, cfg.launch, os.environ)


def cmd_demo(a: argparse.Namespace) -> int:
    overrides, _ = split_overrides(a.overrides)
    extra = [("job.run_dir", a.run_dir)]
    if a.steps is not None:
        extra.append(("optim.steps", str(a.steps)))
    cfg = load_config(DEMO_CONFIG, [*extra, *overrides])
    nproc = _nproc(a.nproc, cfg)
    keys = {key for key, _ in overrides}
    if "data.micro_batch" not in keys:
        _fit_micro_batch(cfg, nproc, keep_global="data.global_batch" in keys)
    script_args = ["--size", a.size]
    return _launch(cfg, nproc, None, DEMO_MODULE, script_args)


def _fit_micro_batch(cfg: Config, nproc: int, keep_global: bool = False) -> None:
    """Fit the demo's batch to any process count, said aloud, never silently: lower the
    micro-batch so the global batch divides; where none does (3, 6, 7 ... processes for 32),
    take the largest global batch up to the configured one that micro_batch (<= the
    configured) x data-parallel size x accumulation makes (demo.toml). A global batch the user
    passed is kept: then validation names what does not divide."""
    g, m = cfg.data.global_batch, cfg.data.micro_batch
    dp = dp_size_for_world(cfg, nproc)
    chunks = cfg.parallel.pp_microbatches if cfg.parallel.pp > 1 else 1  # micro splits in them
    micros = [k for k in range(m, 0, -1) if k % chunks == 0] or [m]
    fits = [k for k in micros if g % (k * dp) == 0]
    if fits or keep_global:
        if fits and fits[0] != m:
            print(
                f"meshrun demo: data.micro_batch {m} -> {fits[0]} so that the global batch {g} "
                f"divides over {dp} data-parallel processes",
                file=sys.stderr,
            )
            cfg.data.micro_batch = fits[0]
        return
    # (global batch, micro) pairs at most g, the largest global batch first, then the largest
    # micro-batch; one smallest micro-batch per rank when even that is more than g.
    pairs = [(k * dp * (g // (k * dp)), k) for k in micros if k * dp <= g]
    new_g, k = max(pairs) if pairs else (micros[-1] * dp, micros[-1])
    print(
        f"meshrun demo: data.global_batch {g} -> {new_g}, data.micro_batch {m} -> {k} "
        f"(accumulation {new_g // (k * dp)}): no micro_batch <= {m} splits {g} samples over "
        f"{dp} data-parallel processes; pass --data.global_batch=N to choose",
        file=sys.stderr,
    )
    cfg.data.global_batch, cfg.data.micro_batch = new_g, k


def cmd_config_show(a: argparse.Namespace) -> int:
    overrides, _ = split_overrides(a.overrides)
    cfg = load_config(a.file, overrides)
    if a.world_size:  # what meshrun launch would write for this world
        validate_for_world(cfg, a.world_size)
        if note := resolve_global_batch(cfg, [a.world_size]):
            print(f"meshrun config show: {note}", file=sys.stderr)
    sys.stdout.write(to_toml(cfg))
    return 0


def cmd_config_init(a: argparse.Namespace) -> int:
    path = Path(a.path)
    if path.exists() and not a.force:
        raise ConfigError(f"{path} already exists; pass --force to overwrite it")
    path.write_text(
        "# meshrun configuration. Every key can be overridden: --section.key=value\n\n"
        + to_toml(Config(), comments=True)
    )
    print(f"wrote {path}")
    return 0


# --- parser --------------------------------------------------------------------------------


def _add_launch(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "launch",
        help="run a training script on this node through the torchrun elastic agent",
        description="Run SCRIPT (or -m MODULE) in N processes with torch.distributed.run. "
        "Arguments after the script go to it; --section.key=value among them override the "
        "config, which is validated before any process starts.",
    )
    add_network_flags(p)
    p.add_argument(
        "--hostfile",
        metavar="FILE",
        help="start this launch on every host of FILE over ssh (docs/hostfile.md)",
    )
    p.add_argument(
        "--ssh-opt",
        action="append",
        metavar="KEY=VALUE",
        help="with --hostfile: an ssh -o option (repeatable); more ssh arguments: $MESHRUN_SSH",
    )
    p.add_argument(
        "--secret-file",
        metavar="PATH",
        help="the job secret: a file only you can read (chmod 600), the same on every node; "
        "as MESHRUN_JOB_SECRET_FILE (default: RUN_DIR/job.secret; docs/security.md)",
    )
    p.add_argument("--config", help="TOML config file")
    add_set(p)
    p.add_argument(
        "--doctor",
        action="store_true",
        help="run meshrun doctor on every rank of this launch instead of the script",
    )
    from meshrun.cli.torchrun import add_arguments as add_torchrun_flags

    add_torchrun_flags(p)
    add_target(p)
    p.set_defaults(fn=cmd_launch)


def _add_demo(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "demo",
        help="train a small byte-level GPT on the Python stdlib in several processes",
        description="A real multi-process training job with nothing to download.",
    )
    p.add_argument("--nproc", type=int, help="processes (default: GPUs, else 2)")
    p.add_argument(
        "--steps", type=int, help="optimizer steps (default 150, about 2 min on 2 CPU cores)"
    )
    p.add_argument("--run-dir", default="runs/demo", help="output directory (default runs/demo)")
    p.add_argument("--size", default="small", choices=["tiny", "small"], help="model size")
    p.set_defaults(fn=cmd_demo)
    p.epilog = "Any --section.key=value argument overrides the demo's config."


def _add_config(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("config", help="show the effective config or write a template")
    csub = p.add_subparsers(dest="config_cmd", required=True)
    show = csub.add_parser("show", help="print the effective config (file + overrides)")
    show.add_argument("file", nargs="?", help="TOML config file")
    show.add_argument("--world-size", type=int, help="also validate for this many processes")
    show.epilog = "Any --section.key=value argument overrides the file."
    show.set_defaults(fn=cmd_config_show)
    init = csub.add_parser("init", help="write a commented config template")
    init.add_argument("path", nargs="?", default="meshrun.toml")
    init.add_argument("--force", action="store_true", help="overwrite an existing file")
    init.set_defaults(fn=cmd_config_init)


def _add_ray_launch(sub: Subparsers) -> None:
    from meshrun.cli.ray import add_parser

    add_parser(sub, prepare=_prepare)  # the launch layer cannot import this module's _prepare


def _lazy(module: str, name: str) -> Callable[[Subparsers], None]:
    """A subsystem's ``add_*(sub)``, imported when called: ``meshrun launch`` then loads only
    its own command's modules (the other commands' cost 0.3 s of CPU, measured)."""

    def add(sub: Subparsers) -> None:
        getattr(importlib.import_module(module), name)(sub)

    return add


# Each command and the function that adds it; the order is the order of --help.
SUBCOMMANDS: dict[str, Callable[[Subparsers], None]] = {
    "demo": _add_demo,
    "launch": _add_launch,
    "config": _add_config,
    "data": _lazy("meshrun.cli.data", "add_parser"),
    "plan": _lazy("meshrun.cli.plan", "add_parser"),
    "bench": _lazy("meshrun.cli.diagnose", "add_bench_parser"),
    "ckpt": _lazy("meshrun.cli.ckpt", "add_parser"),
    "doctor": _lazy("meshrun.cli.diagnose", "add_doctor_parser"),
    "slurm": _lazy("meshrun.cli.launch", "add_slurm_parser"),
    "k8s": _lazy("meshrun.cli.launch", "add_k8s_parser"),
    "ray": _add_ray_launch,
    "lighthouse": _lazy("meshrun.cli.ft", "add_parser"),
    "report": _lazy("meshrun.cli.report", "add_report_parser"),
    "scale-test": _lazy("meshrun.cli.diagnose", "add_scale_parser"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; with ``command`` (one of SUBCOMMANDS) only that command's flags, the
    others by name alone: parsing, usage lines and errors are the same for that command."""
    p = argparse.ArgumentParser(prog="meshrun", description="PyTorch from one GPU to many.")
    p.add_argument("--version", action="version", version=f"meshrun {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    for name, add in SUBCOMMANDS.items():
        if command in (None, name):
            add(sub)
        else:
            sub.add_parser(name)
    return p


def _take_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    # argparse would read `--optim.lr=1` as an unknown option: `demo` and `config show` take
    # their overrides out first (launch leaves them to its script's arguments).
    head = 1 if argv[:1] == ["demo"] else 2 if argv[:2] == ["config", "show"] else 0
    if not head:
        return argv, []
    pairs, rest = split_overrides(argv[head:])
    return argv[:head] + rest, [f"--{k}={v}" for k, v in pairs]


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    # Only the command's own parser when one is named (--help and errors before it: all).
    parser = build_parser(args_list[0] if args_list[:1] and args_list[0] in SUBCOMMANDS else None)
    try:
        rest, overrides = _take_overrides(args_list)
        a = parser.parse_args(rest)
        keep_separator(rest, a)
        a.overrides = overrides
        # Every command's output may go into `| head`: no BrokenPipe traceback (cli/out.py).
        return int(quiet_on_broken_pipe(a.fn)(a))
    except ConfigError as e:
        command = args_list[0] if args_list else ""
        say_error(command, e)
        return 2
    finally:
        if argv is None:  # the `meshrun` program, about to exit (not a caller in-process)
            # With torch loaded, the interpreter's final collections cost 0.5 s of CPU on this
            # machine (measured) after the job ended; torchrun pays them, frozen objects skip.
            gc.freeze()


def reference_markdown() -> str:
    """docs/cli.md: every command's --help (a test keeps the file equal to this)."""
    from meshrun.cli.doc import markdown

    return markdown(build_parser)
