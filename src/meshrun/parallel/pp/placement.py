"""Which pipeline stages each rank holds, by schedule (``parallel.pp_schedule``).

- one stage per rank (``gpipe``, ``1f1b``): rank r holds stage r;
- looped (``interleaved``, ``zb1p``: ``pp_virtual_stages`` = v per rank): rank r holds stages
  r, r + pp, ..., r + (v - 1) pp (Megatron's interleaved placement);
- V-shaped (``zbv``, ``dualpipev``: two per rank): rank r holds stages r and 2 pp - 1 - r, so
  the first and the last stage are on rank 0 and a micro-batch turns back at rank pp - 1
  without a send (the Zero Bubble paper's ZB-V, Qi et al. 2024, Sec. 6; DeepSeek-V3's
  DualPipe, as torch ships it in ``ScheduleDualPipeV``).

The schedule computes the same mapping itself (``stage_index_to_group_rank``); the pipeline
checks the two agree once the schedule is built (parallel/pp/pipeline.py).
"""

from __future__ import annotations

from meshrun.config import ParallelConfig
from meshrun.config.world import PP_LOOPED as LOOPED
from meshrun.config.world import PP_V_SHAPED as V_SHAPED

__all__ = ["LOOPED", "V_SHAPED", "rank_of_stage", "stage_ids", "stages_per_rank"]


def stages_per_rank(cfg: ParallelConfig) -> int:
    if cfg.pp_schedule in V_SHAPED:
        return 2
    return cfg.pp_virtual_stages if cfg.pp_schedule in LOOPED else 1


def stage_ids(rank: int, cfg: ParallelConfig) -> list[int]:
    """The stages pp rank ``rank`` holds, in pipeline order."""
    if cfg.pp_schedule in V_SHAPED:
        return [rank, 2 * cfg.pp - 1 - rank]
    return [rank + k * cfg.pp for k in range(stages_per_rank(cfg))]


def rank_of_stage(stage: int, cfg: ParallelConfig) -> int:
    """The pp rank that holds ``stage``."""
    if cfg.pp_schedule in V_SHAPED:
        return stage if stage < cfg.pp else 2 * cfg.pp - 1 - stage
    return stage % cfg.pp
