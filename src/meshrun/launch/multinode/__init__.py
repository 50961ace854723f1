"""Several nodes under one rendezvous: the node range and the settings every node must share
(``nodes``), the interface each node reaches the others on (``netif``) and the signed join
handshake that checks them before any worker starts (``handshake``). See docs/launch.md."""

from typing import TYPE_CHECKING

from meshrun._lazy import lazy_exports

if TYPE_CHECKING:
    from meshrun.launch.multinode.nodes import Rendezvous, parse_nnodes, plan_network

__getattr__ = lazy_exports(
    globals(),
    {
        "Rendezvous": "meshrun.launch.multinode.nodes",
        "parse_nnodes": "meshrun.launch.multinode.nodes",
        "plan_network": "meshrun.launch.multinode.nodes",
    },
)

__all__ = ["Rendezvous", "parse_nnodes", "plan_network"]
