"""``meshrun launch`` across hosts: flag checks, the network plan, and the torchrun settings.

One ``meshrun launch`` runs on every node with the same ``--rdzv-endpoint`` (an address of one
of the nodes) and ``--nnodes``. Before the torchrun agent starts, this module checks the flags
(pure), chooses the interface that routes to the endpoint (``netif``), and decides whether this
node hosts the rendezvous store (it owns the endpoint's address). ``handshake`` then checks the
nodes against each other over that store; the agent's c10d rendezvous does the rest.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from meshrun.config import Config, ConfigError
from meshrun.config.launch_values import check_rdzv_id, parse_endpoint, parse_rdzv_conf
from meshrun.launch.multinode import netif
from meshrun.launch.multinode.records import JoinTarget
from meshrun.launch.spec import Rendezvous, parse_nnodes

# The typed rendezvous lives with the launch spec (launch/spec.py); named here for callers and
# the tests that check the shaped values' errors next to the multi-node checks.
__all__ = [
    "JoinTarget",
    "NetworkPlan",
    "Rendezvous",
    "parse_endpoint",
    "parse_nnodes",
    "parse_rdzv_conf",
    "plan_network",
    "shared_digest",
    "shared_settings",
    "validate",
]

# Keys that may differ between the nodes of one job: left out of the digest the nodes compare.
PER_NODE_KEYS = ("node_rank", "interface", "omp_num_threads", "join_timeout_s", "nproc_per_node")


def validate(rdzv: Rendezvous) -> None:
    """The multi-node checks that need more than one value, before anything starts
    (ConfigError naming the flags)."""
    nodes, nnodes = rdzv.nodes, rdzv.nodes.text
    if nodes.max_nodes > 1 and rdzv.endpoint is None:
        raise ConfigError(
            f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT (launch.rdzv_endpoint): the "
            "address of one of the nodes, the same on every node"
        )
    if not 0 <= rdzv.node_rank < nodes.max_nodes:
        raise ConfigError(
            f"--node-rank / launch.node_rank = {rdzv.node_rank} is not allowed with --nnodes "
            f"{nnodes}: expected 0..{nodes.max_nodes - 1}"
        )
    check_rdzv_id(rdzv.rdzv_id)


def shared_digest(cfg: Config) -> str:
    """The config digest the nodes compare: the per-node launch keys are left out."""
    defaults = dataclasses.asdict(type(cfg.launch)())
    launch = dataclasses.replace(cfg.launch, **{k: defaults[k] for k in PER_NODE_KEYS})
    return dataclasses.replace(cfg, launch=launch).digest()


def shared_settings(cfg: Config) -> dict[str, Any]:
    """``{"section.key": value}`` without the per-node keys: what a config mismatch names."""
    per_node = {f"launch.{k}" for k in PER_NODE_KEYS}
    flat = {f"{s}.{k}": v for s, body in cfg.to_dict().items() for k, v in body.items()}
    return {k: v for k, v in flat.items() if k not in per_node}


@dataclass(frozen=True)
class NetworkPlan:
    """This node's part in a multi-node job, derived from one interface choice."""

    interface: netif.Interface
    rdzv_host: str  # as given
    rdzv_address: str  # resolved IPv4
    rdzv_port: int
    is_host: bool  # this node owns the endpoint's address: it hosts the store
    env: dict[str, str]  # GLOO/NCCL_SOCKET_IFNAME the user had not set
    warnings: list[str]
    user_conf: tuple[tuple[str, str], ...] = ()  # --rdzv-conf as given (Rendezvous.conf)


def plan_network(rdzv: Rendezvous, requested: str, environ: Mapping[str, str]) -> NetworkPlan:
    """Choose the interface (``requested`` if given, else the route to the endpoint). This
    node hosts the store if it owns the endpoint's address, unless ``--rdzv-conf is_host=``
    says otherwise (several launches on one machine)."""
    if rdzv.endpoint is None:
        raise ConfigError("a multi-node launch needs --rdzv-endpoint HOST:PORT")
    host, port = rdzv.endpoint
    address = netif.resolve_host(host)
    if ipaddress.ip_address(address).is_loopback:
        # All nodes on this machine (a test, or one host playing several): loopback is right.
        chosen, warnings = netif.choose_interface(host, requested, multi_host=False)
    else:
        chosen, warnings = netif.choose_interface(host, requested, multi_host=True)
    return NetworkPlan(
        interface=chosen,
        rdzv_host=host,
        rdzv_address=address,
        rdzv_port=port,
        is_host=_is_host(address, dict(rdzv.conf).get("is_host")),
        env=netif.socket_env(chosen, environ),
        warnings=warnings,
        user_conf=rdzv.conf,
    )


def _is_host(address: str, given: str | None) -> bool:
    if given is None:
        return netif.is_local_address(address)
    return given.strip().lower() in ("1", "true", "yes", "y", "on")
