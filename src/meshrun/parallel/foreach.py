"""The optimizer's ``foreach`` default for DTensor parameters on CPU.

torch's optimizers default to ``foreach`` (one kernel call over the whole parameter list) only
for CUDA-like devices; on CPU they loop in Python, one op per parameter. With plain tensors that
costs little, but a DTensor parameter (ZeRO-2/3, TP) sends every op through DTensor's Python
dispatch: measured on the demo GPT under ZeRO-2 on 2 CPU ranks, AdamW's step spent ~15 ms of
its ~24 ms in dispatch. ``foreach=True`` dispatches once per op over the list. The two
implementations compute the same formulas (bitwise equal results for AdamW here), so meshrun
turns it on in that case and says so; an explicit ``foreach=`` or ``fused=`` is kept.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from typing import Any

import torch

from meshrun.parallel.kinds import is_dtensor

log = logging.getLogger("meshrun")


def with_foreach_default(
    optimizer_class: type[torch.optim.Optimizer],
    params: Sequence[torch.Tensor],
    kwargs: dict[str, Any],
) -> dict[str, Any]:
    """``kwargs`` plus ``foreach=True`` when the parameters are DTensors on CPU, the optimizer
    takes ``foreach`` and the caller chose neither ``foreach`` nor ``fused``."""
    if "foreach" in kwargs or kwargs.get("fused"):
        return kwargs
    if not params or not all(is_dtensor(p) and p.device.type == "cpu" for p in params):
        return kwargs
    if "foreach" not in inspect.signature(optimizer_class.__init__).parameters:
        return kwargs
    log.info(
        "%s: foreach=True (DTensor parameters on CPU: one dispatch per op over the parameter "
        "list, the same results; pass foreach=False to loop per parameter)",
        optimizer_class.__name__,
    )
    return {**kwargs, "foreach": True}
