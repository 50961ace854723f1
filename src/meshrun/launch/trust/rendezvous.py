"""meshrun's rendezvous backend for torchrun's agent: c10d's protocol, signed JSON state.

torch's c10d rendezvous keeps its state as a pickle in the store (``torch.rendezvous.<id>``)
and every agent unpickles what it reads there, so anyone who can reach the store's port runs
code in the launcher, or joins the job. meshrun registers a backend of its own, ``meshrun``,
with torch's handler registry: the handler is torch's ``DynamicRendezvousHandler`` (join,
restart rounds, min/max nodes, keep-alive as in c10d), over :class:`SignedBackend`, which
keeps the state as JSON with an HMAC of the job secret under a key of its own. The pickles
the handler asks for are made here from verified JSON, and the pickles it hands over are
its own, made in this process: nothing read from the network is unpickled.

A value that does not verify (a stranger's write, a replayed older state, a state signed in
another launch of the same run directory, whose ``job.secret`` is reused) is refused with one
line, and the last good state is put back, so the job trains on. Every signed state carries
the launch's nonce (:data:`NONCE_ENV`: drawn by the launch, shared by its nodes through the
handshake), so a state recorded in an earlier run never verifies in this one. Each node's
keep-alive goes to a signed key of its own, not to the shared state (``heartbeats.py``). A
deleted state is put back the same way, from the last good state this agent holds, with one
line: a store emptied under the job neither stops its restarts nor hangs its agents. The store itself is
created by meshrun, bound to the address asked for (:func:`listen_store`), never to all
interfaces as ``TCPStore`` does on its own.
"""

from __future__ import annotations

import os
import secrets
import socket
import sys
import threading
from datetime import timedelta

from torch.distributed import PrefixStore, Store, TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousParameters,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.api import rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousTimeout,
    create_handler,
)
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from meshrun.launch.trust.signed_backend import BACKEND_NAME as BACKEND_NAME
from meshrun.launch.trust.signed_backend import Rounds as Rounds
from meshrun.launch.trust.signed_backend import SignedBackend as SignedBackend
from meshrun.runtime.secret import NONCE_ENV, from_env

# Stores this launcher created (the host's), by port: the handler uses them as they are (a
# second server on the port would fail; the endpoint may name the address differently).
_STORES: dict[int, TCPStore] = {}
_LOCK = threading.Lock()


def listen_store(host: str, port: int, timeout_s: float) -> TCPStore:
    """A TCPStore server listening on ``host`` only (port 0: one the OS picks).

    TCPStore binds its server to every interface; handed a socket we bound ourselves
    (``master_listen_fd``), it listens where we asked. The store is registered for the
    ``meshrun`` handler of this process."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    bound = sock.getsockname()[1]
    # multi_tenant: torch's static rendezvous, asking for a server on this port in this
    # process, gets this one (bound where we asked) instead of failing on the port.
    store = TCPStore(
        host,
        bound,
        is_master=True,
        wait_for_workers=False,
        master_listen_fd=sock.detach(),
        timeout=timedelta(seconds=timeout_s),
        multi_tenant=True,
    )
    with _LOCK:
        _STORES[bound] = store
    return store


def forget_store(store: TCPStore) -> None:
    with _LOCK:
        for key in [k for k, v in _STORES.items() if v is store]:
            del _STORES[key]


def register() -> None:
    """Make ``--rdzv-backend meshrun`` known to torchrun's agent in this process (once)."""
    # Registering the same function again is allowed; a ValueError means another creator
    # holds the name, which is a bug worth seeing.
    rendezvous_handler_registry.register(BACKEND_NAME, create_signed_handler)


def signed_backend_argv(argv: list[str]) -> list[str]:
    """torchrun's argv with ``--rdzv-backend c10d`` made ``meshrun`` (registered here)."""
    if "--rdzv-backend" not in argv:
        return list(argv)
    i = argv.index("--rdzv-backend")
    if argv[i + 1] != "c10d":
        return list(argv)  # static: torchrun's own, as the user asked
    register()
    return [*argv[: i + 1], BACKEND_NAME, *argv[i + 2 :]]


