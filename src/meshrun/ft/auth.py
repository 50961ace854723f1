"""Who may take part in a quorum meshrun acts on (docs/fault_tolerance.md, "Strangers").

torchft's lighthouse admits any replica that asks: it has no authentication, and its quorum
tells each group which store to join and which peer to heal from. So each group names itself
with a replica id that carries the addresses it serves (its manager server and its store)
and an HMAC of them made with the job secret (``MESHRUN_JOB_SECRET``, which the launcher
exports to its workers; its name, length, HMAC and sanitizer are runtime/secret.py's). After
every quorum each rank checks the quorum's participants: every id must carry a valid tag, and
the two addresses this rank will connect to (the store the cross-group process group forms in,
the manager of the peer it heals from) must be the ones that peer signed, and no group may
take part twice (a replayed id, whatever step it claims). A quorum that fails is refused
before torchft acts on it (ft/replica.py).

The addresses are in the id because torchft hands a participant's id, not its address, to
the quorum's members: a stranger replaying a real group's id with its own addresses (the
lighthouse's status page shows the ids) is caught when meshrun would connect to it.
"""

from __future__ import annotations

import base64
import hmac
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from meshrun.config import ConfigError
from meshrun.runtime.secret import MIN_CHARS, SECRET_ENV, mac, sanitize

__all__ = ["Member", "job_key", "parse_id", "quorum_problem", "replica_id"]

PREFIX = "meshrun_group_"
_PURPOSE = "meshrun-ft-replica"
_TAG_HEX = 32
_SHOWN = 80  # characters of a stranger's text in a refusal
_ID = re.compile(r"^meshrun_group_(\d{4})\.([a-z2-7]+)\.([0-9a-f]{32})\.(\d+)$")


@dataclass(frozen=True)
class Member:
    """What a group's replica id says about it."""

    group: int
    manager: str  # the manager server's address, as torchft advertises it (http://host:port)
    store: str  # the group's store (host:port)


def job_key(environ: Mapping[str, str] | None = None) -> bytes:
    """The job secret the launcher exported; a ConfigError naming the variable without it."""
    value = (os.environ if environ is None else environ).get(SECRET_ENV, "").strip()
    if len(value) < MIN_CHARS:
        raise ConfigError(
            f"replica groups: {SECRET_ENV} is {'unset' if not value else 'too short'}; every "
            "group's workers need the job's secret to tell its groups from strangers. Start "
            "the groups with `meshrun launch` (it exports it), and give every group of a job "
            f"the same {SECRET_ENV} (docs/security.md)"
        )
    return value.encode()


def replica_id(key: bytes, member: Member) -> str:
    """``meshrun_group_<gggg>.<addresses>.<tag>.<g>``: the zero-padded index first, so
    torchft's sort by id puts group g at participant g; the index again last, where torchft
    reads its trailing digits (its global ranks); no ``:``, which torchft splits on."""
    payload = _encode(f"{member.group}|{member.manager}|{member.store}")
    return f"{PREFIX}{member.group:04d}.{payload}.{_tag(key, payload)}.{member.group}"


def parse_id(key: bytes, text: str) -> Member | None:
    """The member a quorum id names (torchft appends ``:<uuid>``), or None when its tag is
    not this job's (compared in constant time, before the addresses are decoded)."""
    match = _ID.match(text.split(":", 1)[0])
    if match is None:
        return None
    padded, payload, tag, trailing = match.groups()
    if not hmac.compare_digest(tag, _tag(key, payload)):
        return None
    try:
        group, manager, store = _decode(payload).split("|")
    except ValueError:
        return None
    if not group.isdigit() or int(group) != int(padded) or int(trailing) != int(group):
        return None
    return Member(int(group), manager, store)


def quorum_problem(key: bytes, result: Any) -> str:
    """Why this rank must not act on a torchft quorum result (``QuorumResult``), in one
    printable line; empty when every participant is the job's and the store and heal source
    are addresses one of them signed."""
    members: list[Member] = []
    for text in result.replica_ids:
        member = parse_id(key, text)
        if member is None:
            return f"participant {sanitize(text, _SHOWN)!r} carries no valid tag of this job"
        if member.group in {m.group for m in members}:
            # A real id recorded and replayed (its step forged, say): each group asks once per
            # quorum, so a second request under its name is not its own.
            return f"group {member.group} takes part twice (a replay of its id)"
        members.append(member)
    if result.store_address not in {m.store for m in members}:
        return f"its store {sanitize(result.store_address, _SHOWN)!r} is no participant's"
    if result.heal:
        src = result.recover_src_replica_rank
        if src is None or not 0 <= src < len(members):
            return f"its heal source {src!r} is not a participant"
        if result.recover_src_manager_address != members[src].manager:
            address = sanitize(result.recover_src_manager_address, _SHOWN)
            return (
                f"its heal source address {address!r} is not the one group "
                f"{members[src].group} signed"
            )
    return ""


def _tag(key: bytes, payload: str) -> str:
    return mac(key, _PURPOSE, payload.encode())[:_TAG_HEX]


def _encode(text: str) -> str:
    return base64.b32encode(text.encode()).decode().rstrip("=").lower()


def _decode(payload: str) -> str:
    padded = payload.upper() + "=" * (-len(payload) % 8)
    return base64.b32decode(padded).decode()
