"""Mixture-of-experts figures for the metrics: the tokens each expert received and how uneven
that is, read from the expert-parallel layers (parallel/ep.py). The router's load-balancing
loss and its capacity policy are the model's own; these figures say how well they work."""

from __future__ import annotations

import json
from collections.abc import Iterable

from torch import nn

from meshrun.parallel.ep import layout_of
from meshrun.parallel.ep_dispatch import imbalance, tokens_per_expert


def moe_metrics(models: Iterable[nn.Module]) -> dict[str, float | str]:
    """Since the last call, summed over the data-parallel ranks (one all_reduce per model, so
    every rank calls it at the same steps): ``moe_tokens_per_expert``, a JSON object of layer
    -> (token, slot) pairs per expert, and ``moe_imbalance``, the largest max/mean over the
    layers (1.0 = balanced). Empty without expert-parallel layers."""
    counts: dict[str, list[int]] = {}
    for model in models:
        layout = layout_of(model)
        if layout is not None:
            counts |= tokens_per_expert(model, layout.dp_group)
    if not counts:
        return {}
    return {
        "moe_imbalance": max(imbalance(c) for c in counts.values()),
        "moe_tokens_per_expert": json.dumps(counts, separators=(",", ":")),
    }
