"""The run directory's lock as ``meshrun launch`` takes it (meshrun/runtime/runlock.py has the lock).

One node takes it before it writes the resolved config; a multi-node job's rendezvous host
takes it once it knows it is the host, and the other nodes only refuse a directory that another
job holds (the same job's host may already hold it: the nodes share one token, computed from
the rendezvous they share)."""

from __future__ import annotations

import os
from contextlib import AbstractContextManager
from pathlib import Path

from meshrun.launch.spec import Rendezvous
from meshrun.runtime.runlock import TOKEN_ENV, hold_run_dir, job_token

__all__ = ["claim_run_dir"]


def claim_run_dir(
    run_dir: str | Path, rdzv: Rendezvous, host: bool | None = None
) -> AbstractContextManager[None]:
    """The lock of a launch inside the block (raises :class:`meshrun.runtime.runlock.RunDirBusy`).
    ``host``: whether this node hosts a multi-node job's rendezvous (None: not known yet, only
    check); one node always takes it."""
    multi = rdzv.multinode
    token = os.environ.get(TOKEN_ENV) or job_token(multi, rdzv.rdzv_id, rdzv.endpoint_text)
    return hold_run_dir(run_dir, token, take=not multi or bool(host))
