"""torchrun's flags in ``meshrun launch``: the table, and what each one becomes.

``meshrun launch`` accepts every flag of ``torchrun`` (torch 2.13) in both of its spellings
(``--nproc-per-node`` and ``--nproc_per_node``) with torchrun's meaning, so a command line
from a README or a SLURM script works with ``torchrun`` replaced by ``meshrun launch``. Each
flag is one of two kinds:

- read by meshrun (topology, rendezvous, logs): meshrun checks it, runs its node handshake
  with it, or reads the files it names, then gives the agent the resulting torchrun flags;
- passed through: handed to the torchrun agent as given (``--monitor-interval``, ...).

The table is written out here rather than read from torch, so that ``meshrun --help`` does
not import torch; ``tests/unit/test_torchrun_flags.py`` checks it against
``torch.distributed.run.get_args_parser()``, so a flag that a newer torch adds fails that
test until it is placed here. Everything in this module is pure (no torch import). What a
parsed set of flags means (the process count, the rendezvous, the output streams) is
launch/front/torchrun.py's; their argparse lines are cli/torchrun.py's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

STATIC_DEFAULT_ADDR = "127.0.0.1"  # torchrun's --master-addr default
STATIC_DEFAULT_PORT = 29500  # torchrun's --master-port default
BACKENDS = ("c10d", "static")


@dataclass(frozen=True)
class Flag:
    """One torchrun flag: its spellings, its argparse shape, and whether meshrun reads it."""

    options: tuple[str, ...]  # torchrun's option strings, the dash spelling first
    dest: str
    help: str
    type: Callable[[str], Any] | None = str  # None: a switch (store_true)
    choices: tuple[str, ...] | None = None
    passed: bool = False  # True: handed to the torchrun agent as given

    @property
    def switch(self) -> bool:
        return self.type is None

    @property
    def name(self) -> str:
        """The long dash spelling: what messages and the agent's argv use."""
        return next(o for o in self.options if o.startswith("--"))


def nproc_value(text: str) -> int | str:
    """``--nproc-per-node``: a number as an int (what the rest of meshrun reads), a device
    word (auto, cpu, gpu, xpu, a custom backend's name) as given, for ``resolve_nproc``."""
    return int(text) if text.strip().lstrip("-").isdigit() else text


def _both(name: str) -> tuple[str, ...]:
    """``--a-b`` and ``--a_b``: torchrun's two spellings (one when there is no dash)."""
    under = name.replace("-", "_")
    return (f"--{name}", f"--{under}") if under != name else (f"--{name}",)


