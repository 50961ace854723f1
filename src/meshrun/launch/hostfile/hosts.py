"""``meshrun launch --hostfile``: the hostfile read and checked (pure).

One machine starts one ``meshrun launch`` per listed host over ``ssh`` (one torchrun agent per
host, all meeting at a c10d rendezvous on the first host), as DeepSpeed's and pdsh's launchers
do. Every host must have the same working directory and the same Python at the same path (a
shared filesystem, or identical images). This module parses the file;
``launch/hostfile/plan.py`` turns it and the request into a plan, ``launch/hostfile/remote.py``
builds each host's command line and runs it. See docs/hostfile.md.

Hostfile format, one host per line, ``#`` starts a comment::

    [user@]host[:sshport] [slots=N]
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from meshrun.config import ConfigError

DEFAULT_RDZV_PORT = 29500  # torchrun's own default

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
