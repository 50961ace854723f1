"""Every argparse line of meshrun: ``main.py`` registers the subcommands, one module per group
of commands (``launch``, ``torchrun``, ``ray``, ``diagnose``, ``data``, ``plan``, ``ckpt``,
``report``, ``ft``) builds its flags and calls the library with typed values; ``args`` holds
the shapes they share, ``out`` the one-line error format, ``doc`` docs/cli.md from the help.
The console entry point is ``meshrun.cli.main:main``."""

from typing import TYPE_CHECKING

from meshrun._lazy import lazy_exports

if TYPE_CHECKING:
    from meshrun.cli.main import build_parser

__getattr__ = lazy_exports(globals(), {"build_parser": "meshrun.cli.main"})

__all__ = ["build_parser"]
