"""Deprecated name of :mod:`meshrun.checkpoint.on_disk` (a checkpoint as it lies on disk).

"Layout" means a parallel layout everywhere else in meshrun, so the module was renamed; this
alias keeps ``from meshrun.checkpoint.layout import ...`` working (``launch/prepare.py`` still
imports ``resume_path_error`` from here) and goes once nothing imports it.
"""

from meshrun.checkpoint.on_disk import *  # noqa: F403
from meshrun.checkpoint.on_disk import __all__ as __all__
