"""The environment ``meshrun launch`` gives torchrun's agent and through it every worker (the
agent copies ``os.environ`` into each), and the signal handlers it puts back afterwards.

Restoring matters because tests and tools call ``launch_local`` in-process, and the agent
both writes ``os.environ`` and installs its own SIGINT/SIGTERM handlers."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from types import FrameType
from typing import Any, Protocol, TypeAlias

from meshrun.config import CONFIG_ENV
from meshrun.launch.multinode.nodes import NetworkPlan
from meshrun.runtime.secret import SECRET_ENV, JobSecret

# torchrun's c10d rendezvous lets workers reuse the agent's TCP store by default; with
# restarts that fails or hangs in 6 of 9 runs measured here, and never when disabled.
SHARE_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
# One node: Gloo's sockets on loopback, not on the address the hostname resolves to.
GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"

_SignalHandler: TypeAlias = "Callable[[int, FrameType | None], Any] | int | None"


class WorkerSettings(Protocol):
    """What of a launch spec reaches the workers' environment (``LaunchSpec`` has it)."""

    @property
    def extra_env(self) -> dict[str, str]: ...
    @property
    def config_path(self) -> str | None: ...
    @property
    def omp_num_threads(self) -> int: ...
    @property
    def procs_per_node(self) -> int: ...


@contextmanager
def launch_environment(
    spec: WorkerSettings, network: NetworkPlan | None = None, secret: JobSecret | None = None
) -> Iterator[str]:
    """Set the workers' environment for the agent; put os.environ and signals back after.

    The agent copies os.environ into every worker, so this is how settings reach them.
    Restoring matters because tests and tools call ``launch_local`` in-process, and the
    agent both writes os.environ and installs its own SIGINT/SIGTERM handlers.
    """
    saved_handlers = _save_signal_handlers()
    try:
        with restored_environ():
            os.environ.update(spec.extra_env)
            if network is not None:
                os.environ.update(network.env)  # GLOO/NCCL_SOCKET_IFNAME the user had not set
            else:
                if os.path.exists("/sys/class/net/lo"):  # Linux's loopback name
                    os.environ.setdefault(GLOO_IFNAME_ENV, "lo")
            if secret is not None:  # the handshake, the agent's rendezvous and the workers read it
                os.environ[SECRET_ENV] = secret.key.decode()
            os.environ.setdefault(SHARE_STORE_ENV, "1")  # only if the user did not choose
            if spec.config_path:
                # Absolute, so a worker that changes directory still finds it.
                os.environ[CONFIG_ENV] = os.path.abspath(spec.config_path)
            omp_threads = _omp_num_threads(spec, os.environ)
            os.environ["OMP_NUM_THREADS"] = omp_threads
            yield omp_threads
    finally:
        _restore_signal_handlers(saved_handlers)


def _omp_num_threads(spec: WorkerSettings, environ: Mapping[str, str]) -> str:
    if spec.omp_num_threads > 0:
        return str(spec.omp_num_threads)
    if environ.get("OMP_NUM_THREADS"):
        return environ["OMP_NUM_THREADS"]
    # Without this each worker starts one thread per core and they oversubscribe the CPU.
    return str(max(1, _usable_cores() // spec.procs_per_node))


def _usable_cores() -> int:
    # The affinity mask, not the machine: SLURM, cgroups and taskset narrow it.
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


@contextmanager
def restored_environ() -> Iterator[None]:
    """``os.environ`` as it was on entry, put back on exit (what the block set, changed or
    removed): an in-process launch leaves its caller's environment as it found it."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        _restore_environ(saved)


def _restore_environ(saved: dict[str, str]) -> None:
    for key in set(os.environ) - set(saved):
        del os.environ[key]
    for key, value in saved.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


def _save_signal_handlers() -> dict[signal.Signals, _SignalHandler]:
    if threading.current_thread() is not threading.main_thread():
        return {}  # the agent only installs handlers from the main thread
    names = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")
    sigs = [getattr(signal, name) for name in names if hasattr(signal, name)]
    return {sig: signal.getsignal(sig) for sig in sigs}


def _restore_signal_handlers(saved: dict[signal.Signals, _SignalHandler]) -> None:
    for sig, handler in saved.items():
        if handler is not None:  # None: set outside Python, cannot be put back from here
            signal.signal(sig, handler)
