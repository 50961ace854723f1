"""``@meshrun.main``: the entry point of a training script.

It applies torch's elastic ``record`` (a failing rank's traceback reaches the launcher's
summary), closes the run (barrier on success, ``destroy_process_group``), flushes output and
leaves with ``os._exit``. Why ``os._exit``: a Gloo worker can abort at interpreter exit
(SIGABRT, "terminate called without an active exception") in 8-40% of FSDP2/ZeRO runs even
after ``destroy_process_group()``, measured here; skipping interpreter teardown made 0 of 12
abort. The exit code is the function's return value (an int), 1 on an exception, 130 on Ctrl-C.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import record

from meshrun.runtime.logs import report_uncaught, say_rank_error
from meshrun.runtime.runlock import RunDirError
from meshrun.train.run import close_active_run


def _exit_code(exc: BaseException) -> int:
    if isinstance(exc, SystemExit):
        if exc.code is None:
            return 0
        return exc.code if isinstance(exc.code, int) else 1
    return 130 if isinstance(exc, KeyboardInterrupt) else 1


def _one_line_refusals(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A busy or unusable run directory (runtime/runlock.py) is met alike by every rank of a
    job started without ``meshrun launch`` (plain torchrun, srun): one line each, exit 2, no
    traceback, and nothing for torch's ``record`` to copy into the launcher's summary (it
    records exceptions, not ``SystemExit``)."""

    @functools.wraps(fn)
    def refusing(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except RunDirError as exc:
            say_rank_error(exc)
            if exc.every_rank:
                _wait_for_every_rank_to_say_it()
            raise SystemExit(2) from None

    return refusing


def _wait_for_every_rank_to_say_it() -> None:
    """Every rank met the same verdict at the same point: none leaves before all have printed,
    since the first exit makes torchrun stop the others, whose line would then be lost."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        with contextlib.suppress(Exception):  # a peer already gone: nothing left to wait for
            dist.barrier()


def main(fn: Callable[..., Any]) -> Callable[..., None]:
    """Decorate a script's ``main()``; see the module docstring."""
    recorded = record(_one_line_refusals(fn))

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        code = 0
        try:
            result = recorded(*args, **kwargs)
            code = result if isinstance(result, int) else 0
        except BaseException as exc:
            code = _exit_code(exc)
            if code not in (0, 130) and not isinstance(exc, SystemExit):
                report_uncaught(type(exc), exc, exc.__traceback__, traceback.print_exception)
        try:
            close_active_run(failed=code != 0)
        except Exception:
            traceback.print_exc()
            code = code or 1
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    return wrapper
