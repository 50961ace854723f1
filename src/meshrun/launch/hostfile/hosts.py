"""``meshrun launch --hostfile``: the hostfile and the command each host runs (pure).

One machine starts one ``meshrun launch`` per listed host over ``ssh`` (one torchrun agent per
host, all meeting at a c10d rendezvous on the first host), as DeepSpeed's and pdsh's launchers
do. Every host must have the same working directory and the same Python at the same path (a
shared filesystem, or identical images). This module parses the file and builds the command
lines; ``launch/hostfile/remote.py`` runs them. See docs/hostfile.md.

Hostfile format, one host per line, ``#`` starts a comment::

    [user@]host[:sshport] [slots=N]
"""

from __future__ import annotations

import re
import shlex
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from meshrun.config import ConfigError

DEFAULT_RDZV_PORT = 29500  # torchrun's own default
SSH_CONNECT_TIMEOUT_S = 5
SSH_ENV = "MESHRUN_SSH"  # extra ssh arguments, shell-quoted, e.g. "-i ~/.ssh/cluster_key"
GUARD_MODULE = "meshrun.launch.hostfile.guard"
READ_SECRET = 'IFS= read -r MESHRUN_JOB_SECRET && export MESHRUN_JOB_SECRET && exec "$@"'

# What reaches the remote meshrun launch: what configures meshrun, threads, the collective
# libraries and the import path. Never names that look like credentials, whatever the prefix.
FORWARD_NAMES = ("OMP_NUM_THREADS", "PYTHONPATH")
FORWARD_PREFIXES = ("MESHRUN_", "NCCL_", "GLOO_", "TORCH_")
_LAUNCHER_ONLY = {SSH_ENV, "MESHRUN_CONFIG"}  # the remote launch writes its own config path
_SECRET = re.compile(r"TOKEN|SECRET|PASSW|CREDENTIAL|KEY", re.IGNORECASE)

# A user and a host start with a letter, digit or _: one starting with "-" would reach ssh as
# an option (host "-V": ssh printed its version and the launch "succeeded" having trained nothing).
_HOST = re.compile(
    r"^(?:(?P<user>[A-Za-z0-9_][A-Za-z0-9_.\-]*)@)?"
    r"(?P<host>[A-Za-z0-9_][A-Za-z0-9_.\-]*)(?::(?P<port>\d+))?$"
)


class HostfileError(ConfigError):
    """A bad hostfile line or a launch flag that cannot go with --hostfile."""


@dataclass(frozen=True)
class HostEntry:
    """One line of a hostfile."""

    host: str  # a name or address every host can reach (host 0's is the rendezvous address)
    user: str | None = None
    port: int | None = None  # ssh port
    slots: int | None = None  # processes on this host; None = --nproc-per-node
    line: int = 0

    @property
    def destination(self) -> str:
        return f"{self.user}@{self.host}" if self.user else self.host

    @property
    def label(self) -> str:
        """The output prefix: the host, and the ssh port when one is given."""
        return f"{self.host}:{self.port}" if self.port else self.host


def parse_hostfile(path: str | Path) -> list[HostEntry]:
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise HostfileError(f"--hostfile {str(path)!r} cannot be read: {err.strerror}") from None
    except UnicodeDecodeError as err:
        raise HostfileError(
            f"--hostfile {str(path)!r} is not UTF-8 text (byte 0x{err.object[err.start]:02x} at "
            f"offset {err.start}); a hostfile is lines of 'HOST slots=N': save it as UTF-8"
        ) from None
    return parse_hostfile_text(text, str(path))


def parse_hostfile_text(text: str, source: str = "<hostfile>") -> list[HostEntry]:
    """The hosts of a hostfile, in order; errors name ``source``, the line and the problem."""
    hosts = [
        _parse_line(content, source, number)
        for number, raw in enumerate(text.splitlines(), start=1)
        if (content := raw.split("#", 1)[0].strip())
    ]
    if not hosts:
        raise HostfileError(f"{source}: no hosts (one per line: [user@]host[:sshport] [slots=N])")
    seen: dict[tuple[str, int | None], int] = {}
    for h in hosts:
        first = seen.setdefault((h.host, h.port), h.line)
        if first != h.line:
            raise HostfileError(
                f"{source}:{h.line}: host {h.label!r} is already listed on line {first}; list "
                "each host once and give it slots=N for several processes"
            )
    return hosts


def _parse_line(content: str, source: str, number: int) -> HostEntry:
    where = f"{source}:{number}"
    if not content.replace("\t", " ").isprintable():  # control characters: escapes, NUL, CR
        raise HostfileError(
            f"{where}: {content!r} holds control characters; a line is [user@]host[:sshport] "
            "[slots=N] in plain text"
        )
    words = content.split()
    match = _HOST.match(words[0])
    if match is None:
        starts = (words[0][:1], words[0].partition("@")[2][:1])
        dash = (
            " (a host or user starting with '-' would be an option to ssh)" if "-" in starts else ""
        )
        raise HostfileError(
            f"{where}: {words[0]!r} is not a host{dash}; expected [user@]host[:sshport] "
            "[slots=N], the host a name or address"
        )
    port = int(match["port"]) if match["port"] else None
    if port is not None and not 0 < port < 65536:
        raise HostfileError(f"{where}: ssh port {port} is not in 1..65535")
    slots = None
    for word in words[1:]:
        key, _, value = word.partition("=")
        if key != "slots":
            raise HostfileError(f"{where}: unknown field {word!r}; the only field is slots=N")
        if not value.isdigit() or int(value) < 1:
            raise HostfileError(f"{where}: slots={value!r} must be a whole number >= 1")
        slots = int(value)
    return HostEntry(match["host"], match["user"], port, slots, number)


