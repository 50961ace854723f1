"""How a healing group receives its peer's state: torchft's checkpoint transport, made safe.

torchft's default (``HTTPTransport``) serves every rank's whole training state over HTTP on
every interface, to anyone who asks, and the receiver loads it with ``torch.load(...,
weights_only=False)``: whoever answers a heal request runs code in the healing worker. This
transport, handed to torchft's ``Manager(checkpoint_transport=...)``:

- listens on the address meshrun chose (loopback for a one-node job, the interface toward
  the lighthouse otherwise), never on every interface;
- serves only a request signed with the job secret (a stranger cannot read the weights);
- signs what it serves, and the receiver checks the signature before reading a byte of it;
- loads with ``weights_only=True`` (tensors and plain containers: no code runs);
- refuses a state whose step is not the one the quorum announced (a replayed member's lie).

The state is serialized once per send, when torchft asks for it, so a slow receiver cannot
see the weights change under it (torchft's own transport locks them instead).
"""

from __future__ import annotations

import hmac
import http.client
import io
import ipaddress
import pickle
import socket
import threading
import urllib.parse
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
from torch.utils._pytree import tree_map
from torchft.checkpointing.transport import CheckpointTransport

from meshrun.runtime.secret import mac, sanitize

__all__ = ["HealError", "SignedTransport"]

_ASK = "meshrun-ft-heal-get"  # what a request's signature covers: its path
_ANSWER = "meshrun-ft-heal-state"  # what a response's covers: the step and the body
_AUTH_HEADER = "X-Meshrun-Auth"
_MAC_HEADER = "X-Meshrun-Mac"


class HealError(RuntimeError):
    """A heal answer meshrun refused (unsigned, wrong signature, wrong step)."""


class SignedTransport(CheckpointTransport[dict[str, Any]]):
    """An HTTP checkpoint server on ``host`` and its client; see the module docstring."""

    def __init__(self, key: bytes, host: str, timeout: timedelta) -> None:
        self._key, self._timeout = key, timeout
        self._ready = threading.Condition()
        self._step = -1  # the step whose state is served; -1: none
        self._body = b""
        self._server = _server(host, self)
        port = self._server.server_address[1]
        self._address = f"http://{_url_host(host)}:{port}/checkpoint/"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    # --- torchft's interface ---------------------------------------------------------------

    def metadata(self) -> str:
        return self._address

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: dict[str, Any], timeout: timedelta
    ) -> None:
        buf = io.BytesIO()
        torch.save(tree_map(_cpu, state_dict), buf)
        with self._ready:
            self._body, self._step = buf.getvalue(), step
            self._ready.notify_all()

    def disallow_checkpoint(self) -> None:
        with self._ready:
            self._body, self._step = b"", -1

    def recv_checkpoint(
        self, src_rank: int, metadata: str, step: int, timeout: timedelta
    ) -> dict[str, Any]:
        url = urllib.parse.urlsplit(f"{metadata}{step}/full")
        if url.scheme != "http" or not url.hostname or url.port is None:
            raise HealError(
                f"healing: the peer's checkpoint address {sanitize(metadata, 80)!r} "
                "is not http://HOST:PORT/..."
            )
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout.total_seconds())
        try:
            conn.request(
                "GET", url.path, headers={_AUTH_HEADER: mac(self._key, _ASK, url.path.encode())}
            )
            resp = conn.getresponse()
            body = resp.read()
            signature = resp.getheader(_MAC_HEADER, "")
        finally:
            conn.close()
        if resp.status != 200:
            raise HealError(
                f"healing: the peer answered {resp.status} ({sanitize(body.decode(errors='replace'), 80)})"
            )
        want = mac(self._key, _ANSWER, f"{step}\0".encode() + body)
        if not hmac.compare_digest(signature, want):
            raise HealError(
                "healing: the state received is not signed with this job's secret; refused unread"
            )
        try:
            state: dict[str, Any] = torch.load(io.BytesIO(body), weights_only=True)
        except pickle.UnpicklingError as err:
            raise HealError(
                "healing: the peer's state holds an object that weights_only=True refuses "
                f"({sanitize(str(err).splitlines()[-1] if str(err) else '', 160)}); meshrun "
                "loads heals without pickle: keep the states of schedulers, the scaler and "
                "the data plain (tensors, numbers, strings, lists, dicts)"
            ) from err
        sent = state.get("torchft", {}).get("step")
        if sent != step:
            raise HealError(f"healing: the peer sent step {sent!r}, the quorum said {step}")
        return state

    def shutdown(self, wait: bool = True) -> None:
        stopper = threading.Thread(target=self._stop, daemon=True)
        stopper.start()
        if wait:
            stopper.join()

    # --- the server side --------------------------------------------------------------------

    def _stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def answer(self, path: str, auth: str) -> tuple[int, bytes, str]:
        """(status, body, signature) for a GET of ``path`` carrying ``auth``."""
        if not hmac.compare_digest(auth, mac(self._key, _ASK, path.encode())):
            return 403, b"unsigned request", ""
        parts = path.split("/")
        if (
            len(parts) != 4
            or parts[1] != "checkpoint"
            or not parts[2].isdigit()
            or parts[3] != "full"
        ):
            return 400, b"expected /checkpoint/STEP/full", ""
        step = int(parts[2])
        with self._ready:
            # The receiver may ask before this rank's quorum thread has staged the state.
            if not self._ready.wait_for(lambda: self._step == step, self._timeout.total_seconds()):
                return 409, f"not serving step {step}".encode(), ""
            body = self._body
        return 200, body, mac(self._key, _ANSWER, f"{step}\0".encode() + body)


def _server(host: str, transport: SignedTransport) -> ThreadingHTTPServer:
    seconds = transport._timeout.total_seconds()

    class Handler(BaseHTTPRequestHandler):
        # A client that stalls does not hold a server thread forever.
        timeout = seconds

        def do_GET(self) -> None:
            status, body, signature = transport.answer(
                self.path, self.headers.get(_AUTH_HEADER, "")
            )
            self.send_response(status)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(len(body)))
            if signature:
                self.send_header(_MAC_HEADER, signature)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # a line per heal request on stderr: the ft_heal event says it

    family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    server_class = type(
        "HealServer", (ThreadingHTTPServer,), {"address_family": family, "daemon_threads": True}
    )
    server: ThreadingHTTPServer = server_class((host, 0), Handler)
    return server


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _cpu(value: Any) -> Any:
    return value.cpu() if isinstance(value, torch.Tensor) and value.device.type != "cpu" else value
