"""The checked handshake of a multi-node launch, over the rendezvous store, before any worker.

Multi-node jobs that hang at init usually hang because the nodes disagree: two nodes claim the
same rank, one runs another torch, one was given another config, or one never started. The
torchrun agent would wait in its rendezvous until a timeout and say none of that. So before the
agent starts, every node's ``meshrun launch`` publishes one record (hostname, node rank,
processes, versions, config digest) in the rendezvous store; the host (the node that owns the
store) reads each record once as it arrives and decides: all agree and every node continues,
or every node stops with the same message naming the hosts. The other nodes only look for
the host's decision and its progress line, a few small reads per poll: the handshake costs
O(N) store operations in all, not each node reading every record every poll (O(N^2), which
at 256 simulated nodes took minutes; docs/scale.md).

The store is the one the agent's rendezvous uses: on the endpoint's node meshrun creates it
before the agent, listening on the endpoint's address only, and the agent's ``meshrun``
rendezvous (``launch/trust/rendezvous.py``) uses that very store in-process. Keys live under
``meshrun/<rdzv_id>/<attempt>/<tag>/``, where the attempt is a token the host draws when it
starts, so records of an earlier launch on a long-lived store never count, and the tag is
derived from the job secret (:func:`job_prefix`): whoever can reach the store's port can read
the attempt, but cannot name the keys of the job's records, so cannot set the record counter
to something that is not a number (the store's ``add`` then fails and the launch with it).
The host writes its attempt twice: under a tagged key its nodes look for, and under the plain
``meshrun/<rdzv_id>/attempt`` only for a node with another secret, which leaves its record in
a plain corner (``.../<attempt>/strangers/<n>``, at most :data:`MAX_STRANGERS`) so that the host
names it. A node never stops on what the plain key holds: a stranger could have put it there,
so the node says so at once and waits for its own host until the join timeout.

Every value written (the attempt token, the records, the error, the done mark) is sealed with
an HMAC of the job secret (runtime/secret.py) bound to its key: a value that does not verify is
refused and named in one line (a stranger, or a node given another secret) and never decides
anything; text read from the store is printed without control characters.

The decisions (what is wrong, who is missing, what to print) are pure functions on records
(``records.py``).
"""

from __future__ import annotations

import json
import socket
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from meshrun.launch.multinode.records import (
    Joined,
    JoinTarget,
    NodeInfo,
    find_problems,
    is_complete,
    waiting_message,
)
from meshrun.runtime.secret import JobSecret, sanitize

POLL_S = 0.5
REPORT_EVERY_S = 5.0
CONNECT_TRY_S = 3.0
# How long the host keeps the store up after an error, so every node reads the error.
LINGER_S = 2.0
MAX_RECORDS = 4096  # read at most this many records, whatever the count says
MAX_STRANGERS = 16  # records left by nodes with another secret that the host names


class HandshakeError(RuntimeError):
    """The nodes disagree, or not all joined in time; the message names the hosts."""


# --- over the store ------------------------------------------------------------------------


def open_store(
    host: str, port: int, *, is_host: bool, timeout_s: float, say: Callable[[str], None]
) -> Any:
    """The rendezvous TCPStore: created here on the host, listening on ``host``'s address
    only (the agent's ``meshrun`` rendezvous uses this very store), else a client that
    retries for ``timeout_s`` and then explains what to check."""
    if is_host:
        from meshrun.launch.trust.rendezvous import listen_store

        try:
            return listen_store(host, port, timeout_s)
        except (RuntimeError, OSError) as err:
            raise HandshakeError(
                f"could not host the rendezvous store on port {port} of this node ({_short(err)}); "
                "is another job using the port? Choose another port in --rdzv-endpoint "
                "(the same on every node)"
            ) from None
    return _connect(host, port, timeout_s, say)


def _connect(host: str, port: int, timeout_s: float, say: Callable[[str], None]) -> Any:
    from torch.distributed import TCPStore

    deadline = time.monotonic() + timeout_s
    last_err: BaseException | None = None
    last_said = 0.0
    while time.monotonic() < deadline:
        try_s = max(0.5, min(CONNECT_TRY_S, deadline - time.monotonic()))
        try:
            # A plain socket first: a failed TCPStore connect prints a C++ stack per try.
            socket.create_connection((host, port), timeout=try_s).close()
            return TCPStore(
                host,
                port,
                is_master=False,
                timeout=timedelta(seconds=timeout_s),
                wait_for_workers=False,
            )
        except (RuntimeError, OSError) as err:  # refused, unreachable, timed out: retry
            last_err = err
            if time.monotonic() - last_said >= REPORT_EVERY_S:  # a line every few s, no flood
                say(f"waiting for the rendezvous host {host}:{port} to accept connections...")
                last_said = time.monotonic()
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    raise HandshakeError(
        f"the rendezvous endpoint {host}:{port} could not be reached within {timeout_s:.0f} s "
        f"({_short(last_err)}). Check that --rdzv-endpoint is the address of one of the nodes on "
        "the network they share, that meshrun launch runs on that node with the same endpoint, "
        "and that no firewall blocks the port"
    )


