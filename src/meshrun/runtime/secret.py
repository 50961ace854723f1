"""The job secret itself: its environment variable, its minimum length, the HMAC it signs with
and the one sanitizer for the text a stranger may have written.

One random key per job that every node's launcher holds and exports to its workers as
``MESHRUN_JOB_SECRET``: what meshrun reads back from a store or a peer anyone can reach (the
rendezvous state, the handshake's records, a torchft quorum, a heal's checkpoint) is trusted
only when it carries an HMAC made with it. ``launch/trust/secret.py`` resolves where the key comes
from (the environment, a file, the run directory); ``ft/auth.py`` checks a quorum's
participants with it; both read the names here. Standard library only: nothing here imports
torch.
"""

from __future__ import annotations

import hmac
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = [
    "MIN_CHARS",
    "NONCE_ENV",
    "SECRET_ENV",
    "JobSecret",
    "SecretError",
    "checked",
    "from_env",
    "mac",
    "sanitize",
]

SECRET_ENV = "MESHRUN_JOB_SECRET"
# The launch's nonce, which every signed rendezvous state carries (launch/trust/rendezvous.py): one
# per launch, so a state signed in an earlier run with the same (reused) secret is refused.
NONCE_ENV = "MESHRUN_RDZV_NONCE"
MIN_CHARS = 16  # a secret shorter than this is guessable; 64 hex chars are generated
_MAC_HEX = 64  # sha256
# Everything but printable ASCII: C0 and C1 controls and DEL (a terminal escape from a stranger
# can move the cursor, rewrite lines already printed, retitle the window or set the clipboard),
# new lines (a line of its own that looks like meshrun's), and any other code point (a
# right-to-left override reorders what follows it on the screen).
_UNPRINTABLE = re.compile(r"[^\x20-\x7e]")


class SecretError(RuntimeError):
    """No usable job secret; the message names the variable or the file and the fix."""


def mac(key: bytes, purpose: str, payload: bytes) -> str:
    """HMAC-SHA256 of ``payload`` bound to ``purpose`` (the store key it is written under, the
    request it answers), so a value signed for one use does not verify for another."""
    # hmac.digest: OpenSSL's one-shot HMAC, the same bytes as hmac.new(...).digest() without
    # the Python object (an agent verifies every rendezvous log entry: N per round).
    return hmac.digest(key, purpose.encode() + b"\0" + payload, "sha256").hex()


@dataclass(frozen=True)
class JobSecret:
    """The job's key, and where it came from (for the start-up line, never the key)."""

    key: bytes = field(repr=False)
    source: str

    def mac(self, purpose: str, payload: bytes) -> str:
        """:func:`mac` with this job's key."""
        return mac(self.key, purpose, payload)

    def seal(self, purpose: str, text: str) -> bytes:
        """``text`` with its MAC in front: what is written to the store."""
        payload = text.encode()
        return self.mac(purpose, payload).encode() + b" " + payload

    def unseal(self, purpose: str, raw: bytes) -> str | None:
        """The text of a sealed value, or None when its MAC is not this job's (constant-time
        comparison; the text is not looked at before the MAC matches)."""
        tag, sep, payload = bytes(raw).partition(b" ")
        if not sep or len(tag) != _MAC_HEX:
            return None
        if not hmac.compare_digest(tag, self.mac(purpose, payload).encode()):
            return None
        try:
            return payload.decode()
        except UnicodeDecodeError:
            return None

    def tag(self, run_id: str) -> str:
        """A name derived from the key: store prefixes a stranger does not collide with."""
        return self.mac("tag", run_id.encode())[:16]


def sanitize(text: str, limit: int = 300) -> str:
    """Text from the network made safe to print as one line: every character but printable
    ASCII (terminal escapes, new lines, other code points) replaced by '?', cut at ``limit``
    characters."""
    clean = _UNPRINTABLE.sub("?", text)
    return clean if len(clean) <= limit else clean[:limit] + "..."


def checked(value: str, source: str) -> JobSecret:
    """``value`` (stripped) as the job's secret, refused when shorter than :data:`MIN_CHARS`;
    ``source`` names where it came from in the error."""
    value = value.strip()
    if len(value) < MIN_CHARS:
        raise SecretError(
            f"the job secret from {source} has {len(value)} characters; at least {MIN_CHARS} "
            "are needed (generate one: python -c 'import secrets; print(secrets.token_hex(32))')"
        )
    return JobSecret(value.encode(), source)


def from_env(environ: Mapping[str, str] | None = None) -> JobSecret:
    """The secret a launcher exported (``MESHRUN_JOB_SECRET``); a SecretError without it."""
    value = (os.environ if environ is None else environ).get(SECRET_ENV, "")
    if not value:
        raise SecretError(f"{SECRET_ENV} is not set: start the job with meshrun launch")
    return checked(value, f"env {SECRET_ENV}")