# --- the plan: what every host runs -------------------------------------------------------


@dataclass
class HostfilePlan:
    """Everything needed to build each host's ssh command line."""

    hosts: list[HostEntry]
    nproc_per_node: int | None  # None: each host's own default (its GPUs, else 2)
    launch_args: list[str]  # meshrun launch flags and target + script args, same on every host
    cwd: str
    python: str
    rdzv_endpoint: str = ""  # "" = the first host's address and DEFAULT_RDZV_PORT
    rdzv_id: str = field(default_factory=lambda: f"meshrun-{uuid.uuid4().hex[:8]}")
    env: dict[str, str] = field(default_factory=dict)
    ssh_args: list[str] = field(default_factory=list)  # extra ssh arguments, before ours
    source: str = "<hostfile>"

    @property
    def endpoint(self) -> str:
        return self.rdzv_endpoint or f"{self.hosts[0].host}:{DEFAULT_RDZV_PORT}"


def nproc_for(hosts: Sequence[HostEntry], default: int | None, source: str) -> int | None:
    """The processes per host: every host must run the same number (see the error)."""
    counts = {h.slots or default for h in hosts}
    if len(counts) > 1:
        listing = ", ".join(f"{h.label}={h.slots or default}" for h in hosts)
        raise HostfileError(
            f"{source}: hosts have different process counts ({listing}); meshrun validates "
            "the layout for nproc x nnodes, so give every host the same slots=N (or none and "
            "--nproc-per-node)"
        )
    return counts.pop()


def ssh_options(opts: Sequence[str], environ: Mapping[str, str]) -> list[str]:
    """``--ssh-opt KEY=VALUE`` flags as ``-o KEY=VALUE``, then ``$MESHRUN_SSH`` (shell words)."""
    args = []
    for opt in opts:
        if "=" not in opt or opt.startswith("-"):
            raise HostfileError(
                f"--ssh-opt {opt!r}: expected an ssh option as KEY=VALUE (ssh -o), e.g. "
                "IdentityFile=~/.ssh/cluster; other ssh arguments go in $MESHRUN_SSH"
            )
        args += ["-o", opt]
    try:
        return args + shlex.split(environ.get(SSH_ENV, ""))
    except ValueError as err:
        raise HostfileError(f"${SSH_ENV} is not valid shell words: {err}") from None


def ssh_argv(entry: HostEntry, ssh_args: Sequence[str], command: str) -> list[str]:
    """``ssh`` to ``entry`` running the shell ``command``. BatchMode: never prompt for a
    password (it would hang a launcher with several hosts). The user's options come first
    because ssh keeps the first value it gets for each option."""
    argv = ["ssh", *ssh_args, "-o", "BatchMode=yes"]
    argv += ["-o", f"ConnectTimeout={SSH_CONNECT_TIMEOUT_S}"]
    if entry.port:
        argv += ["-p", str(entry.port)]
    return [*argv, entry.destination, command]


def forwarded_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The launcher's variables that the remote launch gets (docs/hostfile.md lists them)."""
    env = {
        name: value
        for name, value in environ.items()
        if (name in FORWARD_NAMES or name.startswith(FORWARD_PREFIXES))
        and name not in _LAUNCHER_ONLY
        and not _SECRET.search(name)
    }
    # Remote output goes through a pipe: unbuffered, so it streams line by line.
    env["PYTHONUNBUFFERED"] = "1"
    return dict(sorted(env.items()))


def node_argv(plan: HostfilePlan, node_rank: int) -> list[str]:
    """The ``meshrun launch`` argv for host ``node_rank`` (before quoting)."""
    return [
        *(plan.python, "-m", "meshrun", "launch"),
        *("--nnodes", str(len(plan.hosts))),
        *("--node-rank", str(node_rank)),
        *("--rdzv-endpoint", plan.endpoint),
        *("--rdzv-id", plan.rdzv_id),
        *(["--nproc-per-node", str(plan.nproc_per_node)] if plan.nproc_per_node else []),
        *plan.launch_args,
    ]


def remote_command(plan: HostfilePlan, node_rank: int) -> str:
    """The shell line ssh runs on host ``node_rank``: same directory, same Python, the
    forwarded variables, and the guard that stops the launch when the ssh session ends.
    The job secret is the first line the launcher writes to ssh's stdin (a command line
    would show it in ``ps``): ``sh`` reads it into the environment, the guard gets the rest."""
    env = [f"{k}={v}" for k, v in plan.env.items()]
    guard = [plan.python, "-m", GUARD_MODULE, "--"]
    return f"cd {shlex.quote(plan.cwd)} && exec " + shlex.join(
        ["sh", "-c", READ_SECRET, "sh", "env", *env, *guard, *node_argv(plan, node_rank)]
    )


def check_command(plan: HostfilePlan) -> str:
    """What the reachability check runs: the directory and the Python must exist there."""
    return f"cd {shlex.quote(plan.cwd)} && test -x {shlex.quote(plan.python)}"
