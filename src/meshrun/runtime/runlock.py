"""One job per run directory: a lock on ``RUN_DIR/meshrun.lock`` held for the job's life.

Two jobs in one run directory resume each other's in-flight checkpoints, write into the same
step directories and mix their metrics, all while exiting 0. So ``meshrun launch`` takes this
lock before it writes anything in the directory (one node; the rendezvous host of a multi-node
job, the other nodes check it), and a job started without it (plain torchrun, ``srun``,
``mpirun``, ``python train.py``) has its rank 0 take it in ``meshrun.init()``.

The lock is ``flock(2)`` on an open file: the kernel drops it when its holder dies, however it
dies, so a stale lock needs no clean-up, only a line saying whose it was. On NFS v4 Linux
turns ``flock`` into a POSIX lock the server keeps, so nodes sharing the directory see each
other's; a file system without locks (Lustre mounted ``-o noflock``) gets a printed warning.
The file holds the holder's host, PID, start time and job token (JSON) for the messages; the
token, passed to the workers in ``MESHRUN_RUN_LOCK``, tells rank 0 that its own launcher holds
the lock. The workers also share a second lock (``meshrun.workers.lock``) for their lives, so
a launch refuses a directory whose launcher died (SIGKILL) while its workers run on.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import secrets
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from meshrun.config import ConfigError
from meshrun.runtime.logs import say_line

__all__ = [
    "LOCK_NAME",
    "TOKEN_ENV",
    "Holder",
    "RunDirBusy",
    "RunDirError",
    "check_run_dir",
    "claim_at_start",
    "hold_as_worker",
    "hold_run_dir",
    "job_token",
    "rank0_lock",
    "read_holder",
    "release_rank0",
]

LOCK_NAME = "meshrun.lock"
# Every worker holds a shared lock on this file for its life: the launcher's lock ends with
# the launcher (a SIGKILL of it alone leaves its workers running), this one with the last
# worker, so a new launch that finds it held knows the old job is not over.
WORKERS_LOCK_NAME = "meshrun.workers.lock"
TOKEN_ENV = "MESHRUN_RUN_LOCK"
_READ_TRIES = 20  # a holder writes its record right after locking: a reader may come between

Say = Callable[[str], None]


class RunDirError(ConfigError):
    """The run directory is busy, not the same directory on every rank, or not writable.
    ``every_rank``: every rank of the job raises it at the same point (a verdict that was
    broadcast or gathered), so they may wait for each other before they leave."""

    def __init__(self, message: str, *, every_rank: bool = False) -> None:
        super().__init__(message)
        self.every_rank = every_rank


class RunDirBusy(RunDirError):
    """Another job holds the run directory."""


@dataclass(frozen=True)
class Holder:
    """Who holds (or last held) a run directory's lock."""

    host: str
    pid: int
    started: float  # time.time() when it took the lock
    token: str  # the job's: equal tokens are the same job (its launcher and its rank 0)

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"host {self.host} pid {self.pid} (since {since})"


def job_token(multinode: bool, rdzv_id: str = "", rdzv_endpoint: str = "") -> str:
    """The token of a launch. Every node of a multi-node job computes the same one from the
    rendezvous it shares (no two running jobs can host one endpoint); one node gets a random
    one."""
    if multinode:
        return hashlib.sha256(f"{rdzv_id}@{rdzv_endpoint}".encode()).hexdigest()[:16]
    return secrets.token_hex(8)


def _say_stderr(text: str) -> None:
    say_line(f"meshrun: {text}")


def _busy(run_dir: Path, holder: Holder | None) -> RunDirBusy:
    who = holder.describe() if holder else "a process whose record could not be read"
    return RunDirBusy(
        f"run directory {run_dir} is in use by another job: {who} holds "
        f"{run_dir / LOCK_NAME}. Two jobs in one run directory resume each other's checkpoints "
        "and mix their metrics; give this job its own directory (--job.run_dir=DIR) or stop "
        "the other job first"
    )


def read_holder(path: Path) -> Holder | None:
    """The record in a lock file (None: empty, absent or unreadable)."""
    for _ in range(_READ_TRIES):
        try:
            text = path.read_text()
        except OSError:
            return None
        if text.strip():
            try:
                return Holder(**json.loads(text))
            except (ValueError, TypeError):
                return None
        time.sleep(0.05)
    return None