def _short(err: BaseException | None) -> str:
    text = " ".join(str(err).split()) if err is not None else "no attempt"
    return text[:200]


@dataclass
class Handshake:
    """One node's side of the handshake; ``run()`` returns the records or raises."""

    store: Any
    rdzv_id: str
    info: NodeInfo
    target: JoinTarget
    is_host: bool
    timeout_s: float
    say: Callable[[str], None]
    secret: JobSecret
    refused: dict[str, str] = field(default_factory=dict)  # key -> who it claims to be
    attempt: str = ""  # the host's token, once read: this launch's rendezvous nonce too

    def run(self) -> list[Joined]:
        try:
            return self._run()
        except HandshakeError:
            if self.is_host:
                time.sleep(LINGER_S)  # let the others read the error before the store goes
            raise
        except (RuntimeError, OSError) as err:  # the store went away under us
            raise HandshakeError(
                f"lost the rendezvous store during the handshake ({_short(err)}); the node "
                "hosting the endpoint has stopped: see its output"
            ) from None

    def _run(self) -> list[Joined]:
        deadline = time.monotonic() + self.timeout_s
        self.attempt = self._attempt(deadline)  # this launch's: its rendezvous nonce too
        prefix = job_prefix(self.secret, self.rdzv_id, self.attempt)
        late = self._read(f"{prefix}/done") is not None
        slot = self.store.add(f"{prefix}/count", 1)
        self._write(f"{prefix}/node/{slot}", self.info.to_json())
        if late:
            # The job already formed (this node replaces one, or joins an elastic job): only
            # versions and config must agree; the agent's rendezvous admits it.
            return _joined(self._check_late(prefix))
        if self.is_host:
            return _joined(self._assemble(prefix, deadline))
        return self._await_host(prefix, deadline)

    def _attempt(self, deadline: float) -> str:
        plain = _plain_attempt_key(self.rdzv_id)
        mine = attempt_key(self.secret, self.rdzv_id)
        if self.is_host:
            token = uuid.uuid4().hex[:8]
            self._write(mine, token)  # first: a node that finds the plain key finds this too
            self._write(plain, token)
            return token
        foreign = False
        while True:
            found = self._read(mine)
            if found is not None:
                return found
            if not foreign and self.store.check([plain]):
                raw = bytes(self.store.get(plain))
                foreign = self.secret.unseal(plain, raw) is None
                if foreign:
                    self._leave_record(raw)
                    self.say(f"{self._foreign_text()}; waiting for a handshake signed with it")
            if time.monotonic() > deadline:
                if foreign:
                    raise HandshakeError(self._foreign_text())
                raise HandshakeError(
                    f"the rendezvous store answers but holds no meshrun handshake for rdzv_id "
                    f"{self.rdzv_id!r}; is the endpoint's node running meshrun launch with the "
                    "same --rdzv-id?"
                )
            time.sleep(POLL_S)

    def _foreign_text(self) -> str:
        return (
            f"refused by the rendezvous store: its meshrun handshake for rdzv_id "
            f"{self.rdzv_id!r} is not signed with this node's job secret ({self.secret.source}). "
            "Every node of a job needs the same secret: the same MESHRUN_JOB_SECRET, the same "
            "MESHRUN_JOB_SECRET_FILE, or a run directory shared with the hosting node"
        )

    def _leave_record(self, raw: bytes) -> None:
        """On a foreign attempt token, leave this node's record in its plain corner (signed
        with this node's secret), so the hosting node names who it refused: a slot claimed
        with a compare-and-set of an empty key (never ``add``: a stranger's value there would
        fail it and close this node's connection)."""
        token = raw.partition(b" ")[2].decode(errors="replace")
        if len(token) == 8 and all(c in "0123456789abcdef" for c in token):
            for n in range(MAX_STRANGERS):
                key = _stranger_key(self.rdzv_id, token, n)
                sealed = self.secret.seal(key, self.info.to_json())
                if bytes(self.store.compare_set(key, "", sealed)) == sealed:
                    return

    def _write(self, key: str, text: str) -> None:
        self.store.set(key, self.secret.seal(key, text))

    def _read(self, key: str) -> str | None:
        """The text under ``key`` if it is there and signed with this job's secret; a value
        that is there but not signed is refused, named once, and counts as absent."""
        if not self.store.check([key]):
            return None
        return self._verified(key, bytes(self.store.get(key)))

    def _verified(self, key: str, raw: bytes) -> str | None:
        text = self.secret.unseal(key, raw)
        if text is None and key not in self.refused:
            self.refused[key] = _claimed_host(raw)
            what = (
                "a handshake record"
                if "/node/" in key or "/strangers/" in key
                else f"the handshake's {key.rsplit('/')[-1]}"
            )
            self.say(
                f"refused {what} {sanitize(self.refused[key], 160)}: not signed with this "
                "job's secret"
            )
        return text

    def _records(self, prefix: str) -> list[NodeInfo]:
        count = min(int(self.store.add(f"{prefix}/count", 0)), MAX_RECORDS)
        keys = [f"{prefix}/node/{i}" for i in range(1, count + 1)]
        # A node increments the count just before it writes its record: skip the gap.
        texts = [self._read(k) for k in keys]
        return [NodeInfo.from_json(t) for t in texts if t is not None]

    def _check_late(self, prefix: str) -> list[NodeInfo]:
        nodes = self._records(prefix)
        # Records of nodes that left stay in the store, so neither ranks nor counts are checked.
        problems = find_problems(nodes, JoinTarget(1, sys.maxsize))
        if problems:
            raise HandshakeError(self._fail_text(problems))
        return nodes

    def _assemble(self, prefix: str, deadline: float) -> list[NodeInfo]:
        """The host: read each new record once, decide, write the decision (``done`` with the
        nodes, or ``error``) and, while waiting, the progress line the others print."""
        records: dict[int, NodeInfo] = {}
        pending: list[int] = []  # slots counted but not read yet (written just after the count)
        counted, last_report, last_text, strangers = 0, 0.0, "", 0
        while True:
            error = self._read(f"{prefix}/error")  # a node that gave up first
            if error is not None:
                raise HandshakeError(sanitize(error, 4000))
            strangers = self._name_strangers(strangers)
            count = min(int(self.store.add(f"{prefix}/count", 0)), MAX_RECORDS)
            pending += range(counted + 1, count + 1)
            counted = max(counted, count)
            pending = self._read_new(prefix, pending, records)
            nodes = [records[k] for k in sorted(records)]
            problems = find_problems(nodes, self.target)
            if problems:
                text = self._fail_text(problems)
                self._write(f"{prefix}/error", text)
                raise HandshakeError(text)
            if is_complete(nodes, self.target):
                joined = [[n.hostname, n.node_rank] for n in nodes]
                self._write(f"{prefix}/done", json.dumps(joined))
                return nodes
            now = time.monotonic()
            text = waiting_message(nodes, self.target)
            if now > deadline:
                text = self._gave_up(text)
                self._write(f"{prefix}/error", text)
                raise HandshakeError(text)
            if text != last_text or now - last_report >= REPORT_EVERY_S:
                self.say(text)
                if text != last_text:
                    self._write(f"{prefix}/progress", text)
                last_report, last_text = now, text
            time.sleep(POLL_S)

    def _name_strangers(self, read: int) -> int:
        """The host: name each record a node with another secret left since the last poll
        (one ``check`` a poll when there is none); how many are read now."""
        while read < MAX_STRANGERS:
            key = _stranger_key(self.rdzv_id, self.attempt, read)
            if not self.store.check([key]):
                break
            self._verified(key, bytes(self.store.get(key)))  # names it unless it is ours
            read += 1
        return read

    def _read_new(self, prefix: str, slots: list[int], records: dict[int, NodeInfo]) -> list[int]:
        """Read the records of ``slots`` that are there (one ``check`` and one ``multi_get``
        when all are); verified ones go into ``records``; returns the slots still missing."""
        keys = {f"{prefix}/node/{k}": k for k in slots}
        if not keys:
            return []
        present = list(keys)
        if not self.store.check(present):  # a count ahead of its record: find which
            present = [k for k in keys if self.store.check([k])]
        values = self.store.multi_get(present) if present else []
        for key, raw in zip(present, values, strict=True):
            text = self._verified(key, bytes(raw))
            if text is not None:
                records[keys[key]] = NodeInfo.from_json(text)
        done = set(present)
        return [k for key, k in keys.items() if key not in done]

    def _await_host(self, prefix: str, deadline: float) -> list[Joined]:
        """A node other than the host: wait for the host's decision, printing its progress."""
        last_report, last_text = 0.0, ""
        while True:
            error = self._read(f"{prefix}/error")
            if error is not None:
                raise HandshakeError(sanitize(error, 4000))
            done = self._read(f"{prefix}/done")
            if done is not None:
                return _parse_joined(done)
            now = time.monotonic()
            if now > deadline:
                seen = self._read(f"{prefix}/progress") or "the host has seen no other node yet"
                text = self._gave_up(sanitize(seen, 2000))
                self._write(f"{prefix}/error", text)
                raise HandshakeError(text)
            if now - last_report >= REPORT_EVERY_S / 2:
                text = sanitize(self._read(f"{prefix}/progress") or "", 2000)
                if text and (text != last_text or now - last_report >= REPORT_EVERY_S):
                    self.say(text)
                    last_report, last_text = now, text
            time.sleep(POLL_S)

    def _gave_up(self, seen: str) -> str:
        return (
            f"gave up after {self.timeout_s:.0f} s (launch.join_timeout_s): {seen}. Start "
            "meshrun launch on the missing node(s) with the same --rdzv-endpoint, --rdzv-id "
            "and --nnodes" + self._refused_text()
        )

    def _fail_text(self, problems: list[str]) -> str:
        return "the nodes do not agree: " + " | ".join(problems)

    def _refused_text(self) -> str:
        if not self.refused:
            return ""
        who = "; ".join(sorted({sanitize(c, 160) for c in self.refused.values()}))
        return f" (refused as not signed with this job's secret: {who}; give it the same secret)"