def main(argv: list[str] | None = None) -> None:
    """``python -m meshrun.launch.trust.rendezvous TORCHRUN_ARGS``: torchrun with the signed
    rendezvous (for launchers that start the agent as a process of its own); the secret
    comes from ``MESHRUN_JOB_SECRET``."""
    from torch.distributed.run import main as torchrun_main

    from_env()  # fail before the agent starts, naming the variable
    os.environ.setdefault(NONCE_ENV, new_nonce())  # started alone: this process's launch
    torchrun_main(signed_backend_argv(sys.argv[1:] if argv is None else argv))


def new_nonce() -> str:
    """A fresh launch nonce (random, 16 hex characters)."""
    return secrets.token_hex(8)


def launch_nonce(environ: dict[str, str] | None = None) -> str:
    """The nonce this launch's signed states carry (:data:`NONCE_ENV`); an error naming the
    variable when the launcher set none."""
    value = (os.environ if environ is None else environ).get(NONCE_ENV, "")
    if not value:
        raise RendezvousStateError(
            f"{NONCE_ENV} is not set: the signed rendezvous binds its state to one launch; "
            "start the job with meshrun launch (or python -m meshrun.launch.trust.rendezvous)"
        )
    return value


def create_signed_handler(params: RendezvousParameters) -> RendezvousHandler:
    """torch's dynamic handler over the signed backend; the store the workers' bootstrap
    keys go to is prefixed with a name derived from the secret, so a stranger's agent on the
    same store (plain c10d) never meets this job's keys. The workers' store port is held
    from the moment it is chosen (``launch/agent/store_port.py``)."""
    from meshrun.launch.agent.store_port import HeldPortHandler

    secret = from_env()
    store = _store_for(params)
    keep_alive = timedelta(seconds=params.get_as_int("keep_alive_interval", 5) or 5)
    tries = params.get_as_int("keep_alive_max_attempt", 3) or 3
    backend = SignedBackend(
        store, params.run_id, secret, launch_nonce(), keep_alive, tries, rounds=rounds_from(params)
    )
    prefixed = PrefixStore(f"meshrun.{secret.tag(params.run_id)}", store)
    return HeldPortHandler(create_handler(prefixed, backend, params))


def rounds_from(params: RendezvousParameters) -> Rounds:
    """The round settings torch's handler gets from the same parameters."""
    last_call = params.get_as_int("last_call_timeout")
    timeout = RendezvousTimeout(last_call=timedelta(seconds=last_call) if last_call else None)
    return Rounds(params.min_nodes, params.max_nodes, timeout.last_call)


def _store_for(params: RendezvousParameters) -> Store:
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=29400)
    timeout = timedelta(seconds=params.get_as_int("read_timeout", 60) or 60)
    with _LOCK:
        store = _STORES.get(port)
    if store is not None:
        return store
    is_host = params.get_as_bool("is_host")
    if is_host is None:  # as torch's c10d guesses: the endpoint is this machine's address
        is_host = _is_local(host)
    try:
        if is_host:
            return listen_store(host, port, timeout.total_seconds())
    except OSError as err:
        if params.get_as_bool("is_host") is not None:
            raise RendezvousConnectionError(f"cannot host the store {host}:{port}: {err}") from err
        # Another agent on this machine hosts it (several agents on one host): join it.
    try:
        return TCPStore(host, port, is_master=False, timeout=timeout)
    except (RuntimeError, ValueError) as err:
        raise RendezvousConnectionError(f"the rendezvous store {host}:{port}: {err}") from err


def _is_local(host: str) -> bool:
    from meshrun.launch.multinode.netif import is_local_address, resolve_host

    try:
        return is_local_address(resolve_host(host))
    except (OSError, ValueError, RuntimeError):  # a name that does not resolve: not ours
        return False


if __name__ == "__main__":
    main()
