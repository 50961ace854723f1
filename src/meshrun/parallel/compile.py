"""``torch.compile`` per block: each block is compiled in place (``nn.Module.compile``), so its
state_dict keys, its FSDP2 unit and its checkpoint wrapper stay what they were.

Per block rather than the whole model, as torchtitan does: the blocks are identical, so one
compiled graph serves them all (dynamo reuses it), compile time does not grow with depth, and
FSDP2's hooks around each block stay outside the compiled region.
"""

from __future__ import annotations

import shutil

from torch import nn

from meshrun.config import ConfigError
from meshrun.parallel.fsdp import WrapPredicate, is_block


def apply_compile(model: nn.Module, wrap: WrapPredicate = is_block) -> int:
    """Compile each block chosen by ``wrap`` in place; return how many were compiled."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        raise ConfigError(
            "parallel.compile = true, but no C++ compiler (c++/g++) is on PATH: torch.compile's "
            "CPU backend (inductor) needs one; install a compiler or set parallel.compile=false"
        )
    blocks = [m for n, m in model.named_modules() if n and wrap(n, m)]
    if not blocks:
        raise ConfigError(
            f"parallel.compile = true, but {type(model).__name__} has no blocks to compile (no "
            "blocks/layers/h ModuleList); pass run.parallelize(model, wrap=...) naming them, or "
            "set parallel.compile=false"
        )
    for block in blocks:
        block.compile()
    return len(blocks)
