"""Learning-rate scaling rules and schedules (pure functions, plus a torch LambdaLR builder).

Scaling: when the global batch changes from the batch the LR was tuned at (``ref_batch``),
``linear`` multiplies the LR by the ratio (Goyal et al. 2017), ``sqrt`` by its square root
(Krizhevsky 2014; the usual choice for Adam).
"""

from __future__ import annotations

import math

import torch

from meshrun.config import OptimConfig


def scale_lr(base_lr: float, global_batch: int, ref_batch: int, rule: str) -> float:
    """The LR for ``global_batch`` given ``base_lr`` tuned at ``ref_batch``."""
    if rule == "none" or ref_batch <= 0:
        return base_lr
    ratio = global_batch / ref_batch
    if rule == "linear":
        return base_lr * ratio
    if rule == "sqrt":
        return base_lr * math.sqrt(ratio)
    raise ValueError(f"optim.lr_scaling = {rule!r} is not allowed: expected none, linear or sqrt")


def lr_factor(step: int, cfg: OptimConfig) -> float:
    """Multiplier of the peak LR at optimizer step ``step`` (0-based: the step about to run).

    Linear warmup from 1/(warmup+1) to 1 over ``warmup_steps``, then cosine, linear or constant
    decay down to ``min_lr_ratio`` at ``steps``.
    """
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    if cfg.decay == "constant":
        return 1.0
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    shape = 1.0 - progress if cfg.decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    """A plain torch LambdaLR applying :func:`lr_factor` to the optimizer's own LR."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg))
