"""The workers' store port, held from the moment it is chosen until rank 0 listens on it.

With ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (meshrun's default, see ``environment.py``)
torch's rendezvous picks ``MASTER_PORT`` by binding port 0 and closing the socket at once
(``get_free_port``); rank 0 binds that port again seconds later, once the workers have
started. Any bind to port 0 on the machine in between may be handed the same port, and
the job fails at start: ``rank 0 cannot listen on ... (Address already in use)``.

:class:`HeldPortHandler` wraps the rendezvous handler: the node that becomes rank 0 binds a
socket of its own to port 0 with ``SO_REUSEADDR`` and keeps it bound, never listening, for as
long as the handler lives, and publishes that port to the round's store in place of torch's
pick. Linux never hands a bound port to another bind to port 0, so nothing else on the
machine can take it; rank 0 (``socket.create_server`` or ``TCPStore``, both set
``SO_REUSEADDR``) still binds and listens on it, since the held socket is not listening.
The same port serves every round this node is rank 0 in.
"""

from __future__ import annotations

import os
import socket

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo
from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo

SHARE_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
# In the round's store (torch's prefix holds the round number): read by every node.
PORT_KEY = "meshrun.MASTER_PORT"


def hold_port(addr: str) -> socket.socket:
    """A socket bound to a port the OS picks, on every address of ``addr``'s family, with
    ``SO_REUSEADDR`` and not listening: rank 0 can bind the port, nobody's port 0 can."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("", 0))
    except OSError:
        sock.close()
        raise
    return sock


class HeldPortHandler(RendezvousHandler):
    """``inner`` with the workers' ``MASTER_PORT`` chosen by a held socket (see the module)."""

    def __init__(self, inner: RendezvousHandler) -> None:
        self._inner = inner
        self._held: socket.socket | None = None

    def next_rendezvous(self) -> RendezvousInfo:
        info = self._inner.next_rendezvous()
        if os.environ.get(SHARE_STORE_ENV, "0") != "1":
            return info  # the agent's own store serves the workers: no port to bind later
        boot = info.bootstrap_store_info
        assert boot is not None, "torch's handler always gives the workers' store address"
        if info.rank == 0:
            if self._held is None:
                self._held = hold_port(boot.master_addr)
            info.store.set(PORT_KEY, str(self._held.getsockname()[1]))
        port = int(info.store.get(PORT_KEY).decode())
        held = RendezvousStoreInfo(master_addr=boot.master_addr, master_port=port)
        return RendezvousInfo(info.store, info.rank, info.world_size, held)

    def shutdown(self) -> bool:
        self.release()
        return self._inner.shutdown()

    def release(self) -> None:
        if self._held is not None:
            self._held.close()
            self._held = None

    # --- the rest is the inner handler's ---------------------------------------------

    def get_backend(self) -> str:
        return self._inner.get_backend()

    @property
    def use_agent_store(self) -> bool:
        return self._inner.use_agent_store

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return self._inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self._inner.get_run_id()