# In the order of `meshrun launch --help`: meshrun's own reading first, then passed through.
FLAGS: tuple[Flag, ...] = (
    Flag(
        _both("nproc-per-node"),
        "nproc_per_node",
        "processes on this node: N, auto (accelerators, else CPU cores), gpu, cpu, xpu "
        "(default: GPUs, else 2)",
        nproc_value,
    ),
    Flag(_both("nnodes"), "nnodes", "nodes: N or MIN:MAX (default 1)"),
    Flag(_both("max-restarts"), "max_restarts", "restarts after a failure (default 0)", int),
    Flag(
        _both("node-rank"),
        "node_rank",
        "multi-node: this node's rank (default 0); with static rendezvous also its group rank",
        int,
    ),
    Flag(
        _both("rdzv-endpoint"),
        "rdzv_endpoint",
        "multi-node: HOST:PORT of one node, the same on every node",
    ),
    Flag(_both("rdzv-id"), "rdzv_id", "multi-node: job id, the same on every node"),
    Flag(
        _both("rdzv-conf"),
        "rdzv_conf",
        "multi-node: extra torchrun rendezvous settings KEY=VALUE,...",
    ),
    Flag(
        _both("rdzv-backend"),
        "rdzv_backend",
        "c10d (meshrun's default) or static (torchrun's default with --master-addr/port; "
        "docs/launch.md)",
    ),
    Flag(
        _both("standalone"),
        "standalone",
        "one node on a free local port (meshrun's default; rendezvous flags are ignored)",
        None,
    ),
    Flag(
        _both("master-addr"),
        "master_addr",
        "static rendezvous: address of node rank 0 (torchrun's meaning; docs/launch.md)",
    ),
    Flag(
        _both("master-port"),
        "master_port",
        "static rendezvous: port on node rank 0 (default 29500)",
        int,
    ),
    Flag(
        _both("local-addr"),
        "local_addr",
        "this node's address for the agent (default: 127.0.0.1 on one node, the chosen "
        "interface's on many)",
    ),
    Flag(_both("log-dir"), "log_dir", "per-rank log files (default RUN_DIR/logs)"),
    Flag(
        ("-r", "--redirects"),
        "redirects",
        "torchrun's redirects of worker streams to files only: 0-3 or RANK:VALUE,...",
    ),
    Flag(
        ("-t", "--tee"),
        "tee",
        "torchrun's tee of worker streams to files and console with a [role rank]: prefix "
        "(default 2: stderr only, stdout untouched; 3: prefix every line)",
    ),
    Flag(
        _both("monitor-interval"),
        "monitor_interval",
        "seconds between the agent's checks of the workers",
        float,
        passed=True,
    ),
    Flag(
        _both("start-method"),
        "start_method",
        "how workers are started",
        choices=("spawn", "fork", "forkserver"),
        passed=True,
    ),
    Flag(
        _both("event-log-handler"),
        "event_log_handler",
        "a registered torchelastic event log handler",
        passed=True,
    ),
    Flag(_both("role"), "role", "the workers' role name (default 'default')", passed=True),
    Flag(
        _both("no-python"),
        "no_python",
        "run TARGET as a program, not a Python script",
        None,
        passed=True,
    ),
    Flag(
        _both("run-path"),
        "run_path",
        "run the script with runpy.run_path in the worker's interpreter",
        None,
        passed=True,
    ),
    Flag(
        _both("local-ranks-filter"),
        "local_ranks_filter",
        "show console output of these local ranks only, e.g. 0",
        passed=True,
    ),
    Flag(
        _both("duplicate-stdout-filters"),
        "duplicate_stdout_filters",
        "copy stdout lines containing any of these comma-separated words to a file",
        passed=True,
    ),
    Flag(
        _both("duplicate-stderr-filters"),
        "duplicate_stderr_filters",
        "copy stderr lines containing any of these comma-separated words to a file",
        passed=True,
    ),
    Flag(
        _both("logs-specs"),
        "logs_specs",
        "a torchrun.logs_specs entry point that lays out the log files",
        passed=True,
    ),
    Flag(
        _both("numa-binding"),
        "numa_binding",
        "bind workers to CPUs near their GPU",
        choices=("node", "socket", "exclusive", "core-complex"),
        passed=True,
    ),
    Flag(
        _both("signals-to-handle"),
        "signals_to_handle",
        "signals the agent forwards to the workers (default SIGTERM,SIGINT,SIGHUP,SIGQUIT)",
        passed=True,
    ),
    Flag(
        _both("shutdown-timeout"),
        "shutdown_timeout",
        "seconds between SIGTERM and SIGKILL when the agent stops workers",
        int,
        passed=True,
    ),
    Flag(
        _both("virtual-local-rank"),
        "virtual_local_rank",
        "LOCAL_RANK 0 in every worker, each seeing its own GPU as device 0",
        None,
        passed=True,
    ),
)

# --help's names for the values (the rest: NAME).
METAVARS = {
    "nproc_per_node": "N",
    "nnodes": "N|MIN:MAX",
    "max_restarts": "N",
    "node_rank": "N",
    "rdzv_endpoint": "HOST:PORT",
    "rdzv_id": "ID",
    "rdzv_conf": "KEY=VALUE,...",
    "master_addr": "HOST",
    "master_port": "PORT",
    "local_addr": "ADDR",
    "log_dir": "DIR",
    "redirects": "SPEC",
    "tee": "SPEC",
    "monitor_interval": "SECONDS",
    "local_ranks_filter": "RANKS",
    "duplicate_stdout_filters": "WORDS",
    "duplicate_stderr_filters": "WORDS",
    "signals_to_handle": "SIGNALS",
    "shutdown_timeout": "SECONDS",
}
# torchrun flags defined elsewhere in `meshrun launch`: -m/--module by cliargs.add_target.
OTHER_FLAGS = {"module": ("-m", "--module")}
# torchrun flags `meshrun launch` does not accept at all, with the reason (none in 2.13).
REFUSED: dict[str, str] = {}
# With --hostfile, the flags each host's `meshrun launch` gets (launch/hostfile/plan.py forwards
# or decides these); any other torchrun flag would be lost on the way, so it is refused.
HOSTFILE_FLAGS = (
    "nproc_per_node",
    "nnodes",
    "node_rank",
    "max_restarts",
    "rdzv_endpoint",
    "rdzv_id",
)


def flag_argv(flag: Flag, value: Any) -> list[str]:
    """``flag`` with ``value`` as torchrun argv, in the dash spelling."""
    return [flag.name] if flag.switch else [flag.name, str(value)]
