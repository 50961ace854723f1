"""The ``[monitor]`` section: run health (numerics guard, stragglers, the replica check, hang
watchdog, the steps recorded for ``meshrun compare``). Its own module: the section grew past
what config/sections.py holds within the file-size limit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from meshrun.config.fields import ConfigError, check_section, setting


@dataclass
class MonitorConfig:
    """Run health: numerics guard, stragglers, hang watchdog (see docs/monitor.md)."""

    SECTION: ClassVar[str] = "monitor"  # the [section] of the TOML file

    def __post_init__(self) -> None:
        check_section(self)
        if self.straggler_chronic > self.straggler_windows:
            raise ConfigError(
                f"monitor.straggler_chronic = {self.straggler_chronic} exceeds "
                f"monitor.straggler_windows = {self.straggler_windows}: no rank could be "
                "chronic; use at most straggler_windows, or raise straggler_windows"
            )

    nonfinite: Literal["skip", "stop"] = setting(
        "skip", "NaN/Inf loss on any rank: every rank skips the step (zero grads), or all stop."
    )
    nonfinite_limit: int = setting(
        3,
        "Under nonfinite = skip: stop (non-zero exit) after this many NaN/Inf steps in a row, "
        "naming the first NaN/Inf parameter or gradient; 0 = skip without limit.",
        min=0,
    )
    straggler_every: int = setting(
        20, "Compare ranks' step components every N optimizer steps; 0 = off.", min=0
    )
    straggler_factor: float = setting(
        1.5, "Flag a rank whose component is this many times the others' median.", min=1.0
    )
    straggler_min_s: float = setting(
        0.005, "...and exceeds that median by at least this many seconds per step.", min=0
    )
    straggler_windows: int = setting(
        5,
        "Straggler checks remembered per rank: the moving averages and the chronic count "
        "span this many.",
        min=1,
    )
    straggler_chronic: int = setting(
        3,
        "A rank flagged in at least this many of the last straggler_windows checks is a "
        "chronic straggler; fewer: transient.",
        min=1,
    )
    straggler_top_k: int = setting(
        3, "Slowest ranks (moving average) listed per check and at the end; 0 = none.", min=0
    )
    replica_check_every: int = setting(
        0,
        "Every N optimizer steps compare a digest of the data-parallel replicas' parameters "
        "and stop naming the rank, host and parameter that differ (docs/monitor.md); 0 = off.",
        min=0,
    )
    step_timeout_s: float = setting(
        300.0, "Hang watchdog: a step taking longer dumps all stacks and exits; 0 = off.", min=0
    )
    phase_timeout_s: float = setting(
        1800.0, "Watchdog limit inside run.phase(...), checkpoint saves and the first step.", min=0
    )
    comm_timing: bool = setting(
        True, "Time DDP's gradient all-reduce (comm hook) to split exposed from hidden comm."
    )
    comm_sample_every: int = setting(
        200,
        "FSDP2/TP/PP (no DDP hook): profile every N-th step for its exposed comm; 0 = off.",
        min=0,
    )
    record_steps: int = setting(
        0,
        "Write the first N optimizer steps' full parameters and gradients to RUN_DIR/record/ "
        "(safetensors, for `meshrun compare`); 0 = off.",
        min=0,
    )
