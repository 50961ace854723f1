"""Replica-group fault tolerance on torchft (the `ft` extra): docs/fault_tolerance.md.
Its commands (``meshrun ft ...``) are in ``meshrun.cli.ft``."""

from typing import TYPE_CHECKING

from meshrun._lazy import lazy_exports

if TYPE_CHECKING:
    from meshrun.ft.data import data_share

__getattr__ = lazy_exports(globals(), {"data_share": "meshrun.ft.data"})
__all__ = ["data_share"]
