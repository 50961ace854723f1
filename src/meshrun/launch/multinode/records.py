"""The handshake's records and the pure decisions on them: what each node reports about itself,
how many nodes are awaited, what stops the job (each problem naming the hosts), who is
missing, and the lines printed while waiting. ``handshake.py`` runs the protocol over the
store; everything here is a function of records alone."""

from __future__ import annotations

import json
import socket
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

# Fields that must be equal on every node, with the words used in messages.
MUST_MATCH = {
    "torch": "torch versions",
    "cuda": "CUDA versions",
    "nccl": "NCCL versions",
    "python": "Python versions",
    "meshrun": "meshrun versions",
    "nproc": "processes per node",
    "config_digest": "configs (digest of the resolved config, per-node keys left out)",
}


@dataclass(frozen=True)
class NodeInfo:
    """What one node reports about itself."""

    hostname: str
    node_rank: int
    nproc: int
    torch: str
    cuda: str
    nccl: str
    python: str
    meshrun: str
    config_digest: str
    settings: dict[str, Any] = field(default_factory=dict)  # the shared config, flat
    token: str = ""  # unique per meshrun launch process: tells a node's own record apart

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> NodeInfo:
        return cls(**json.loads(text))


@dataclass(frozen=True)
class JoinTarget:
    """How many nodes the handshake waits for: N, or MIN of an elastic MIN:MAX."""

    min_nodes: int
    max_nodes: int

    @property
    def elastic(self) -> bool:
        return self.min_nodes != self.max_nodes

    @property
    def text(self) -> str:
        """As torchrun's ``--nnodes`` takes it: N, or MIN:MAX for an elastic range."""
        return f"{self.min_nodes}:{self.max_nodes}" if self.elastic else str(self.max_nodes)


@dataclass(frozen=True)
class Joined:
    """A node that joined, as every node learns it from the host's decision."""

    hostname: str
    node_rank: int


NAMES_SHOWN = 8  # a line names this many nodes, then says how many more


def name_list(names: Sequence[str], limit: int = NAMES_SHOWN) -> str:
    """'a, b, c' or, past ``limit``, 'a, b, ... and 1016 more': one line at 1,024 nodes."""
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"


def local_node_info(
    node_rank: int, nproc: int, config_digest: str, settings: dict[str, Any] | None = None
) -> NodeInfo:
    """This node's record (versions read from the installed torch and meshrun)."""
    import platform

    import torch

    from meshrun._version import __version__

    return NodeInfo(
        hostname=socket.gethostname(),
        node_rank=node_rank,
        nproc=nproc,
        torch=torch.__version__,
        cuda=torch.version.cuda or "none",
        nccl=_nccl_version(),
        python=platform.python_version(),
        meshrun=__version__,
        config_digest=config_digest,
        settings=dict(settings or {}),
        token=uuid.uuid4().hex[:12],
    )


def _nccl_version() -> str:
    import torch

    if not torch.cuda.is_available():
        return "none"  # not loaded on a CPU-only node, and not compared against GPU nodes' value
    version = torch.cuda.nccl.version()
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


# --- pure decisions ------------------------------------------------------------------------


def find_problems(nodes: Sequence[NodeInfo], target: JoinTarget) -> list[str]:
    """Everything that stops the job, each naming the hosts involved; [] if all agree."""
    problems = []
    if not target.elastic:
        problems += _duplicate_ranks(nodes, target)
    if len(nodes) > target.max_nodes:
        problems.append(
            f"{len(nodes)} nodes joined but --nnodes allows at most {target.max_nodes}: "
            f"{_hosts(nodes)}; start exactly that many, or raise --nnodes"
        )
    for name, words in MUST_MATCH.items():
        groups = _group_by(nodes, name)
        if name == "nccl":
            groups.pop("none", None)  # CPU-only nodes have no NCCL; compare the GPU nodes only
        if len(groups) > 1:
            detail = "; ".join(f"{value} on {_hosts(g)}" for value, g in groups.items())
            if name == "config_digest":
                detail += config_diff(nodes)
            problems.append(f"{words} differ between nodes: {detail}")
    return problems


def config_diff(nodes: Sequence[NodeInfo], limit: int = 5) -> str:
    """' (optim.lr: 0.1 on node0, 0.2 on node1; ...)': the keys whose values differ."""
    keys = sorted({k for n in nodes for k in n.settings})
    differing = [k for k in keys if len({json.dumps(n.settings.get(k)) for n in nodes}) > 1]
    if not differing:
        return ""
    parts = [
        f"{k}: " + ", ".join(f"{n.settings.get(k)!r} on {n.hostname}" for n in nodes)
        for k in differing[:limit]
    ]
    more = f"; and {len(differing) - limit} more" if len(differing) > limit else ""
    return " (" + "; ".join(parts) + more + ")"


def _duplicate_ranks(nodes: Sequence[NodeInfo], target: JoinTarget) -> list[str]:
    problems = []
    for rank, group in sorted(_group_by(nodes, "node_rank").items(), key=lambda kv: int(kv[0])):
        if len(group) > 1:
            problems.append(
                f"node_rank {rank} is claimed by {len(group)} nodes: {_hosts(group)}; give each "
                f"node its own --node-rank in [0, {target.max_nodes})"
            )
    return problems


def _group_by(nodes: Sequence[NodeInfo], field: str) -> dict[str, list[NodeInfo]]:
    groups: dict[str, list[NodeInfo]] = {}
    for node in nodes:
        groups.setdefault(str(getattr(node, field)), []).append(node)
    return groups


def _hosts(nodes: Sequence[NodeInfo]) -> str:
    return ", ".join(f"{n.hostname} (node_rank {n.node_rank})" for n in nodes)


def missing_ranks(nodes: Sequence[NodeInfo], target: JoinTarget) -> list[int]:
    """Node ranks nobody has claimed yet (a fixed-size job only; elastic ranks are the agent's)."""
    if target.elastic:
        return []
    present = {n.node_rank for n in nodes}
    return [r for r in range(target.max_nodes) if r not in present]


def is_complete(nodes: Sequence[NodeInfo], target: JoinTarget) -> bool:
    if target.elastic:
        return len(nodes) >= target.min_nodes
    return not missing_ranks(nodes, target)


def waiting_message(nodes: Sequence[NodeInfo], target: JoinTarget) -> str:
    """'1/2 nodes joined [node0]; waiting for node_rank 1' (or, elastic: 'for 1 more node')."""
    names = name_list([n.hostname for n in sorted(nodes, key=lambda n: n.node_rank)])
    head = f"{len(nodes)}/{target.min_nodes} nodes joined [{names}]"
    if target.elastic:
        more = target.min_nodes - len(nodes)
        return f"{head}; waiting for {more} more node{'s' if more != 1 else ''} (elastic " + (
            f"{target.min_nodes}:{target.max_nodes})"
        )
    ranks = name_list([str(r) for r in missing_ranks(nodes, target)], 2 * NAMES_SHOWN)
    return f"{head}; waiting for node_rank {ranks}"
