"""Sealed rendezvous values that carry a time and the launch's nonce (a heartbeat, a log
entry, the heartbeat digest), and the one store read that never blocks."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

from meshrun.runtime.secret import JobSecret, sanitize

SKEW = timedelta(seconds=30)  # a value dated later than this ahead of our clock is refused
PROBE = b"meshrun-rdzv-probe"  # expected by a read (peek), never written: never a value's
# Keys per multi_get: the store's CPU per key grows with the keys of one multi_get (0.5 us a
# key at 64, 0.6 at 256, 0.9 at 1,024, 1.9 at 4,096: benchmarks/store_cost.py).
KEYS_PER_READ = 256


def peek(call: Callable[..., Any], key: str) -> bytes:
    """``key``'s value in one store operation that never blocks: a compare-and-set expecting a
    value never written changes nothing and answers the value, or :data:`PROBE` itself when
    the key is missing (a ``get`` would wait until the store's timeout)."""
    return bytes(call("compare_set", key, PROBE, PROBE))


def read_many(call: Callable[..., Any], keys: list[str]) -> list[bytes]:
    """The values of ``keys`` (every one present: a missing key blocks the read), in
    ``multi_get``s of at most :data:`KEYS_PER_READ` keys."""
    values: list[bytes] = []
    for i in range(0, len(keys), KEYS_PER_READ):
        values += [bytes(v) for v in call("multi_get", keys[i : i + KEYS_PER_READ])]
    return values


def unseal_timed(
    secret: JobSecret, key: str, raw: bytes, nonce: str
) -> tuple[dict[str, Any] | None, str]:
    """A sealed value carrying a time and the launch's nonce (a heartbeat, a log entry): its
    document and '' when it is this job's, this launch's and not dated ahead of our clock by
    more than :data:`SKEW`; else None and why, for the line that says it was ignored."""
    text = secret.unseal(key, raw)
    doc = _parse(text) if text is not None else None
    if doc is None:
        return None, "not signed with this job's secret"
    if doc["launch"] != nonce:
        return None, f"signed in another launch (nonce {sanitize(str(doc['launch']), 32)})"
    if doc["time"] > datetime.now(timezone.utc) + SKEW:
        return None, f"dated in the future ({doc['time'].isoformat()})"
    return doc, ""


def _parse(text: str) -> dict[str, Any] | None:
    try:
        doc = json.loads(text)
        if not isinstance(doc, dict) or not isinstance(doc.get("launch"), str):
            return None
        doc["time"] = datetime.fromisoformat(doc["time"])
        if doc["time"].tzinfo is None:
            return None
    except (ValueError, TypeError, KeyError):
        return None
    return doc