def _try_lock(fd: int) -> bool | None:
    """True: locked; False: another holds it; None: this file system has no locks."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        if e.errno in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
            return None
        raise
    return True


def _open(run_dir: Path) -> int:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        return os.open(run_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:  # a missing parent under /proc, a read-only mount, no permission
        raise ConfigError(
            f"job.run_dir = {str(run_dir)!r} cannot be used: {e.strerror} ({e.filename}); "
            "choose a directory this user can create and write"
        ) from None


def _no_locks(run_dir: Path, say: Say) -> None:
    say(
        f"warning: the file system of {run_dir} has no file locks (flock); nothing stops a "
        "second job from using this run directory: mount it with locks (NFS v4, Lustre -o "
        "flock) or make sure only one job uses it"
    )


def _workers_alive(run_dir: Path) -> bool:
    """Whether processes of a job still hold the workers' lock (checked without waiting)."""
    path = run_dir / WORKERS_LOCK_NAME
    if not path.exists():
        return False
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        if _try_lock(fd) is False:
            return True
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def _workers_busy(run_dir: Path, old: Holder | None) -> RunDirBusy:
    who = f"its launcher, {old.describe()}, has ended" if old else "its launcher has ended"
    lock = run_dir / WORKERS_LOCK_NAME
    return RunDirBusy(
        f"run directory {run_dir} is in use by another job: its workers still run ({who}; "
        f"they hold {lock}). Stop them first (fuser -v {lock} lists them) or give this job "
        "its own directory (--job.run_dir=DIR)"
    )


_WORKER_FDS: dict[str, int] = {}  # run dir -> this worker's shared lock, held until exit


def hold_as_worker(run_dir: str | Path) -> None:
    """This process is one of the job's workers: share the workers' lock until it exits
    (never released by hand: the kernel drops it with the process, however it ends)."""
    path = Path(run_dir)
    key = str(path.resolve())
    if key in _WORKER_FDS:
        return
    try:
        fd = os.open(path / WORKERS_LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError:  # not writable here: storage.py's check names it
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # a launcher checking holds it exclusively a moment
    except OSError:  # no locks on this file system: warned about with the run dir's lock
        os.close(fd)
        return
    _WORKER_FDS[key] = fd


def _take(
    run_dir: Path, token: str, say: Say, ours: str = "", check_workers: bool = False
) -> int | None:
    """Lock ``run_dir`` and write this process's record; returns the open file (None: no
    locks here, warned; or held by a process of this job, whose token is ``ours``). Raises
    :class:`RunDirBusy` naming the holder."""
    fd = _open(run_dir)
    got = _try_lock(fd)
    if not got:
        os.close(fd)
        if got is None:
            _no_locks(run_dir, say)
            return None
        holder = read_holder(run_dir / LOCK_NAME)
        if ours and holder is not None and holder.token == ours:
            return None
        raise _busy(run_dir, holder)
    old = read_holder(run_dir / LOCK_NAME) if os.fstat(fd).st_size else None
    if check_workers and _workers_alive(run_dir):
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
        raise _workers_busy(run_dir, old)
    if old is not None and old.token != token:
        say(
            f"run directory {run_dir}: taking over the lock of {old.describe()}, which has "
            "ended (its lock was free)"
        )
    me = Holder(socket.gethostname(), os.getpid(), time.time(), token)
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(asdict(me)).encode(), 0)
    os.fsync(fd)  # visible to the other nodes of a shared file system before they look
    return fd


def _release(fd: int) -> None:
    os.ftruncate(fd, 0)  # an ended job leaves no record: the next one has nothing to take over
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


_HELD: dict[str, int] = {}  # run dir -> its open lock file (-1: no locks there), this process


@contextmanager
def hold_run_dir(
    run_dir: str | Path, token: str, take: bool = True, say: Say = _say_stderr
) -> Iterator[None]:
    """Hold ``run_dir``'s lock inside the block (``take=False``: only refuse a directory that
    another job holds), with ``token`` exported to the processes started in it. Nested holds
    of one directory in one process are one."""
    path = Path(run_dir)
    key = str(path.resolve())
    if key in _HELD or not take:
        if key not in _HELD:
            check_run_dir(path, token)
        with _exported(os.environ.get(TOKEN_ENV) if key in _HELD else token):
            yield
        return
    fd = _take(path, token, say, check_workers=True)
    _HELD[key] = -1 if fd is None else fd
    try:
        with _exported(token):
            yield
    finally:
        del _HELD[key]
        if fd is not None:
            _release(fd)


