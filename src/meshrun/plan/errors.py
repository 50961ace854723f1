"""The planner's one error type (a ConfigError, so ``meshrun plan`` exits 2 with the message)."""

from meshrun.config import ConfigError


class PlanError(ConfigError):
    """An impossible model, cluster or layout; the message names the flag, the value, what is
    allowed and how to fix it."""
