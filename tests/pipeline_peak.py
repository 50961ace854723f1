"""One pipeline step's measured peak per rank, for the tests that hold the memory trace of a
pipeline against a real run (tests/dist/test_memory_trace_pp.py, _interleaved.py,
test_moe_pp.py): the model through meshrun's pipeline on pp ranks, AdamW, a token batch, and
torch's MemTracker over the stages (``parallel/trace_stages.measured_stage_peak``). Called
inside each rank's process, after its process group is up."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from meshrun.config import ParallelConfig


def token_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def pipeline_peak(model: nn.Module, cfg: ParallelConfig, rows: int, seq: int, vocab: int) -> float:
    """This rank's peak over one step after a warm-up step; ``rows`` per micro-batch."""
    from meshrun.parallel import build_optimizer, parallelize_pipeline
    from meshrun.parallel.trace_stages import measured_stage_peak
    from meshrun.runtime.mesh import ParallelDims, build_mesh

    mesh = build_mesh(ParallelDims(cfg.pp, 1, 1, 1), "cpu")
    pipe = parallelize_pipeline(model, mesh, cfg, torch.device("cpu"), token_loss)
    opt = build_optimizer(pipe, torch.optim.AdamW, mesh, cfg, lr=1e-4, foreach=False)
    shape = (rows * cfg.pp_microbatches, seq + 1)
    tokens = torch.randint(0, vocab, shape, generator=torch.Generator())
    return measured_stage_peak(pipe, opt, tokens)
