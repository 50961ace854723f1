"""Replica-group fault tolerance on torchft (the `ft` extra): docs/fault_tolerance.md."""

from typing import TYPE_CHECKING

from meshrun._lazy import lazy_exports

if TYPE_CHECKING:
    from meshrun.ft.cli import add_parser
    from meshrun.ft.data import data_share

__getattr__ = lazy_exports(
    globals(), {"add_parser": "meshrun.ft.cli", "data_share": "meshrun.ft.data"}
)
__all__ = ["add_parser", "data_share"]
