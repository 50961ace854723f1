"""Bytes between ranks over the run's own process group (``torch.distributed`` point-to-point:
``batch_isend_irecv``), for the node-local tier's replicas and for fetching a lost shard back.
No other transport: on Gloo the buffers are CPU tensors, on NCCL tensors on the rank's GPU."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

__all__ = ["transfer"]


def transfer(
    sends: Mapping[int, bytes], recvs: Sequence[int], device: torch.device
) -> dict[int, bytes]:
    """Send ``sends[dst]`` to each ``dst`` and receive one message from each rank of ``recvs``
    (the senders and receivers must name each other). Sizes go first, so a receiver needs no
    bound; an empty message is a size of 0 and no payload. Returns ``{src: bytes}``."""
    if not sends and not recvs:
        return {}
    sizes_out = {
        d: torch.tensor([len(b)], dtype=torch.int64, device=device) for d, b in sends.items()
    }
    sizes_in = {s: torch.zeros(1, dtype=torch.int64, device=device) for s in recvs}
    _run(sizes_out, sizes_in)
    out = {d: _as_tensor(b, device) for d, b in sends.items() if b}
    inc = {
        s: torch.empty(int(n.item()), dtype=torch.uint8, device=device)
        for s, n in sizes_in.items()
        if int(n.item()) > 0
    }
    _run(out, inc)
    got = {s: t.cpu().numpy().tobytes() for s, t in inc.items()}
    return {s: got.get(s, b"") for s in recvs}


def _run(out: Mapping[int, torch.Tensor], inc: Mapping[int, torch.Tensor]) -> None:
    ops = [dist.P2POp(dist.isend, t, d) for d, t in out.items()]
    ops += [dist.P2POp(dist.irecv, t, s) for s, t in inc.items()]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def _as_tensor(data: bytes, device: torch.device) -> torch.Tensor:
    # frombuffer over a bytearray: one copy, and the tensor owns writable memory.
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
