"""The signed rendezvous backend itself (see ``rendezvous.py`` for what it is for and how
torchrun's agent gets it): torch's rendezvous state as JSON with an HMAC of the job secret
under one key, each node's heartbeat in a key of its own (``heartbeats.py``), each node's
own join, wait and leave in a log (``joinlog.py``)."""

from __future__ import annotations

import json
import pickle
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from torch.distributed import Store
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousBackend,
    Token,
    _RendezvousState,
)

from meshrun.launch.trust.heartbeats import Heartbeats, only_heartbeats
from meshrun.launch.trust.joinlog import JoinLog, copy_state, fold, own_move
from meshrun.launch.trust.sealed import PROBE, peek
from meshrun.launch.trust.state_json import Nodes, state_from_json, state_to_json
from meshrun.runtime.logs import say_launch
from meshrun.runtime.secret import JobSecret, sanitize

BACKEND_NAME = "meshrun"
_EMPTY = b"meshrun-rdzv-empty"  # the store's get blocks on a missing key: a sentinel instead
_FORMAT = 3  # 2: the launch nonce is part of the signed state; 3: the log's first slot
_PAST = datetime(1970, 1, 1, tzinfo=timezone.utc)  # a deadline already passed: complete now
# How often an agent looks for a plain c10d agent's key: once per keep-alive, not per read
# (a read per poll doubled the store operations of a 64-node rendezvous).
_STRANGER_CHECK_S = 5.0


@dataclass(frozen=True)
class Rounds:
    """torch's round settings, for the deadline the backend derives: a round whose joins
    came as log entries may pass ``min_nodes`` without any node's own join making it exactly
    ``min_nodes``, where torch sets the last call's deadline."""

    min_nodes: int = 1
    max_nodes: int = 2**31
    last_call: timedelta = timedelta(seconds=30)


# The shared state as decoded: the state, its sealed value, the first log slot not folded in.
Decoded = tuple[_RendezvousState, bytes, int]


