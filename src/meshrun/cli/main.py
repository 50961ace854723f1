"""The ``meshrun`` command line: argparse subcommands, each a few lines calling the library.

Everything that can be checked before a process is spawned is checked before one is: the flags
and the script's path here, the config (keys, types, ranges) as it is read, and the mesh
against the world size, the batch arithmetic and the run directory's claim by launch/prepare.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

from meshrun._version import __version__
from meshrun.cli.args import Subparsers, add_network_flags, add_set, add_target, keep_separator
from meshrun.cli.out import quiet_on_broken_pipe
from meshrun.config import (
    Config,
    ConfigError,
    ConfigWarning,
    load_config,
    resolve_global_batch,
    split_overrides,
    to_toml,
    validate_for_world,
)
from meshrun.demo.steps import steps_overrides
from meshrun.launch.front.request import LaunchRequest, TorchrunFlags
from meshrun.launch.prepare import launch, nproc_per_node
from meshrun.launch.target import DEMO_CONFIG, DEMO_MODULE
from meshrun.runtime.logs import say_error

# --- subcommands ---------------------------------------------------------------------------


def launch_request(a: argparse.Namespace) -> LaunchRequest:
    """``meshrun launch``'s parsed flags as the typed request launch/front/ runs."""
    return LaunchRequest(
        target=a.target,
        module=bool(a.module),
        args=tuple(a.args),
        config=a.config,
        sets=tuple(a.set),
        secret_file=a.secret_file,
        hostfile=a.hostfile,
        ssh_opts=tuple(a.ssh_opt or ()),
        interface=a.interface,
        join_timeout=a.join_timeout,
        replica_groups=a.replica_groups,
        lighthouse=a.lighthouse,
        torchrun=TorchrunFlags.of(vars(a)),
    )


def cmd_launch(a: argparse.Namespace) -> int:
    from meshrun.launch.front.command import run

    request = launch_request(a)
    if a.doctor:  # here, not in launch/: the doctor (diagnose/) stands above launch/
        request = use_doctor_worker(request)
    return run(request, os.environ)


def use_doctor_worker(request: LaunchRequest) -> LaunchRequest:
    """``meshrun launch --doctor``: launch the doctor's worker in place of the script, through
    the same launch path (so every launch flag and config key applies to the check)."""
    from meshrun.diagnose.doctor import WORKER_MODULE

    if request.target and request.target != WORKER_MODULE:
        print(
            f"meshrun launch --doctor: checking the launch only; {request.target} is not run",
            file=sys.stderr,
        )
    # The check must not add to the run's metrics file or draw a progress bar.
    sets = (*request.sets, ("metrics.jsonl", "false"), ("metrics.progress", "false"))
    return dataclasses.replace(request, target=WORKER_MODULE, module=True, sets=sets)


def cmd_demo(a: argparse.Namespace) -> int:
    overrides, _ = split_overrides(a.overrides)
    keys = {key for key, _ in overrides}
    extra = [("job.run_dir", a.run_dir)]
    if a.steps is not None:
        extra.extend(steps_overrides(a.steps, keys))
    cfg = load_config(DEMO_CONFIG, [*extra, *overrides])
    nproc = nproc_per_node(a.nproc, cfg)
    if "data.micro_batch" not in keys:
        from meshrun.demo.batch import fit_micro_batch

        fit_micro_batch(cfg, nproc, keep_global="data.global_batch" in keys)
    script_args = ["--size", a.size]
    return launch(cfg, nproc, None, DEMO_MODULE, script_args)


def cmd_config_show(a: argparse.Namespace) -> int:
    overrides, _ = split_overrides(a.overrides)
    cfg = load_config(a.file, overrides)
    if a.world_size is not None and a.world_size < 1:
        raise ConfigError(f"--world-size {a.world_size} is not allowed: must be >= 1")
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
    "ray": _lazy("meshrun.cli.ray", "add_parser"),
    "lighthouse": _lazy("meshrun.cli.ft", "add_parser"),
    "report": _lazy("meshrun.cli.report", "add_report_parser"),
    "compare": _lazy("meshrun.cli.compare", "add_parser"),
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
    if argv is None:  # the `meshrun` program: its own config warnings in one line each
        warnings.showwarning = _one_line_config_warning(warnings.showwarning)
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


def _one_line_config_warning(show: Callable[..., None]) -> Callable[..., None]:
    """Python prints a warning as its source file and line plus the code there: for a config
    warning that is meshrun's code, not the user's. One ``meshrun: warning:`` line instead
    (each host's line stays whole under a hostfile launch); other warnings go to ``show``."""

    def showwarning(message: Warning | str, category: type[Warning], *args: object) -> None:
        if issubclass(category, ConfigWarning):
            print(f"meshrun: warning: {message}", file=sys.stderr, flush=True)
        else:
            show(message, category, *args)

    return showwarning


def reference_markdown() -> str:
    """docs/cli.md: every command's --help (a test keeps the file equal to this)."""
    from meshrun.cli.doc import markdown

    return markdown(build_parser)
