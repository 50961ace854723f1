"""How a loader's worker processes start: from a fork server, not as forks of the training process.

Why not fork: a training process is multi-threaded (Gloo's and NCCL's threads, the queue feeder
threads of earlier loaders, the hang watchdog), and a forked child inherits every lock that
another thread held at that instant, held for ever. CPython 3.8-3.11 has one of its own: a child
forked while another thread holds the runtime's thread-state lock (a native thread taking a
Python thread state, as torch's C++ threads do when they call into Python) blocks inside
``os.fork()`` before running a line of Python (CPython gh-112275; not in 3.12). Seen in
meshrun's tests: an eval loader's worker stuck in ``PyOS_AfterFork_Child`` ->
``_PyThreadState_DeleteExcept``, its rank waiting for its first batch until the watchdog fired.

``"forkserver"`` (the default, ``data.worker_start``) forks the workers from a small server
process started once per training process, before it has any other thread; ``"spawn"`` starts
each from scratch. Both pickle what a worker needs (the dataset, ``collate_fn``), so that is
checked when the loader is built, before the first step; and both import the main script
again in a process of their own, so a script whose training runs outside
``if __name__ == "__main__":`` keeps forked workers, with a warning.
"""

from __future__ import annotations

import ast
import functools
import sys
import warnings
from multiprocessing.context import BaseContext
from multiprocessing.reduction import ForkingPickler
from types import FrameType, ModuleType
from typing import Any, Literal

import numpy as np
import torch

__all__ = ["START_METHODS", "StartMethod", "warn_once", "worker_context"]

StartMethod = Literal["forkserver", "spawn", "fork"]
START_METHODS: tuple[StartMethod, ...] = ("forkserver", "spawn", "fork")
_warned: set[str] = set()


def worker_context(
    start_method: StartMethod, num_workers: int, **pickled: Any
) -> BaseContext | None:
    """The ``multiprocessing_context`` for a DataLoader with ``num_workers`` workers (None
    without workers). ``pickled``: what each worker receives (dataset, collate_fn, ...), named
    as the error should name them; with a start method other than fork, one that cannot be
    pickled is refused here, naming ``data.num_workers`` and the ways out."""
    if num_workers == 0:
        return None
    if start_method not in START_METHODS:
        raise ValueError(
            f"worker start method must be one of {START_METHODS}, got {start_method!r}"
        )
    if start_method != "fork":
        where = unguarded_main_line()
        if where is not None:
            warn_once(
                f"data.num_workers = {num_workers}: loader workers are forked from this "
                f"multi-threaded training process, because {where} runs outside "
                f'`if __name__ == "__main__":` and data.worker_start = {start_method} would '
                "run it again in another process; a forked worker can deadlock as it starts "
                "(docs/data.md); move the script's lines into a function called under that "
                "guard (docs/porting.md), or set --data.worker_start=fork to keep forking "
                "without this warning"
            )
            start_method = "fork"
        else:
            for name, obj in pickled.items():
                _refuse_unpicklable(name, obj, num_workers, start_method)
    context = torch.multiprocessing.get_context(start_method)
    if start_method == "forkserver":
        context.set_forkserver_preload(_preload())
    return context


def _preload() -> list[str]:
    """Modules the fork server imports once, so that each worker it forks has them already:
    torch, this loader's worker code and what the main script imported. Without them every
    worker imported torch itself (1.2-1.3 s per loader of 2 workers on a 2-core machine,
    measured): Python 3.11's fork server does not preload the main script as it means to
    (its ``main_path`` key is never filled), so each worker imports the script and its
    imports again."""
    main = sys.modules.get("__main__")
    names = {"torch", "meshrun.data.loader"}
    for value in vars(main).values() if main is not None else ():
        name = getattr(value, "__name__", None)
        if (
            isinstance(value, ModuleType)
            and name
            and name in sys.modules
            and name not in ("__main__", "builtins")
        ):
            names.add(name)
    return sorted(names)


def _refuse_unpicklable(name: str, obj: Any, num_workers: int, start_method: str) -> None:
    try:
        _Probe(_Sink()).dump(obj)
    except Exception as e:  # pickle raises PicklingError, TypeError, AttributeError, ...
        raise ValueError(
            f"data.num_workers = {num_workers} with data.worker_start = {start_method}: each "
            f"loader worker receives the {name} pickled, and {type(obj).__name__} cannot be "
            f"({type(e).__name__}: {e}). Define its class and functions at module level and "
            "keep no open files, locks or lambdas in it (open them in __getitem__ or a "
            "worker_init_fn), or set --data.num_workers=0, or --data.worker_start=fork "
            "(forked workers can deadlock as they start: docs/data.md)"
        ) from e


class _Sink:
    """A file that keeps nothing: the probe only needs to know whether pickling succeeds."""

    def write(self, data: bytes) -> int:
        return len(data)


class _Probe(ForkingPickler):
    """The workers' pickler, without array contents: tensors and arrays are shared, not written,
    and copying a large in-memory dataset's bytes only to discard them would cost its size."""

    def persistent_id(self, obj: Any) -> int | None:
        if isinstance(obj, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage, np.ndarray)):
            return id(obj)
        return None


def unguarded_main_line() -> str | None:
    """``file:line`` where the main script's own top-level code is running now, outside an
    ``if __name__ == "__main__":`` block; None when it runs inside one (or there is no script:
    an interactive session, a notebook)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or path is None:
        return None
    frame: FrameType | None = sys._getframe()
    while frame is not None and not (
        frame.f_code.co_name == "<module>" and frame.f_globals is vars(main)
    ):
        frame = frame.f_back
    if frame is None:  # the script is not running (a thread, an atexit hook): nothing to rerun
        return None
    line = frame.f_lineno
    if any(first <= line <= last for first, last in _guarded_lines(path)):
        return None
    return f"{path}:{line}"


@functools.cache
def _guarded_lines(path: str) -> tuple[tuple[int, int], ...]:
    """Line ranges of the top-level ``if __name__ == "__main__":`` blocks of ``path``."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return ()
    return tuple(
        (node.lineno, node.end_lineno or node.lineno)
        for node in tree.body
        if isinstance(node, ast.If) and _is_main_test(node.test)
    )


def _is_main_test(test: ast.expr) -> bool:
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return False
    if not isinstance(test.ops[0], ast.Eq):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s.id for s in sides if isinstance(s, ast.Name)]
    consts = [s.value for s in sides if isinstance(s, ast.Constant)]
    return names == ["__name__"] and consts == ["__main__"]


def warn_once(text: str, stacklevel: int = 4) -> None:
    """Warn with ``text`` once per process, not once per loader (``stacklevel`` counts this
    function: the default points at build_dataloader's caller from a helper it calls)."""
    if text not in _warned:
        _warned.add(text)
        warnings.warn(text, stacklevel=stacklevel)
