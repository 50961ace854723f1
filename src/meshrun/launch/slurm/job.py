"""SLURM: ``meshrun launch`` inside an allocation, and ``meshrun slurm submit``.

Inside a job (``SLURM_JOB_ID`` set, one task per node, e.g. ``srun --ntasks-per-node=1 meshrun
launch train.py``) meshrun derives what torchrun needs from SLURM's variables: nodes, this
node's rank, processes per node (GPUs, or ``--nproc-per-node``), the master address (first
host of ``scontrol show hostnames``) and a port from the job id, and checks them against the
allocation before any process starts. ``meshrun slurm submit`` writes an sbatch script that
does exactly that (launch/slurm/submit.py). Both are built from pure functions over an
environment dict, unit-tested without SLURM (tests/unit/test_slurm_topology.py).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TypeVar

from meshrun.config import ConfigError, LaunchConfig
from meshrun.launch.multinode.records import JoinTarget
from meshrun.launch.spec import LaunchKeys, parse_nnodes
from meshrun.runtime.launcher_env import expand_hostlist, slurm_port

DISABLE_ENV = "MESHRUN_SLURM"  # "0": ignore the allocation, launch as on a plain machine
T = TypeVar("T")


class SlurmError(ConfigError):
    """The SLURM allocation and the launch disagree (names the variable and the fix)."""


# --- inside an allocation: derive the topology ---------------------------------------------


@dataclass(frozen=True)
class Topology:
    """What ``meshrun launch`` hands to torchrun on this node, and where each value came from."""

    job_id: str
    nnodes: str
    node_rank: int
    nproc_per_node: int
    master_addr: str
    rdzv_endpoint: str  # "" on one node: the launcher's loopback rendezvous
    rdzv_id: str
    sources: dict[str, str] = field(default_factory=dict)  # key -> "SLURM_NODEID=1" etc.
    notes: list[str] = field(default_factory=list)  # explicit flags that disagree with SLURM

    def line(self) -> str:
        """The one line ``meshrun launch`` prints about what it derived."""
        src = self.sources
        rdzv = self.rdzv_endpoint or "127.0.0.1 (one node)"
        return (
            f"meshrun launch: SLURM job {self.job_id}: nnodes {self.nnodes} ({src['nnodes']}), "
            f"node_rank {self.node_rank} ({src['node_rank']}), nproc_per_node "
            f"{self.nproc_per_node} ({src['nproc_per_node']}), master {self.master_addr} "
            f"({src['master_addr']}), rendezvous {rdzv}"
        )


def in_allocation(env: Mapping[str, str]) -> bool:
    """True inside a SLURM job, unless already under torchrun or disabled by MESHRUN_SLURM=0."""
    return (
        "SLURM_JOB_ID" in env
        and "TORCHELASTIC_RUN_ID" not in env
        and env.get(DISABLE_ENV, "1") != "0"
    )


def scontrol_hostnames(nodelist: str) -> list[str]:
    """``scontrol show hostnames NODELIST`` (SLURM's own expansion, the reference)."""
    out = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    return out.split()


def derive(
    env: Mapping[str, str],
    given: LaunchKeys,
    cpu_default: int | Callable[[], int] = 2,
    hostnames: Callable[[str], list[str]] = scontrol_hostnames,
) -> Topology:
    """The launch topology of this node from SLURM's variables; errors before any spawn."""
    job_id = env["SLURM_JOB_ID"]
    in_step = "SLURM_STEP_ID" in env  # absent in the batch script itself
    sources: dict[str, str] = {}
    notes: list[str] = []
    nnodes_slurm, sources["nnodes"] = _nnodes(env, in_step)
    _check_batch_shell(in_step, nnodes_slurm)
    _check_tasks_per_node(env, in_step)
    nnodes = _explicit_nnodes(given.nnodes, nnodes_slurm, sources, notes)
    rank_slurm = _int(env, "SLURM_NODEID") if "SLURM_NODEID" in env else 0
    sources["node_rank"] = f"SLURM_NODEID={rank_slurm}" if "SLURM_NODEID" in env else "default"
    node_rank = _explicit(given.node_rank, rank_slurm, "--node-rank", sources, "node_rank", notes)
    nproc = _nproc(env, given.nproc_per_node, cpu_default, sources, notes)
    _check_cpus(env, nproc)
    master, sources["master_addr"] = _master(env, in_step, hostnames)
    one_node = parse_nnodes(nnodes).max_nodes == 1  # N or MIN:MAX: "1:1" is one node too
    endpoint = "" if one_node else f"{master}:{slurm_port(job_id)}"
    endpoint = _explicit(given.rdzv_endpoint, endpoint, "--rdzv-endpoint", {}, "", notes)
    rdzv_id = given.rdzv_id or f"slurm-{job_id}"
    return Topology(job_id, nnodes, node_rank, nproc, master, endpoint, rdzv_id, sources, notes)


def _nnodes(env: Mapping[str, str], in_step: bool) -> tuple[int, str]:
    # In a step, the step's nodes are the job's nodes for this launch (srun -N1 in a 2-node job).
    names = ["SLURM_STEP_NUM_NODES"] if in_step else []
    names += ["SLURM_JOB_NUM_NODES", "SLURM_NNODES"]
    for name in names:
        if name in env:
            return _int(env, name), f"{name}={env[name]}"
    return 1, "default"


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise SlurmError(f"SLURM variable {name}={env[name]!r} is not an integer") from None


def _check_batch_shell(in_step: bool, nnodes: int) -> None:
    if not in_step and nnodes > 1:
        raise SlurmError(
            f"meshrun launch runs in the batch script of a {nnodes}-node SLURM job "
            "(SLURM_STEP_ID is not set), so only the first node would start and the others "
            "would never join; run it once per node: srun --ntasks-per-node=1 meshrun launch ..."
        )


def tasks_per_node(spec: str) -> list[int]:
    """SLURM's compressed counts: ``"2(x3),1"`` -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise SlurmError(f"cannot read SLURM tasks-per-node {spec!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def _check_tasks_per_node(env: Mapping[str, str], in_step: bool) -> None:
    # In the batch script meshrun launch runs once whatever the job's tasks; in a step, once
    # per task, and each one would start its own group of workers.
    if not in_step:
        return
    name = "SLURM_STEP_TASKS_PER_NODE" if "SLURM_STEP_TASKS_PER_NODE" in env else ""
    name = name or ("SLURM_TASKS_PER_NODE" if "SLURM_TASKS_PER_NODE" in env else "")
    if not name:
        return
    counts = tasks_per_node(env[name])
    if any(c != 1 for c in counts):
        raise SlurmError(
            f"{name}={env[name]}: SLURM starts {max(counts)} tasks on a node and each would run "
            "its own meshrun launch (which starts the worker processes itself); run one task "
            "per node: srun --ntasks-per-node=1 (or #SBATCH --ntasks-per-node=1), and set the "
            "processes with --nproc-per-node"
        )


def _explicit_nnodes(
    flag: str | None, slurm: int, sources: dict[str, str], notes: list[str]
) -> str:
    """``--nnodes`` over SLURM's count, compared as node ranges (``2:2`` is SLURM's 2)."""
    if flag is None:
        return str(slurm)
    if parse_nnodes(flag) != JoinTarget(slurm, slurm):
        notes.append(f"--nnodes {flag} given; SLURM says {slurm}: using --nnodes")
    sources["nnodes"] = "--nnodes"
    return flag


def _explicit(
    flag: T | None, derived: T, name: str, sources: dict[str, str], key: str, notes: list[str]
) -> T:
    if flag is None:
        return derived
    if derived != "" and flag != derived:
        notes.append(f"{name} {flag} given; SLURM says {derived}: using {name}")
    if key:
        sources[key] = name
    return flag


def visible_gpus(env: Mapping[str, str]) -> tuple[int, str] | None:
    """GPUs SLURM gives this node: SLURM_GPUS_ON_NODE, else the CUDA_VISIBLE_DEVICES count."""
    if env.get("SLURM_GPUS_ON_NODE", "").isdigit():
        return int(env["SLURM_GPUS_ON_NODE"]), f"SLURM_GPUS_ON_NODE={env['SLURM_GPUS_ON_NODE']}"
    devices = env.get("CUDA_VISIBLE_DEVICES", "")
    if devices and devices != "NoDevFiles":
        n = len([d for d in devices.split(",") if d.strip()])
        return n, f"CUDA_VISIBLE_DEVICES={devices}"
    return None


def _nproc(
    env: Mapping[str, str],
    flag: int | None,
    cpu_default: int | Callable[[], int],
    sources: dict[str, str],
    notes: list[str],
) -> int:
    gpus = visible_gpus(env)
    if flag is None:
        if gpus:
            n, sources["nproc_per_node"] = gpus
            return n
        sources["nproc_per_node"] = "no GPUs: CPU default"
        return cpu_default() if callable(cpu_default) else cpu_default
    sources["nproc_per_node"] = "--nproc-per-node"
    if gpus and flag > gpus[0]:
        raise SlurmError(
            f"--nproc-per-node {flag} but SLURM gives this node {gpus[0]} GPUs ({gpus[1]}): "
            f"use --nproc-per-node {gpus[0]} or fewer, or request more GPUs "
            "(#SBATCH --gpus-per-node)"
        )
    if gpus and flag != gpus[0]:
        notes.append(f"--nproc-per-node {flag} given; SLURM gives {gpus[0]} GPUs ({gpus[1]})")
    return flag


def _check_cpus(env: Mapping[str, str], nproc: int) -> None:
    cpus = env.get("SLURM_CPUS_ON_NODE", "")
    if cpus.isdigit() and nproc > int(cpus):
        raise SlurmError(
            f"{nproc} processes per node but SLURM gives this node {cpus} CPUs "
            f"(SLURM_CPUS_ON_NODE={cpus}): request --cpus-per-task={nproc} or more with "
            f"srun/sbatch (one task per node), or lower --nproc-per-node to {cpus}"
        )


def _master(
    env: Mapping[str, str], in_step: bool, hostnames: Callable[[str], list[str]]
) -> tuple[str, str]:
    names = ["SLURM_STEP_NODELIST"] if in_step else []
    names += ["SLURM_JOB_NODELIST", "SLURM_NODELIST"]
    name = next((n for n in names if env.get(n)), "")
    if not name:
        raise SlurmError("SLURM job without SLURM_JOB_NODELIST: pass --rdzv-endpoint HOST:PORT")
    try:
        hosts, how = hostnames(env[name]), "scontrol show hostnames"
    except (OSError, subprocess.SubprocessError) as e:
        # Same expansion by meshrun's parser; said in the line, not silent.
        hosts, how = expand_hostlist(env[name]), f"meshrun's hostlist parser ({type(e).__name__})"
    if not hosts:
        raise SlurmError(f"{name}={env[name]!r} names no host: pass --rdzv-endpoint HOST:PORT")
    return hosts[0], f"first of {name}={env[name]} by {how}"


def given_from(flags: LaunchKeys, launch_cfg: LaunchConfig) -> LaunchKeys:
    """Explicit topology values: a ``meshrun launch`` flag (``flags``, None = not given), else a
    ``[launch]`` key other than its default (``nnodes`` compared as a node range)."""
    default = LaunchConfig()
    in_config = LaunchKeys(
        nnodes=None
        if parse_nnodes(launch_cfg.nnodes) == parse_nnodes(default.nnodes)
        else launch_cfg.nnodes,
        node_rank=_set(launch_cfg.node_rank, default.node_rank),
        nproc_per_node=_set(launch_cfg.nproc_per_node, default.nproc_per_node),
        rdzv_endpoint=_set(launch_cfg.rdzv_endpoint, default.rdzv_endpoint),
        rdzv_id=_set(launch_cfg.rdzv_id, default.rdzv_id),
    )
    topology = LaunchKeys(
        nnodes=flags.nnodes,
        node_rank=flags.node_rank,
        nproc_per_node=flags.nproc_per_node,
        rdzv_endpoint=flags.rdzv_endpoint,
        rdzv_id=flags.rdzv_id,
    )
    return topology.over(in_config)


def _set(value: T, default: T) -> T | None:
    return value if value != default else None


def apply_to_launch(given: LaunchKeys, env: Mapping[str, str]) -> LaunchKeys:
    """Inside a SLURM allocation, the topology values that neither a flag nor the config gave,
    derived from SLURM (a field stays None where one was given or SLURM says nothing; all None
    outside an allocation), for ``LaunchKeys.over`` the flags; prints the derived line and
    keeps the launcher alive through SLURM's pre-time-limit SIGUSR1."""
    if not in_allocation(env):
        return LaunchKeys()
    topo = derive(env, given, cpu_default=_cpu_default)  # called only if needed: imports torch
    filled = LaunchKeys(  # "" endpoint: the launcher's loopback on one node, nothing to fill
        nnodes=topo.nnodes if given.nnodes is None else None,
        node_rank=topo.node_rank if given.node_rank is None else None,
        nproc_per_node=topo.nproc_per_node if given.nproc_per_node is None else None,
        rdzv_endpoint=topo.rdzv_endpoint or None if given.rdzv_endpoint is None else None,
        rdzv_id=topo.rdzv_id if given.rdzv_id is None else None,
    )
    print(topo.line(), file=sys.stderr, flush=True)
    for note in topo.notes:
        print(f"meshrun launch: note: {note}", file=sys.stderr, flush=True)
    forward_usr1_to_workers()
    return filled


