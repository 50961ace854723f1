"""Where the job secret comes from (the key, its HMAC and its sanitizer are runtime/secret.py's):
one random key per job that every node's launcher holds, so what meshrun reads back from a
store anyone can reach (the rendezvous state, the handshake's records) is trusted only when it
carries an HMAC made with it.

First match wins:

1. ``MESHRUN_JOB_SECRET`` in the environment (a k8s Secret, ``srun``'s inherited env, CI);
2. ``MESHRUN_JOB_SECRET_FILE`` (or ``meshrun launch --secret-file``): a file holding it,
   readable by its owner only;
3. ``RUN_DIR/job.secret``: created (mode 0600, 32 random bytes as hex) by a one-node launch
   and by the node that hosts a multi-node rendezvous; the other nodes read it there, which
   is the default for nodes sharing the run directory (SLURM, a shared filesystem).

The launcher exports it to its workers as ``MESHRUN_JOB_SECRET`` (the agent copies its
environment into each worker); it is never written into the resolved config or a command
line. Standard library only: nothing here imports torch.
"""

from __future__ import annotations

import os
import secrets
import stat
import time
from collections.abc import Callable, Mapping, MutableMapping
from pathlib import Path

from meshrun.runtime.secret import SECRET_ENV, JobSecret, SecretError, checked

SECRET_FILE_ENV = "MESHRUN_JOB_SECRET_FILE"
SECRET_FILE_NAME = "job.secret"


def resolve(
    run_dir: str,
    environ: Mapping[str, str],
    *,
    create: bool,
    wait_s: float = 0.0,
    say: Callable[[str], None] | None = None,
) -> JobSecret:
    """The job secret (see the module's docstring for the order). ``create``: this node
    may write ``RUN_DIR/job.secret`` if it is missing; otherwise it waits up to ``wait_s``
    for the node that creates it (a shared run directory), then says what to set."""
    if environ.get(SECRET_ENV):
        return checked(environ[SECRET_ENV], f"env {SECRET_ENV}")
    if environ.get(SECRET_FILE_ENV):
        return read_file(
            Path(environ[SECRET_FILE_ENV]), f"{SECRET_FILE_ENV}={environ[SECRET_FILE_ENV]}"
        )
    path = Path(run_dir) / SECRET_FILE_NAME
    if create and not path.exists():
        return _create(path)
    deadline = time.monotonic() + wait_s
    if not path.exists() and say is not None and wait_s > 0:
        say(f"waiting for the job secret {path} (written by the node hosting the rendezvous)")
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    if not path.exists():
        raise SecretError(
            f"no job secret: {SECRET_ENV} and {SECRET_FILE_ENV} are unset and {path} does not "
            f"exist{f' after {wait_s:.0f} s' if wait_s else ''}. Give every node the same secret: "
            f"a run directory shared by all nodes (the host writes {SECRET_FILE_NAME} there), "
            f"{SECRET_ENV}, or {SECRET_FILE_ENV}=PATH of a file readable only by you"
        )
    return read_file(path, str(path))


def use_secret_file(path: str, environ: MutableMapping[str, str]) -> JobSecret:
    """``meshrun launch --secret-file PATH``: ``MESHRUN_JOB_SECRET_FILE=PATH`` for this launch
    and everything it starts, the file checked now (before any process is spawned). A
    different secret already in the environment is a conflict, not a silent choice."""
    named = f"--secret-file {path}"
    if environ.get(SECRET_ENV):
        raise SecretError(
            f"{named} and {SECRET_ENV} are both set: the job would have two secrets. Unset "
            f"{SECRET_ENV} or drop --secret-file"
        )
    other = environ.get(SECRET_FILE_ENV)
    if other and os.path.realpath(other) != os.path.realpath(path):
        raise SecretError(
            f"{named} and {SECRET_FILE_ENV}={other} name different files: unset "
            f"{SECRET_FILE_ENV} or drop --secret-file"
        )
    secret = read_file(Path(path), named)
    environ[SECRET_FILE_ENV] = os.path.abspath(path)
    return secret


def read_file(path: Path, named: str) -> JobSecret:
    """A secret file's key; refused when others may read it or it is not ours."""
    try:
        info = path.stat()
        text = path.read_text().strip()
    except OSError as err:
        raise SecretError(f"cannot read the job secret {named}: {err.strerror}") from None
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SecretError(
            f"the job secret {named} has mode {stat.S_IMODE(info.st_mode):o}: other users could "
            f"read it. Run: chmod 600 {path}"
        )
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        raise SecretError(
            f"the job secret {named} belongs to uid {info.st_uid}, not to you ({os.getuid()}); "
            "a file someone else wrote cannot be trusted: remove it or choose another run dir"
        )
    return checked(text, f"file {named}")


def _create(path: Path) -> JobSecret:
    path.parent.mkdir(parents=True, exist_ok=True)
    value = secrets.token_hex(32)
    try:
        # O_EXCL: two launches racing on one run dir never both write; 0600 from the start.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return read_file(path, str(path))
    with os.fdopen(fd, "w") as out:
        out.write(value + "\n")
    return JobSecret(value.encode(), f"file {path} (new)")
