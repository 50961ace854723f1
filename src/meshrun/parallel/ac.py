"""Activation checkpointing per block: keep only each chosen block's input in the forward and
recompute its activations in the backward (memory for about one extra forward of compute).

The block's own ``forward`` is replaced, on the instance, by one that runs the original under
``torch.utils.checkpoint.checkpoint`` (non-reentrant: it works with DTensors, FSDP2 and
``torch.compile``). Nothing is inserted into the module tree, so every module and parameter
keeps the user's name: ``named_modules()``/``named_parameters()`` after ``run.parallelize`` are
those of the model the user built (a ``configure_optimizers`` that groups parameters by module
name works; torch's ``checkpoint_wrapper`` put ``_checkpoint_wrapped_module.`` into every name
inside a block). The module's hooks (FSDP2's all-gather, tensor parallel's input and output
layouts) stay outside the recomputed region, as they were outside the wrapper's.

:func:`apply_selective` turns it into op-level selective checkpointing (what the memory trace
models for ``ac = "selective"``).
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from meshrun.parallel.fsdp import WrapPredicate, is_block

log = logging.getLogger("meshrun")


class CheckpointedForward:
    """A block's ``forward`` under activation checkpointing: the original run through
    ``checkpoint``. A class holding the block and its class's function (not a closure, not a
    bound method), so ``copy.deepcopy`` and pickling of the model bind the copy's forward to
    the copied block."""

    def __init__(self, module: nn.Module) -> None:
        forward = module.forward
        bound = getattr(forward, "__self__", None) is module
        self.module = module
        # A forward another library set on the instance already is kept as it is.
        self.function: Any = forward.__func__ if bound else forward  # type: ignore[attr-defined]
        self.bound = bound

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        head = (self.module,) if self.bound else ()
        return checkpoint(self.function, *head, *args, use_reentrant=False, **kwargs)


def is_checkpointed(module: nn.Module) -> bool:
    """Whether :func:`apply_ac` checkpoints ``module``'s forward."""
    return isinstance(module.__dict__.get("forward"), CheckpointedForward)


def apply_ac(model: nn.Module, every: int, wrap: WrapPredicate = is_block) -> int:
    """Checkpoint every ``every``-th block (1 = all) in place; return how many.

    Names, state_dict keys and the module tree are unchanged (module docstring), so
    checkpoints, exports and the user's own name-based code do not depend on this setting.
    """
    if every < 1:
        return 0
    maybe_disable_kv_cache(model)
    blocks = [m for n, m in model.named_modules() if n and wrap(n, m)]
    chosen = blocks[every - 1 :: every] if every > 1 else blocks
    for block in chosen:
        if not is_checkpointed(block):
            block.forward = CheckpointedForward(block)
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


# --- selective activation checkpointing ----------------------------------------------------

# Ops whose outputs selective checkpointing keeps: the matmuls (every second one is
# recomputed) and the attention kernels, whose recomputation costs the most per byte kept.
SAVED_OPS = (
    "aten.mm.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten.max.default",
)


def apply_selective(model: nn.Module) -> None:
    """Turn each checkpointed block's full recomputation into op-level selective
    checkpointing (torch's ``create_selective_checkpoint_contexts``): keep the outputs of
    :data:`SAVED_OPS` except every second matmul, recompute the rest."""
    for module in model.modules():
        if is_checkpointed(module):
            module.forward = _SelectiveForward(module.__dict__["forward"])


class _SelectiveForward:
    def __init__(self, full: Any) -> None:
        self.full = full

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

        full = self.full
        head = (full.module,) if full.bound else ()
        context = partial(create_selective_checkpoint_contexts, _policy())
        return checkpoint(
            full.function, *head, *args, use_reentrant=False, context_fn=context, **kwargs
        )


def _policy() -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    counts = {True: 0, False: 0}  # matmuls seen in the forward and in the recomputation

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        name = str(op)
        if name == "aten.mm.default":
            counts[ctx.is_recompute] += 1
            if counts[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        if name in SAVED_OPS:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy
