"""Hugging Face directories in and out: sharded pretrained loading (docs/porting.md)."""

from typing import TYPE_CHECKING

from meshrun._lazy import lazy_exports

if TYPE_CHECKING:
    from meshrun.hf.load import load_pretrained

__getattr__ = lazy_exports(globals(), {"load_pretrained": "meshrun.hf.load"})
__all__ = ["load_pretrained"]