def _joined(nodes: Sequence[NodeInfo]) -> list[Joined]:
    return [Joined(n.hostname, n.node_rank) for n in nodes]


def _parse_joined(text: str) -> list[Joined]:
    """The host's ``done``: [[hostname, node_rank], ...] (signed, so a bug if malformed)."""
    try:
        return [Joined(str(h), int(r)) for h, r in json.loads(text)]
    except (ValueError, TypeError) as err:
        raise HandshakeError(f"the host's handshake decision is malformed: {err}") from None


def _claimed_host(raw: bytes) -> str:
    """Who an unverified record says it is (never trusted: for the refusal line only)."""
    _, _, payload = raw.partition(b" ")
    try:
        doc = json.loads(payload)
        return f"from {doc['hostname']} (node_rank {doc['node_rank']})"
    except (ValueError, TypeError, KeyError):
        return f"({len(raw)} bytes)"


def _plain_attempt_key(rdzv_id: str) -> str:
    """Where the host writes its attempt for any reader (a node with another secret)."""
    return f"meshrun/{rdzv_id}/attempt"


def _stranger_key(rdzv_id: str, attempt: str, n: int) -> str:
    """The ``n``-th record left by a node with another secret, for the host to name."""
    return f"meshrun/{rdzv_id}/{attempt}/strangers/{n}"


def _tagged(secret: JobSecret, plain: str) -> str:
    """``plain`` with a name derived from the job secret: a stranger cannot name it."""
    return f"{plain}/{secret.tag(plain)}"


def attempt_key(secret: JobSecret, rdzv_id: str) -> str:
    """Where the host writes its attempt for the nodes of its job (derived from the secret)."""
    return _tagged(secret, _plain_attempt_key(rdzv_id))


def job_prefix(secret: JobSecret, rdzv_id: str, attempt: str) -> str:
    """The keys of one attempt's records, count, decision and progress: a name derived from
    the job secret, so that a stranger who reads the attempt cannot name them."""
    return _tagged(secret, f"meshrun/{rdzv_id}/{attempt}")


def publish_attempt(store: Any, rdzv_id: str, secret: JobSecret) -> None:
    """A one-node job's store: a signed attempt, marked done, so that a ``meshrun launch``
    pointed at it with another secret is refused by the handshake, naming why."""
    token = uuid.uuid4().hex[:8]
    for key in (attempt_key(secret, rdzv_id), _plain_attempt_key(rdzv_id)):
        store.set(key, secret.seal(key, token))
    done = f"{job_prefix(secret, rdzv_id, token)}/done"
    store.set(done, secret.seal(done, "1"))
