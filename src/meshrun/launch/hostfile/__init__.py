"""``meshrun launch --hostfile``: the hosts file read and checked (``hosts``), one launcher per
host started over ssh with the job secret on its standard input (``remote``). See
docs/hostfile.md."""

from typing import TYPE_CHECKING

from meshrun._lazy import lazy_exports

if TYPE_CHECKING:
    from meshrun.launch.hostfile.hosts import parse_hostfile
    from meshrun.launch.hostfile.remote import launch_hostfile

__getattr__ = lazy_exports(
    globals(),
    {
        "parse_hostfile": "meshrun.launch.hostfile.hosts",
        "launch_hostfile": "meshrun.launch.hostfile.remote",
    },
)

__all__ = ["launch_hostfile", "parse_hostfile"]
