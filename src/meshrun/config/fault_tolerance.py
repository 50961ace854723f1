"""``[fault_tolerance]``: replica groups on torchft (docs/fault_tolerance.md).

The world is split into ``replica_groups`` groups, each its own torchrun job (its own process
group, its own restarts); across groups the gradients are averaged through torchft's Manager,
so a group can die and rejoin while the others keep stepping. ``group_index`` is written by
the launcher into each group's copy of the resolved config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from meshrun.config.fields import ConfigError, check_section, setting

__all__ = ["FaultToleranceConfig", "check_lighthouse"]


@dataclass
class FaultToleranceConfig:
    """Replica-group fault tolerance (torchft); 1 replica group = off."""

    SECTION: ClassVar[str] = "fault_tolerance"  # the [section] of the TOML file

    def __post_init__(self) -> None:
        check_section(self)
        if self.group_index >= self.replica_groups:
            raise ConfigError(
                f"fault_tolerance.group_index = {self.group_index} is not a group of "
                f"fault_tolerance.replica_groups = {self.replica_groups}: it must be in "
                f"[0, {self.replica_groups}); meshrun launch --replica-groups sets it per group"
            )
        if self.min_replicas > self.replica_groups:
            raise ConfigError(
                f"fault_tolerance.min_replicas = {self.min_replicas} exceeds "
                f"fault_tolerance.replica_groups = {self.replica_groups}: no quorum could form; "
                "use at most replica_groups, or 0 for a majority"
            )
        if self.lighthouse:
            check_lighthouse(self.lighthouse)

    replica_groups: int = setting(
        1, "Replica groups (each its own torchrun job, healed live by its peers); 1 = off.", min=1
    )
    group_index: int = setting(
        0, "This group's index in [0, replica_groups); set per group by meshrun launch.", min=0
    )
    lighthouse: str = setting(
        "", "HOST:PORT of torchft's lighthouse; empty = the one meshrun launch starts itself."
    )
    min_replicas: int = setting(
        0, "Groups a step needs to commit; 0 = a majority (replica_groups // 2 + 1).", min=0
    )
    heartbeat_timeout_ms: int = setting(
        5000, "The lighthouse drops a group silent this long (the survivors' pause).", min=100
    )
    quorum_timeout_s: float = setting(
        120.0, "Give up when no quorum of min_replicas groups forms in this long.", min=1
    )
    timeout_s: float = setting(
        60.0, "Cross-group collectives and healing transfers time out after this long.", min=1
    )
    missing_group: Literal["shrink"] = setting(
        "shrink",
        "While a group is missing each step trains the live groups' shares: consecutive "
        "positions of the global order from the current one (docs/fault_tolerance.md); "
        "metrics log live_groups and the samples trained.",
    )

    @property
    def enabled(self) -> bool:
        return self.replica_groups > 1

    def quorum_size(self) -> int:
        """The groups a step needs: ``min_replicas``, or a majority when it is 0."""
        return self.min_replicas or self.replica_groups // 2 + 1


def check_lighthouse(text: str) -> tuple[str, int]:
    """``HOST:PORT`` of a lighthouse as (host, port); the error names the key and the flag."""
    host, sep, port_text = text.removeprefix("http://").rpartition(":")
    port = int(port_text) if port_text.isdigit() else -1
    if not sep or not host or not 1 <= port <= 65535:
        raise ConfigError(
            f"--lighthouse / fault_tolerance.lighthouse = {text!r} is not allowed: expected "
            "HOST:PORT with PORT in 1..65535, where `meshrun lighthouse` listens, "
            "e.g. 10.0.0.1:29510"
        )
    return host, port