@contextmanager
def _exported(token: str | None) -> Iterator[None]:
    saved = os.environ.get(TOKEN_ENV)
    if token:
        os.environ[TOKEN_ENV] = token
    try:
        yield
    finally:
        _restore_env(saved)


def _restore_env(saved: str | None) -> None:
    if saved is None:
        os.environ.pop(TOKEN_ENV, None)
    else:
        os.environ[TOKEN_ENV] = saved


def check_run_dir(run_dir: str | Path, token: str) -> None:
    """Raise :class:`RunDirBusy` if another job holds ``run_dir`` (a job with ``token`` may):
    the nodes of a multi-node launch that do not host its rendezvous check, the host holds."""
    path = Path(run_dir)
    if str(path.resolve()) in _HELD or not (path / LOCK_NAME).exists():
        return
    fd = _open(path)
    try:
        got = _try_lock(fd)
        if got is False:
            holder = read_holder(path / LOCK_NAME)
            if holder is None or holder.token != token:
                raise _busy(path, holder)
        elif got:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


_RANK0: dict[str, int] = {}  # run dir -> rank 0's lock file, held until the run closes


def rank0_lock(run_dir: str | Path, environ: Mapping[str, str], say: Say = _say_stderr) -> None:
    """Rank 0 of a job: pass when its own launcher holds the lock (``MESHRUN_RUN_LOCK`` equals
    the holder's token), else take it until :func:`release_rank0` (``Run.close``) or the end of
    this process. Raises :class:`RunDirBusy` when another job holds it."""
    path = Path(run_dir)
    key = str(path.resolve())
    if key in _RANK0 or key in _HELD:
        return
    given = environ.get(TOKEN_ENV, "")
    # Held with this token: by the launcher. Free: taken (a replica group's own directory,
    # or a restart after the rank 0 that held it died).
    fd = _take(path, given or _worker_token(environ), say, ours=given)
    if fd is not None:
        _RANK0[key] = fd


def release_rank0(run_dir: str | Path) -> None:
    """The run is over: free the lock rank 0 took (nothing when its launcher holds it)."""
    fd = _RANK0.pop(str(Path(run_dir).resolve()), None)
    if fd is not None:
        _release(fd)


def _worker_token(environ: Mapping[str, str]) -> str:
    """A job's token where no meshrun launcher made one: the same across the restarts of one
    torchrun or SLURM job (its rank 0 then takes the lock back without a line)."""
    if run_id := environ.get("TORCHELASTIC_RUN_ID"):
        return f"torchelastic:{run_id}"
    if job := environ.get("SLURM_JOB_ID"):
        return f"slurm:{job}"
    return secrets.token_hex(8)


def claim_at_start(run_dir: str | Path, rank: int, environ: Mapping[str, str]) -> None:
    """``meshrun.init()`` on every rank, once the process group exists: rank 0 takes the lock
    (:func:`rank0_lock`) and, without a meshrun launcher, tells the others whether it could,
    so that every rank of a refused job stops with the same message instead of waiting for
    rank 0 in the first collective. Under ``meshrun launch`` (its token in the environment)
    the launcher already refused a busy directory: no collective. Every rank then shares the
    workers' lock for its life (:func:`hold_as_worker`)."""
    _claim(run_dir, rank, environ)
    hold_as_worker(run_dir)


def _claim(run_dir: str | Path, rank: int, environ: Mapping[str, str]) -> None:
    if environ.get(TOKEN_ENV):
        if rank == 0:
            rank0_lock(run_dir, environ)
        return
    error: RunDirError | None = None
    if rank == 0:
        try:
            rank0_lock(run_dir, environ)
        except RunDirBusy as e:
            error = e
        except OSError as e:  # e.g. a full disk: every rank must stop, not wait for rank 0
            host = socket.gethostname()
            error = RunDirError(f"job.run_dir {run_dir}: rank 0 on {host} cannot write in it: {e}")
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        # Rank 0's verdict (a str between the job's own processes, which passed its handshake).
        said = [str(error) if error is not None else "", isinstance(error, RunDirBusy)]
        dist.broadcast_object_list(said, src=0)
        if said[0]:
            raise (RunDirBusy if said[1] else RunDirError)(str(said[0]), every_rank=True)
    if error is not None:
        raise error
