"""``rdzv_scale.py``'s meshrun agent on an older checkout of meshrun: a "before" row.

docs/scale.md compares the current benchmark run against the current code and against an
older one (that checkout's ``src`` first on PYTHONPATH). Each piece here is the current
code's where the checkout has it, else what that checkout's ``create_signed_handler`` did.
At 6d5996c the signed backend was ``meshrun.launch.rdzv_signed.SignedBackend(store, run_id,
secret, say=...)``: no launch nonce, no keep-alive or round settings (it held torch's
heartbeats in the signed state); the secret's helpers were in ``meshrun.launch.secret``; the
handler was not wrapped to hold the workers' port. Its store prefix was already
``meshrun.<secret.tag(run_id)>``, as now.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters

try:
    from meshrun.launch.trust.rendezvous import SignedBackend
    from meshrun.runtime.secret import SECRET_ENV, from_env
except ImportError:  # a checkout before launch/trust (6d5996c and earlier)
    from meshrun.launch.rdzv_signed import SignedBackend  # type: ignore[no-redef]
    from meshrun.launch.secret import SECRET_ENV, from_env  # type: ignore[no-redef]

__all__ = ["SECRET_ENV", "from_env", "held", "signed_backend"]


def signed_backend(
    store: Any,
    run_id: str,
    secret: Any,
    nonce: str,
    say: Callable[[str], None],
    params: RendezvousParameters,
) -> Any:
    """The checkout's signed backend as its ``create_signed_handler`` makes it: the launch's
    ``nonce``, the round settings and the handler's keep-alive where it takes them. A checkout
    whose backend has no keep-alive setting ran with 5 s x 3 only: another is refused."""
    taken = inspect.signature(SignedBackend).parameters
    every = params.get_as_int("keep_alive_interval", 5) or 5
    tries = params.get_as_int("keep_alive_max_attempt", 3) or 3
    if "keep_alive" not in taken and (every, tries) != (5, 3):
        raise ValueError(
            f"keep-alive {every} s x {tries}: this checkout's signed backend has 5 s x 3 only"
        )
    if "nonce" not in taken:
        return SignedBackend(store, run_id, secret, say=say)  # type: ignore[call-arg]
    kept: dict[str, Any] = {}
    if "keep_alive" in taken:
        kept = {"keep_alive": timedelta(seconds=every), "tries": tries}
    return SignedBackend(store, run_id, secret, nonce, say=say, **kept, **_round_settings(params))


def _round_settings(params: RendezvousParameters) -> dict[str, Any]:
    """The round settings for the signed backend; none on a checkout whose backend did not
    take them."""
    try:
        from meshrun.launch.trust.rendezvous import rounds_from
    except ImportError:
        return {}
    return {"rounds": rounds_from(params)}


def held(handler: RendezvousHandler) -> RendezvousHandler:
    """As ``create_signed_handler`` wraps it; an older checkout has no wrapper."""
    try:
        from meshrun.launch.agent.store_port import HeldPortHandler
    except ImportError:
        return handler
    return HeldPortHandler(handler)
