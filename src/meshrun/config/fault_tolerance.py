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

__all__ = [
    "FaultToleranceConfig",
    "check_diloco",
    "check_diloco_checkpoints",
    "check_diloco_groups",
    "check_lighthouse",
]


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
        check_diloco(self)
        check_streaming(self)

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

    diloco_sync_every: int = setting(
        0,
        "DiLoCo: inner steps each group takes alone between outer steps (H); 0 = off (every "
        "step averages the gradients across groups). Needs replica_groups > 1.",
        min=0,
    )
    diloco_outer_lr: float = setting(
        0.7, "DiLoCo: the outer SGD's learning rate (> 0), applied to the averaged pseudo-gradient."
    )
    diloco_outer_momentum: float = setting(0.9, "DiLoCo: the outer SGD's momentum, in [0, 1).")
    diloco_nesterov: bool = setting(
        True, "DiLoCo: Nesterov momentum in the outer SGD (needs diloco_outer_momentum > 0)."
    )
    diloco_fragments: int = setting(
        1,
        "Streaming DiLoCo: the model split into this many fragments, each synced in turn every "
        "diloco_sync_every / diloco_fragments steps; 1 = the whole model at once.",
        min=1,
    )
    diloco_quantize: bool = setting(
        False, "DiLoCo: quantize the outer all-reduce (not available: see docs/fault_tolerance.md)."
    )
    diloco_fragment_sync_delay: int = setting(
        0,
        "Streaming DiLoCo's tau: a fragment's outer all-reduce starts this many inner steps "
        "before its outer step and overlaps them; < diloco_sync_every / diloco_fragments. "
        "0 = start and finish at the outer step.",
        min=0,
    )
    diloco_fragment_update_alpha: float = setting(
        0.0,
        "Streaming DiLoCo: after a fragment's outer step its weights are global + alpha x "
        "(local - global), local = the group's weights then; in [0, 1]; 0 = the synchronised "
        "weights (the steps taken during the delay are dropped).",
    )

    @property
    def diloco(self) -> bool:
        """Whether the groups run DiLoCo (inner steps alone, an outer step every H)."""
        return self.diloco_sync_every > 0

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


def check_diloco(ft: FaultToleranceConfig) -> None:
    """The ``diloco_*`` keys against each other (the group count is checked with the world:
    :func:`check_diloco_groups`, since ``meshrun launch --replica-groups`` sets it later)."""
    h, n = ft.diloco_sync_every, ft.diloco_fragments
    if ft.diloco_outer_lr <= 0:
        raise ConfigError(
            f"fault_tolerance.diloco_outer_lr = {ft.diloco_outer_lr} is not allowed: the outer "
            "SGD's learning rate must be > 0 (the papers use 0.7; 1.0 with momentum 0 is "
            "plain averaging of the groups' weights)"
        )
    if not 0 <= ft.diloco_outer_momentum < 1:
        raise ConfigError(
            f"fault_tolerance.diloco_outer_momentum = {ft.diloco_outer_momentum} is not allowed: "
            "it must be in [0, 1) (the papers use 0.9)"
        )
    if ft.diloco_nesterov and ft.diloco_outer_momentum == 0:
        raise ConfigError(
            "fault_tolerance.diloco_nesterov = true with diloco_outer_momentum = 0: Nesterov "
            "needs momentum (torch's SGD refuses it); set diloco_nesterov = false, or a "
            "momentum in (0, 1)"
        )
    if ft.diloco_quantize:
        raise ConfigError(
            "fault_tolerance.diloco_quantize = true is not available: torchft 0.2.0 quantizes "
            "with Triton kernels on CUDA tensors, while meshrun's cross-group process group is "
            "Gloo on CPU tensors (without Triton torchft would send float32 anyway); set "
            "diloco_quantize = false"
        )
    if n > 1 and h == 0:
        raise ConfigError(
            f"fault_tolerance.diloco_fragments = {n} needs DiLoCo: set "
            "fault_tolerance.diloco_sync_every > 0 (e.g. a multiple of the fragments), or "
            "diloco_fragments = 1"
        )
    if h and (h < n or h % n):
        raise ConfigError(
            f"fault_tolerance.diloco_fragments = {n} does not divide diloco_sync_every = {h}: "
            "streaming DiLoCo syncs one fragment every sync_every / fragments steps, so "
            f"sync_every must be a multiple of fragments; use e.g. diloco_sync_every = "
            f"{max(n, h - h % n)} or a divisor of {h} as diloco_fragments"
        )


def check_streaming(ft: FaultToleranceConfig) -> None:
    """Streaming DiLoCo's delay and mixing (torchft's ``fragment_sync_delay`` and
    ``fragment_update_alpha``) against the window they live in."""
    h, n = ft.diloco_sync_every, ft.diloco_fragments
    delay, alpha = ft.diloco_fragment_sync_delay, ft.diloco_fragment_update_alpha
    if not 0 <= alpha <= 1:
        raise ConfigError(
            f"fault_tolerance.diloco_fragment_update_alpha = {alpha} is not allowed: it must be "
            "in [0, 1] (0 = take the synchronised weights, 1 = keep the group's own)"
        )
    if (delay or alpha) and h == 0:
        key = "diloco_fragment_sync_delay" if delay else "diloco_fragment_update_alpha"
        value = delay if delay else alpha
        raise ConfigError(
            f"fault_tolerance.{key} = {value} needs DiLoCo: set "
            "fault_tolerance.diloco_sync_every > 0, or leave it at 0"
        )
    if h and delay >= h // n:
        raise ConfigError(
            f"fault_tolerance.diloco_fragment_sync_delay = {delay} is not allowed with "
            f"diloco_sync_every = {h} and diloco_fragments = {n}: a fragment is synced every "
            f"{h // n} steps and its all-reduce must end before the next one starts; use a "
            f"delay below {h // n} (e.g. {max(h // n - 1, 0)}), or a larger diloco_sync_every"
        )


def check_diloco_checkpoints(ft: FaultToleranceConfig, interval: int, local: int) -> None:
    """With a fragment sync delay the fragment's all-reduce is in flight for the last
    ``delay`` steps of each window, and a checkpoint cannot hold it: the periodic saves
    (``checkpoint.interval``, ``local_interval``) must fall on window boundaries."""
    delay = ft.diloco_fragment_sync_delay
    window = ft.diloco_sync_every // ft.diloco_fragments if ft.diloco_sync_every else 0
    if not delay:
        return
    for key, every in (("interval", interval), ("local_interval", local)):
        if every % window:
            raise ConfigError(
                f"checkpoint.{key} = {every} with fault_tolerance.diloco_fragment_sync_delay "
                f"= {delay}: a save must fall on a fragment's outer step (every {window} "
                f"steps: diloco_sync_every / diloco_fragments), since the fragment's "
                f"all-reduce is in flight for the {delay} steps before it; use a multiple "
                f"of {window}, or diloco_fragment_sync_delay = 0"
            )


def check_diloco_groups(ft: FaultToleranceConfig) -> None:
    """DiLoCo averages across replica groups: with one group there is nothing to average."""
    if ft.diloco and ft.replica_groups < 2:
        raise ConfigError(
            f"fault_tolerance.diloco_sync_every = {ft.diloco_sync_every} needs replica groups, "
            f"but fault_tolerance.replica_groups = {ft.replica_groups}: DiLoCo's outer step "
            "averages what each group learned alone, and one group has no one to average "
            "with (its outer step would only rescale its own update); start 2 or more groups "
            "(meshrun launch --replica-groups N), or set diloco_sync_every = 0"
        )
