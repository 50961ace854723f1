"""Activation checkpointing per block: keep only each chosen block's input in the forward and
recompute its activations in the backward (memory for about one extra forward of compute)."""

from __future__ import annotations

import logging

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from meshrun.parallel.fsdp import WrapPredicate, is_block

log = logging.getLogger("meshrun")


def apply_ac(model: nn.Module, every: int, wrap: WrapPredicate = is_block) -> int:
    """Wrap every ``every``-th block (1 = all) in place; return how many were wrapped.

    The wrapper keeps state_dict keys unchanged (it strips its own prefix), so checkpoints do
    not depend on this setting. Non-reentrant checkpointing: it works with DTensors and FSDP2.
    """
    if every < 1:
        return 0
    maybe_disable_kv_cache(model)
    blocks = [n for n, m in model.named_modules() if n and wrap(n, m)]
    chosen = blocks[every - 1 :: every] if every > 1 else blocks
    for name in chosen:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        parent.register_module(child, checkpoint_wrapper(parent.get_submodule(child)))
    return len(chosen)


def maybe_disable_kv_cache(model: nn.Module) -> None:
    """A transformers model keeps a key/value cache by default (``config.use_cache``); a
    recomputed block would append its keys a second time (the attention then sees twice the
    sequence: measured on Llama), so with checkpointing the cache is off, as transformers'
    own ``gradient_checkpointing_enable`` does, and said."""
    config = getattr(model, "config", None)
    if type(model).__module__.startswith("transformers.") and getattr(config, "use_cache", False):
        config.use_cache = False  # type: ignore[union-attr]
        log.warning(
            "activation checkpointing: %s.config.use_cache set to False (a recomputed layer "
            "would extend the key/value cache twice)",
            type(model).__name__,
        )
