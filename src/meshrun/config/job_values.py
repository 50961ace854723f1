"""The ``[job]`` values that name places on disk: ``name`` (one path component of the default
run directory ``runs/<name>``) and ``run_dir``. Checked where they are made (a file, an
override, code), so a name with a newline or ``../`` never becomes a directory, and a run
directory that is a file is refused before any process starts."""

from __future__ import annotations

import re
from pathlib import Path

from meshrun.config.fields import ConfigError

# One path component that every file system, SLURM's --job-name and a Kubernetes label take.
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+-]{0,99}")


def check_job_name(name: str) -> None:
    if not _NAME.fullmatch(name):
        raise ConfigError(
            f"job.name = {name!r} is not allowed: it names the run directory runs/<name>, so it "
            "must be 1-100 letters, digits, '.', '_', '+' or '-', not starting with '.' or '-' "
            "(no '/', spaces or control characters); e.g. job.name='llama-8b.run2', or set "
            "job.run_dir to choose the directory itself"
        )


def check_run_dir(run_dir: str) -> None:
    """A run directory that exists as something else, or whose nearest existing parent is not
    a directory, cannot hold a run: said now, not as a traceback from the first mkdir."""
    if not run_dir:
        return
    if "\n" in run_dir or "\x00" in run_dir:
        raise ConfigError(
            f"job.run_dir = {run_dir!r} is not allowed: it contains a newline or NUL; "
            "choose a plain directory path"
        )
    path = Path(run_dir)
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        what = "is a file" if existing == path else f"is under {str(existing)!r}, a file"
        raise ConfigError(
            f"job.run_dir = {run_dir!r} {what}, not a directory; choose a directory "
            "(it is created if missing)"
        )
