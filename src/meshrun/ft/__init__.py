"""Replica-group fault tolerance on torchft (the `ft` extra): docs/checkpoint.md."""

from typing import TYPE_CHECKING

from meshrun._lazy import lazy_exports

if TYPE_CHECKING:
    from meshrun.ft.cli import add_parser

__getattr__ = lazy_exports(globals(), {"add_parser": "meshrun.ft.cli"})
__all__ = ["add_parser"]
