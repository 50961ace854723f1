"""The demo: a byte-level GPT (:class:`GPT`, shaped by :class:`GPTConfig` or
:func:`demo_config`), its corpus from the Python standard library's own source
(:func:`build_demo_datasets`) and its training script :func:`main` (``meshrun demo``,
``python -m meshrun.demo``): one complete loop over meshrun's public API, readable top to
bottom. Exports load on first use (they import torch).
"""

from typing import TYPE_CHECKING

from meshrun._lazy import lazy_exports

if TYPE_CHECKING:
    from meshrun.demo.corpus import build_demo_datasets
    from meshrun.demo.model import GPT, GPTConfig, demo_config
    from meshrun.demo.train import main

__getattr__ = lazy_exports(
    globals(),
    {
        "build_demo_datasets": "meshrun.demo.corpus",
        "GPT": "meshrun.demo.model",
        "GPTConfig": "meshrun.demo.model",
        "demo_config": "meshrun.demo.model",
        "main": "meshrun.demo.train",
    },
)

__all__ = ["GPT", "GPTConfig", "build_demo_datasets", "demo_config", "main"]