def fill_from_allocation(
    keys: LaunchKeys, launch_cfg: LaunchConfig, env: Mapping[str, str]
) -> LaunchKeys:
    """``keys`` (``meshrun launch``'s flags) with what SLURM gives for the topology values that
    neither they nor ``launch_cfg`` set (``keys`` as they are outside an allocation)."""
    return apply_to_launch(given_from(keys, launch_cfg), env).over(keys)


def _cpu_default() -> int:
    from meshrun.launch.agent.local import default_nproc_per_node

    return default_nproc_per_node()


def forward_usr1_to_workers() -> None:
    """SLURM's ``--signal=USR1@S`` (and srun forwarding the batch script's USR1) reaches this
    launcher, whose default action for USR1 is to die. Keep it alive and pass the signal on
    to the workers (its children), whose checkpointer saves at the next step boundary and
    exits 0 (checkpoint.on_signal). With proctrack/cgroup or linuxproc the workers also get it
    directly; a second USR1 only sets the same flag."""
    if hasattr(signal, "SIGUSR1"):
        signal.signal(signal.SIGUSR1, _forward_usr1)


def _forward_usr1(signum: int, frame: FrameType | None) -> None:
    children = _children(os.getpid())
    print(
        f"meshrun launch: SIGUSR1 (SLURM time limit near): passed to {len(children)} workers; "
        "they checkpoint at the next step and exit",
        file=sys.stderr,
        flush=True,
    )
    for pid in children:
        with contextlib.suppress(ProcessLookupError):  # a worker that has just exited
            os.kill(pid, signal.SIGUSR1)


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            # The field after the parenthesised command name is the state, then the parent.
            fields = entry.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            found.append(int(entry.parent.name))
    return found
