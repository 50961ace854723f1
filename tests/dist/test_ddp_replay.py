"""Why a 4-rank DDP resume replays to float rounding and not bitwise, and what makes it bitwise:
a new DDP process's first backward sums in other buckets than its later ones, unless
``find_unused_parameters`` keeps the first layout. The resume line's note
(``checks.ddp_replay_note``) says so exactly when it applies."""

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from _dist import run_distributed
from meshrun.checkpoint.checks import ddp_replay_note


def _three_passes(ddp: DDP, x: torch.Tensor) -> tuple[bool, bool, str | None]:
    """Three backward passes on the same input: pass 1 == pass 2, pass 2 == pass 3 (bitwise,
    the all-reduced gradients), and the resume line's note for this DDP."""
    g = []
    for _ in range(3):
        ddp.zero_grad(set_to_none=True)
        ddp(x).pow(2).sum().backward()
        g.append(torch.cat([p.grad.flatten() for p in ddp.module.parameters()]))  # type: ignore[union-attr]
    return torch.equal(g[0], g[1]), torch.equal(g[1], g[2]), ddp_replay_note(ddp)


def _model() -> nn.Module:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(12)]
    return nn.Sequential(*blocks, nn.Linear(256, 10))


def _passes(rank: int, world_size: int) -> dict[str, Any]:
    dist.init_process_group("gloo")
    torch.manual_seed(1 + rank)
    x = torch.randn(8, 256)
    out: dict[str, Any] = {}
    for name, find_unused in (("default", False), ("find_unused", True)):
        ddp = DDP(_model(), bucket_cap_mb=0.5, find_unused_parameters=find_unused)
        out[name] = _three_passes(ddp, x)
    pair = dist.new_group([0, 1])  # every rank creates it; ranks 0 and 1 use it
    if rank < 2:
        out["two_ranks"] = _three_passes(DDP(_model(), bucket_cap_mb=0.5, process_group=pair), x)
    dist.barrier()
    return out


def test_ddp_first_pass_differs_on_4_ranks_unless_buckets_are_kept_and_the_note_says_so() -> None:
    results = run_distributed(_passes, 4)
    first_equal, later_equal, note = results[0]["default"]
    assert not first_equal, "DDP's first pass now sums like its later ones: drop the note"
    assert later_equal
    assert note is not None and "DDP over 4 ranks" in note and "find_unused_parameters" in note
    assert results[0]["find_unused"] == (True, True, None)
    assert results[0]["two_ranks"] == (True, True, None)
    assert ddp_replay_note(nn.Linear(2, 2)) is None  # not DDP: nothing to say