class SignedBackend(RendezvousBackend):
    """The rendezvous state as HMAC-signed JSON under ``meshrun.rdzv/<run id>``.

    ``seq`` counts the writes: each is the state it replaced plus one, so an older signed
    state written back (a replay) is refused like a forgery; ``launch`` is the launch's nonce,
    so a state signed in another launch with the same secret is refused too. Each node's
    keep-alive goes to a signed key of its own (``heartbeats.py``), merged into the state
    handed to the handler; ``keep_alive`` and ``tries`` are the handler's settings.

    A poll reads the log (one ``check`` when nothing is new) and the state itself only when
    the log holds a new mark, an entry every write of the state appends once it won, or
    ``full_read_every`` (the keep-alive interval) passed: every waiting node polls about once a
    second, and reading the whole state each time moved O(N) bytes per poll, O(N^2) a second
    through the store. A mark is signed like every entry (until 2026-12-07 it was a plain key,
    ``<key>/v``, read at every poll: two operations a poll). A state deleted or replaced under
    the job is still found by the next full read or the next write."""

    def __init__(
        self,
        store: Store,
        run_id: str,
        secret: JobSecret,
        nonce: str,
        keep_alive: timedelta = timedelta(seconds=5),
        tries: int = 3,
        say: Callable[[str], None] | None = None,
        full_read_every: timedelta | None = None,
        rounds: Rounds | None = None,
    ) -> None:
        if not run_id:
            raise ValueError("the rendezvous run id must not be empty")
        if not nonce:
            raise ValueError("the launch nonce must not be empty")
        self._store, self._run_id, self._secret, self._nonce = store, run_id, secret, nonce
        self._key = f"meshrun.rdzv/{run_id}"
        self._say = say or say_launch
        self._seq = 0  # the highest write this node has seen
        self._good: bytes | None = None  # the last value that verified
        self._good_state: Decoded | None = None  # its state: a poll re-reads it often
        self._nodes: Nodes = {}  # one object per node, for every value decoded (state_json.py)
        self._hb = Heartbeats(
            self._call, self._key, secret, nonce, keep_alive, tries, self._say, self._nodes
        )
        self._log = JoinLog(self._call, self._key, secret, nonce, self._say, self._nodes)
        self._rounds = rounds or Rounds()
        self._min_since: dict[int, datetime] = {}  # round -> when this node saw min_nodes
        # The last fold: (sealed state, log version) -> the state with entries and deadline.
        self._folded: tuple[bytes, int, _RendezvousState] | None = None
        # What the handler was last handed: (token, state with heartbeats merged, its pickle).
        self._view: tuple[bytes, _RendezvousState, bytes] | None = None
        self._stranger_checked = -_STRANGER_CHECK_S
        self._refused: set[bytes] = set()
        self._stranger_seen = False
        self._deleted_seen = 0  # deletions this node has put back (one line each)
        every = keep_alive if full_read_every is None else full_read_every
        self._full_read_s = every.total_seconds()
        # The last full read: (the log's marks read before it, when, what it decoded to).
        self._polled: tuple[int, float, Decoded | None] | None = None
        self._call("compare_set", self._key, "", _EMPTY)
        # torch's handler stops its keep-alive timer without waiting for a keep-alive already
        # running, so a restart's first reads and writes can meet one: the log's read position
        # and the view handed over are this node's, one call at a time.
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return BACKEND_NAME

    def get_state(self) -> tuple[bytes, Token] | None:
        with self._lock:
            return self._get_state()

    def set_state(
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        with self._lock:
            return self._set_state(state, token)

    def _get_state(self) -> tuple[bytes, Token] | None:
        self._note_plain_c10d()
        # The log first: a write that wins after it is read marks the log for the next poll.
        self._log.read()
        marks, polled = self._log.marks, self._polled
        if polled and polled[0] == marks and time.monotonic() - polled[1] < self._full_read_s:
            return self._hand(polled[2])  # heartbeats still merged anew
        decoded = self._decode(self._read())
        self._polled = (marks, time.monotonic(), decoded)
        return self._hand(decoded)

    def _wrote(self) -> None:
        """A write of the state won (ours, or a state put back): a mark in the log for the
        pollers (signed, like every entry)."""
        self._polled = None
        self._log.append_mark()

    def _hand(
        self, decoded: Decoded | None, pickled: bytes | None = None
    ) -> tuple[bytes, Token] | None:
        """What the handler gets: the shared state with the log's newer entries applied, the
        round's deadline derived and each node's newest heartbeat merged, pickled once per
        change (a poll of an unchanged state costs no pickle). The token names the sealed
        state and the log slots folded in."""
        if decoded is None:
            return None
        shared, raw, log_from = decoded
        base = self._fold(shared, raw, log_from)
        merged = self._hb.merge(base)
        token = _make_token(raw, self._log.next)
        view = self._view
        if view is None or view[0] != token or view[1] is not merged:
            bits = pickled if pickled is not None and merged is shared else pickle.dumps(merged)
            self._view = view = (token, merged, bits)
        return view[2], token

    def _fold(self, shared: _RendezvousState, raw: bytes, log_from: int) -> _RendezvousState:
        held = self._folded
        if held is not None and held[0] == raw and held[1] == self._log.version:
            return held[2]
        self._log.skip_to(log_from)
        entries = [e for e in self._log.newest.values() if e.slot >= log_from]
        state = self._with_deadline(fold(shared, entries), shared)
        self._folded = (raw, self._log.version, state)
        return state

    def _with_deadline(self, state: _RendezvousState, shared: _RendezvousState) -> _RendezvousState:
        """The round's deadline as this node derives it: none below ``min_nodes``; the last
        call after it first saw ``min_nodes`` participants; passed at ``max_nodes``. torch sets
        it in the write that makes the count exactly ``min_nodes``; joins applied from the log
        can pass that count in one read, and a round without a deadline never completes."""
        if state.complete:
            return state
        count, rounds = len(state.participants), self._rounds
        want: datetime | None = None
        if count >= rounds.max_nodes:
            want = _PAST
        elif count >= rounds.min_nodes:
            now = datetime.now(timezone.utc)
            want = self._min_since.setdefault(state.round, now) + rounds.last_call
        else:
            self._min_since.pop(state.round, None)
        if state.deadline == want:
            return state
        if state is shared:
            state = copy_state(shared)
        state.deadline = want
        return state

    def _read(self) -> bytes:
        """The stored value, never blocking: the store's ``get`` waits for a missing key until
        its timeout (minutes, every agent stuck). A deleted state is put back at once, from
        the last good state this node holds (the highest wins: an older one put back by
        another node is refused by those who hold newer), and said in one line.

        One store operation when the state is there, as a ``get`` would be: a compare-and-set
        expecting a value never written (:data:`PROBE`) changes nothing and answers the stored
        value, or, on a missing key, the expected value itself. Only then a second one puts
        the state back (a check before every read tripled a 64-node rendezvous's operations)."""
        raw = peek(self._call, self._key)
        if raw != PROBE:
            return raw
        return self._put_back()

    def _put_back(self) -> bytes:
        """The key answered as missing: put the last good state back (or the empty one, or
        whatever another node put back first) and say so."""
        restore = self._good if self._good is not None else _EMPTY
        raw = bytes(self._call("compare_set", self._key, "", restore))
        if raw == PROBE:  # not missing: someone stored the probe itself, refused as unsigned
            return raw
        self._deleted_seen += 1
        self._wrote()
        held = "the last good signed state this node holds" if self._good else "an empty one"
        self._say(
            f"the rendezvous state {self._key} was deleted from the store; put back "
            f"{held}, the job goes on (whoever can reach the store's port can delete keys: "
            "keep it on a trusted network, docs/security.md)"
        )
        return raw

    def _set_state(
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        if token is not None and not isinstance(token, bytes):
            current = self._get_state()  # not a token of ours: cannot match
            return (*current, False) if current is not None else None
        # The handler's own pickle, made in this process a moment ago.
        local: _RendezvousState = pickle.loads(state)
        shared_raw, log_from = _split_token(token)
        view = self._view
        if view is not None and token == view[0] and self._own_write(view[1], local):
            handed = self._hand(self._decode(shared_raw))
            if handed is not None:
                return handed[0], handed[1], True
        return self._write_shared(local, state, shared_raw, log_from)

    def _own_write(self, view: _RendezvousState, local: _RendezvousState) -> bool:
        """Whether ``local`` differs from the view it was made from only by this node's own
        keep-alive or by one node's own move; if so, written where it goes (never to the
        shared state)."""
        if only_heartbeats(view, local):
            # A keep-alive: the node's own key, one plain set; the shared state is untouched.
            # The handler then calls nodes dead on what it gets back: the shared state merged
            # anew (its own heartbeat, and the keys due), not its copy of an older view.
            self._hb.write(local)
            return True
        moved = own_move(view, local)
        if moved is None:
            return False
        # A join, a move to the wait list, a leave: one entry in the log, never lost, and what
        # the handler gets back has it applied (and any entry read on the way to a free slot).
        node, place = moved
        t = local.last_heartbeats.get(node) or datetime.now(timezone.utc)
        # The node's heartbeat key first: a reader that finds the entry then finds the key
        # where it looks for a newer time (an entry is never lost, so neither is what the key
        # says; a lost write of the shared state is another matter).
        self._hb.write(local, joining=True)
        self._log.append(node, local.round, place, t)
        return True

    def _write_shared(
        self, local: _RendezvousState, pickled: bytes, shared_raw: bytes, log_from: int | None
    ) -> tuple[bytes, Token, bool] | None:
        """A compare-and-set of the shared state (a completed round, a new round, a node
        removed as dead): ``local`` replaces ``shared_raw`` if that is still what the store
        holds; else what it holds is handed back."""
        self._polled = None  # what this write hands back is newer than the last poll's
        seq = self._seq + 1
        # Every entry below the view's first unread slot is folded into this state.
        log_from = self._log.next if log_from is None else log_from
        sealed = self._seal(local, seq, log_from)
        expected = shared_raw or _EMPTY
        raw = bytes(self._call("compare_set", self._key, expected, sealed))
        if raw == sealed:  # ours won: no need to verify and parse what we just wrote
            # The heartbeat keys only once the state is written: a lost write must leave no
            # trace. torch's handler drops a node whose own heartbeat aged past the limit
            # from its view without writing; a key written by its lost join made it a live
            # participant again of the round it had left (docs/scale.md, 128 nodes).
            self._hb.write(local, joining=True)
            self._wrote()
            self._seq, self._good = seq, sealed
            self._good_state = decoded = (local, sealed, log_from)
            handed = self._hand(decoded, pickled)
            assert handed is not None
            return handed[0], handed[1], True
        # Not written: the store answered with the value it holds (another node's write, the
        # common case under contention: decoded as it is, no second operation), or, on a
        # deleted key, with the expected value itself: the handler would retry that token
        # forever (every restart gone, no line). Then the state is put back and read.
        if raw == expected:
            raw = self._put_back()
        handed = self._hand(self._decode(raw))
        if handed is None:
            return None
        return handed[0], handed[1], False

    # --- JSON <-> state ---------------------------------------------------------------

    def _seal(self, state: _RendezvousState, seq: int, log_from: int) -> bytes:
        doc = {
            "format": _FORMAT,
            "run_id": self._run_id,
            "launch": self._nonce,
            "seq": seq,
            "log": log_from,
            **state_to_json(state),
        }
        return self._secret.seal(self._key, json.dumps(doc, sort_keys=True))

    def _decode(self, raw: bytes) -> Decoded | None:
        raw = bytes(raw)
        if raw == _EMPTY:
            return None
        if raw == self._good and self._good_state is not None:  # verified already
            return self._good_state
        text = self._secret.unseal(self._key, raw)
        doc = _parse(text) if text is not None else None
        if why := self._unfit(doc):
            return self._refuse(raw, why)
        assert doc is not None
        try:
            state = state_from_json(doc, self._nodes)
        except (KeyError, TypeError, ValueError) as err:  # signed, so a bug: say so plainly
            raise RendezvousStateError(f"the signed rendezvous state is malformed: {err}") from err
        self._seq, self._good = max(self._seq, doc["seq"]), raw
        self._good_state = decoded = (state, raw, doc["log"])
        return decoded

    def _unfit(self, doc: dict[str, Any] | None) -> str:
        """Why a verified-or-not document is refused ('' when it is this launch's, current)."""
        if doc is None or doc["run_id"] != self._run_id:
            return "not signed with this job's secret"
        if doc["launch"] != self._nonce:
            return (
                f"signed in another launch (nonce {sanitize(doc['launch'], 32)}, this launch's "
                f"is {self._nonce}: a state recorded in an earlier run of this run directory)"
            )
        if doc["seq"] < self._seq:
            return "an older state written back"
        return ""

    def _refuse(self, raw: bytes, why: str) -> Decoded | None:
        """Name the refused value once, put the last good state back over it, go on."""
        if raw not in self._refused:
            self._refused.add(raw)
            self._say(
                f"refused rendezvous state {why} (in the store {self._key}: "
                f"{sanitize(_claimed_by(raw), 120)}); the job goes on with its own"
            )
        restore = self._good if self._good is not None else _EMPTY
        now = bytes(self._call("compare_set", self._key, raw, restore))
        if now == restore:
            self._wrote()
        if now == raw or now in self._refused:
            return None  # could not put it back (raced by another write): as if empty
        return self._decode(now)

    def _note_plain_c10d(self) -> None:
        """A plain torchrun agent pointed at this store writes ``torch.rendezvous.<id>``;
        it is never read here, but the user should know someone tried."""
        now = time.monotonic()
        if self._stranger_seen or now - self._stranger_checked < _STRANGER_CHECK_S:
            return
        self._stranger_checked = now
        if self._call("check", [f"torch.rendezvous.{self._run_id}"]):
            self._stranger_seen = True
            self._say(
                f"refused a rendezvous join without this job's secret: an agent using torch's "
                f"c10d rendezvous wrote torch.rendezvous.{self._run_id} in this job's store; "
                "it is not part of the job"
            )

    def _call(self, op: str, *args: Any) -> Any:
        try:
            return getattr(self._store, op)(*args)
        except (ValueError, RuntimeError, TimeoutError) as err:
            raise RendezvousConnectionError(
                f"the connection to the rendezvous store failed: {err}"
            ) from err


def _parse(text: str) -> dict[str, Any] | None:
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
        return None
    if not isinstance(doc.get("seq"), int) or not isinstance(doc.get("run_id"), str):
        return None
    if not isinstance(doc.get("launch"), str) or not isinstance(doc.get("log"), int):
        return None
    return doc


def _claimed_by(raw: bytes) -> str:
    """Who an unverified value says it comes from, for the refusal line only (never
    trusted): the addresses of its participants if it is meshrun's JSON, else its size."""
    _, _, payload = raw.partition(b" ")
    try:
        doc = json.loads(payload)
        addrs = sorted({str(p[0]) for p in doc.get("participants", []) + doc.get("wait_list", [])})
        return f"claims to be from {', '.join(addrs) or 'no node'}"
    except (ValueError, TypeError, AttributeError, IndexError):
        return f"{len(raw)} bytes, not meshrun's format"


def _make_token(raw: bytes, log_next: int) -> bytes:
    """The token handed with a state: the sealed shared state, and the first log slot not
    folded into the view (what a write of that view folds in)."""
    return raw + b"\0" + str(log_next).encode()


def _split_token(token: Token | None) -> tuple[bytes, int | None]:
    """:func:`_make_token`'s parts; ``(b"", None)`` for no token (the first write)."""
    shared_raw, _, folded = (token or b"").rpartition(b"\0")
    return shared_raw, int(folded) if folded.isdigit() else None
