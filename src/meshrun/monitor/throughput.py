"""How many tokens one sample holds, for tokens/s: known, or None (samples/s only).

Tokens are counted only where they are tokens: given (``run.steps(..., tokens_per_sample=N)``
or ``metrics.tokens_per_sample``), or the sequence length of an integer-id input (a token
dataset's ``(batch, seq)`` ids; in a dict batch its ``input_ids``, else its first tensor).
A float input (images, audio, features) has no tokens: the size of its dim 1 is channels or
features, and a tokens/s made of it would be a wrong figure, so there is none.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["count_tokens_per_sample", "resolve_tokens_per_sample"]

log = logging.getLogger("meshrun")


def _first_tensor(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, Mapping):
        ids = batch.get("input_ids")
        values: Any = [ids] if isinstance(ids, torch.Tensor) else list(batch.values())
    elif isinstance(batch, Sequence) and not isinstance(batch, (str, bytes)):
        values = batch
    else:
        return None
    for value in values:
        found = _first_tensor(value)
        if found is not None:
            return found
    return None


def count_tokens_per_sample(batch: Any) -> int | None:
    """The sequence length of the batch's integer-id input ``(batch, seq)``, else None."""
    t = _first_tensor(batch)
    if t is None or t.dim() < 2 or t.dtype == torch.bool:
        return None
    if t.is_floating_point() or t.is_complex():
        return None
    return int(t.shape[1])


def resolve_tokens_per_sample(batch: Any, given: int | None) -> int | None:
    """``given`` (> 0) when set, else counted on the first batch; says once which it is."""
    if given is not None and given > 0:
        log.info("throughput: %d tokens per sample (given): tokens/s and samples/s", given)
        return given
    counted = count_tokens_per_sample(batch)
    if counted is None:
        log.info(
            "throughput: samples/s only (the input is not integer token ids); set "
            "metrics.tokens_per_sample if samples hold a known number of tokens"
        )
    else:
        log.info("throughput: %d tokens per sample (the ids' sequence length)", counted)
    return counted
