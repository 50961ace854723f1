"""``meshrun launch`` from its typed request to the job: every step the command takes before
launch/prepare.py's checks of the world, in order, each one's notes on stderr as it goes.

torchrun's ``PET_`` environment defaults, the target and the job secret's file checked, the
config loaded with the overrides among the script's arguments, then either the hostfile (one
launch per host over ssh, launch/hostfile/plan.py) or this node: what torchrun's flags mean
(launch/front/torchrun.py), what a SLURM allocation fills in, the flags over their ``[launch]``
keys, and the launch.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping, MutableMapping
from typing import Any

from meshrun.config import Config, ConfigError, load_config, split_overrides
from meshrun.launch.front.request import LaunchRequest, TorchrunFlags
from meshrun.launch.front.torchrun import (
    apply_launch_flags,
    hostfile_refusal,
    request_keys,
    resolve,
)
from meshrun.launch.target import check_target, default_config
from meshrun.launch.torchrun_flags import FLAGS


def run(request: LaunchRequest, environ: MutableMapping[str, str]) -> int:
    """Check, prepare and run one ``meshrun launch``; its exit status. ``environ``: this
    process's environment (``--secret-file`` is exported in it for every launcher below)."""
    from meshrun.launch.hostfile.plan import launch_from_request
    from meshrun.launch.trust.secret import use_secret_file
    from meshrun.runtime.secret import SecretError

    target = request.target
    if not target:
        raise ConfigError("meshrun launch needs a script (train.py) or -m MODULE")
    flags, notes = env_defaults(request.torchrun, environ)  # PET_NPROC_PER_NODE=8 ...
    request = dataclasses.replace(request, torchrun=flags)
    for note in notes:
        print(f"meshrun launch: {note}", file=sys.stderr)
    check_target(target, request.module_name, flags.no_python)
    try:  # --secret-file: = MESHRUN_JOB_SECRET_FILE for every launcher below, checked now
        if request.secret_file:
            use_secret_file(request.secret_file, environ)
    except SecretError as err:
        raise ConfigError(str(err)) from None
    cfg = _load_config(request)
    if request.hostfile:  # one meshrun launch per listed host, over ssh (docs/hostfile.md)
        if why := hostfile_refusal(flags):
            raise ConfigError(why)
        nproc = flags.nproc_per_node  # a number here: a device word was refused
        # Checked here as on each host; the hostfile decides the topology (hostfile/plan.py).
        keys = request_keys(request, nproc if isinstance(nproc, int) else None)
        apply_launch_flags(cfg, keys, topology=False)
        return launch_from_request(request, cfg, environ)
    if request.ssh_opts:
        raise ConfigError("--ssh-opt configures the ssh to each host: it needs --hostfile FILE")
    return _launch_here(request, cfg, environ)


def env_defaults(
    flags: TorchrunFlags, environ: Mapping[str, str]
) -> tuple[TorchrunFlags, list[str]]:
    """torchrun's ``PET_<FLAG>`` environment defaults (Kubeflow's PyTorchJob sets them) for
    the flags not given on the command line: the flags with them, and a note for each one."""
    notes = []
    taken: dict[str, Any] = {}
    for flag in FLAGS:
        env_name = f"PET_{flag.dest.upper()}"
        text = environ.get(env_name)
        if text is None or flags.value(flag) is not None:
            continue
        try:  # torchrun's reading: a switch is an int (0/1), a value its flag's type
            value = bool(int(text)) if flag.type is None else flag.type(text)
        except ValueError:
            kind = "0 or 1" if flag.type is None else getattr(flag.type, "__name__", "a value")
            raise ConfigError(
                f"{env_name}={text!r} (torchrun's default for {flag.name}) "
                f"is not allowed: expected {kind}"
            ) from None
        if flag.choices and value not in flag.choices:
            raise ConfigError(
                f"{env_name}={text!r} is not allowed: expected one of {', '.join(flag.choices)}"
            )
        if value is not False:  # PET_STANDALONE=0 is the switch left off
            taken[flag.dest] = value
            notes.append(f"{flag.name} {text} from {env_name} (torchrun's environment default)")
    return dataclasses.replace(flags, **taken), notes


def _load_config(request: LaunchRequest) -> Config:
    overrides, _ = split_overrides(list(request.args))
    # --replica-groups N is recorded first, so the other keys are checked against N groups
    # (fault_tolerance.min_replicas = 2 is valid with two groups, not with the default one).
    groups = request.replica_groups
    if groups is not None and groups < 1:
        raise ConfigError(
            f"--replica-groups {groups} is not allowed: must be >= 1 (1 = off, N = N groups of "
            "nproc-per-node / N processes)"
        )
    flag = [("fault_tolerance.replica_groups", str(groups))] if groups and groups > 1 else []
    path = request.config or default_config(request.module_name)
    return load_config(path, [*flag, *request.sets, *overrides])


def _launch_here(request: LaunchRequest, cfg: Config, environ: Mapping[str, str]) -> int:
    from meshrun.launch.prepare import launch, nproc_per_node
    from meshrun.launch.slurm.job import fill_from_allocation

    resolved = resolve(request)  # torchrun's flags: what they mean for this launch
    for note in resolved.notes:
        print(f"meshrun launch: {note}", file=sys.stderr)
    # Inside a SLURM allocation: the topology neither the flags nor the config gave.
    keys = fill_from_allocation(resolved.keys, cfg.launch, environ)
    apply_launch_flags(cfg, keys)
    module = request.module_name
    script = None if module else request.target
    nproc = nproc_per_node(None, cfg)
    return launch(cfg, nproc, script, module, list(request.args), **resolved.spec)
