"""torchft's Manager as meshrun builds it: its servers bound where meshrun chose, its quorums
checked before torchft acts on them, its heals signed and loaded without pickle.

torchft 0.2.0 gives no option for two of these. ``Manager.__init__`` binds its manager server
to ``[::]:<port>`` (every interface), and acts on each quorum inside its own thread (joins
the store it names, heals from the peer it names) with no hook in between. So while the
Manager is built, the two names it builds them with (``torchft.manager.ManagerServer`` and
``ManagerClient``) are swapped for a server bound to meshrun's address and a client whose
quorum call refuses a quorum with a stranger in it (ft/auth.py) and asks again. The swap is
checked after construction: a torchft that builds them otherwise is an error, never an
unprotected job.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from meshrun.config import ConfigError
from meshrun.config.fault_tolerance import FaultToleranceConfig, check_lighthouse
from meshrun.ft.auth import Member, job_key, quorum_problem, replica_id
from meshrun.ft.heal import StateCodec
from meshrun.runtime.ports import free_port

if TYPE_CHECKING:
    from torchft import Manager

__all__ = ["CheckedClient", "bind_host", "build_manager"]

log = logging.getLogger("meshrun")
LOOPBACK = "127.0.0.1"


def build_manager(
    cfg: FaultToleranceConfig,
    codec: StateCodec,
    load: Callable[[dict[str, Any]], None],
    refused: list[str],
) -> Manager:
    """This rank's torchft Manager (the quorum is synchronous: a restarted group loads its
    peer's state before its first forward); ``refused`` collects the quorums refused."""
    from torchft import Manager, ProcessGroupGloo

    from meshrun.ft.transport import SignedTransport

    key = job_key()
    host = bind_host(cfg.lighthouse)
    timeout = timedelta(seconds=cfg.timeout_s)
    store = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    rank = dist.get_rank()
    port = free_port(host) if rank == 0 else 0  # only rank 0 serves torchft's manager
    url_host = f"[{host}]" if ":" in host else host
    member = Member(cfg.group_index, f"http://{url_host}:{port}", store)
    # Zero-padded first: participants are ranked by this id, so group g is participant g
    # when every group is live (the shares of plain data parallelism, ft/data.py).
    name = replica_id(key, member) if rank == 0 else f"meshrun_group_{cfg.group_index:04d}"
    with _torchft_built(url_host, key, refused):
        manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout),
            load_state_dict=load,
            state_dict=codec.save,
            min_replica_size=cfg.quorum_size(),
            use_async_quorum=False,
            timeout=timeout,
            quorum_timeout=timedelta(seconds=cfg.quorum_timeout_s),
            rank=rank,
            world_size=dist.get_world_size(),
            store_addr=os.environ["MASTER_ADDR"],
            store_port=int(os.environ["MASTER_PORT"]),
            lighthouse_addr=f"http://{cfg.lighthouse.removeprefix('http://')}",
            replica_id=name,
            port=port or None,
            hostname=url_host,
            checkpoint_transport=SignedTransport(key, host, timeout),
            init_sync=False,  # every group seeds the same initial weights (init_seeds)
        )
    if not isinstance(getattr(manager, "_client", None), CheckedClient):
        manager.shutdown(wait=False)
        raise RuntimeError(
            "replica groups: this torchft builds its Manager differently from 0.2.0, so meshrun "
            "cannot check its quorums or bind its server; install torchft 0.2.0 (meshrun[ft])"
        )
    return manager


def bind_host(lighthouse: str) -> str:
    """Where this group's servers listen and what they advertise: loopback when the
    lighthouse is on loopback (a one-node job), else this host's address on the route toward
    the lighthouse (the interface the groups reach each other through)."""
    host, _ = check_lighthouse(lighthouse)
    try:
        address = socket.gethostbyname(host.strip("[]"))
    except OSError as err:
        raise ConfigError(
            f"fault_tolerance.lighthouse = {lighthouse!r}: its host does not resolve ({err}); "
            "use an IP address or a name every group's host resolves"
        ) from None
    if ipaddress.ip_address(address).is_loopback:
        return LOOPBACK
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((address, 9))  # sends nothing: asks the kernel for the route
        source: str = sock.getsockname()[0]
    return source


class CheckedClient:
    """torchft's ManagerClient, whose quorum call refuses a quorum meshrun must not act on
    (ft/auth.py): it names it in one line and asks again, within the quorum's timeout. Every
    rank of every group sees the same quorum, so all of them refuse it alike."""

    def __init__(self, inner: Any, key: bytes, refused: list[str]) -> None:
        self._inner, self._key, self.refused = inner, key, refused

    def _quorum(self, **kwargs: Any) -> Any:
        timeout: timedelta = kwargs["timeout"]
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            result = self._inner._quorum(**kwargs)
            problem = quorum_problem(self._key, result)
            if not problem:
                return result
            line = f"quorum {result.quorum_id} refused: {problem}"
            self.refused.append(line)
            log.warning("replica groups: %s; asking again", line)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"replica groups: no quorum of this job's groups alone in "
                    f"{timeout.total_seconds():.0f} s (fault_tolerance.quorum_timeout_s); "
                    f"the last one: {line}"
                )
            kwargs["timeout"] = timedelta(seconds=left)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@contextmanager
def _torchft_built(url_host: str, key: bytes, refused: list[str]) -> Iterator[None]:
    """While a Manager is built: its manager server bound to ``url_host`` (torchft 0.2.0
    binds ``[::]:<port>`` with no option) and its client a :class:`CheckedClient`."""
    import torchft.manager as tm

    server_class, client_class = tm.ManagerServer, tm.ManagerClient

    def bound_server(**kwargs: Any) -> Any:
        kwargs["bind"] = f"{url_host}:{kwargs['bind'].rsplit(':', 1)[1]}"
        return server_class(**kwargs)

    def checked_client(addr: str, connect_timeout: timedelta) -> CheckedClient:
        return CheckedClient(client_class(addr, connect_timeout=connect_timeout), key, refused)

    tm.ManagerServer, tm.ManagerClient = bound_server, checked_client
    try:
        yield
    finally:
        tm.ManagerServer, tm.ManagerClient = server_class, client_class
