"""Pipeline parallel on ``torch.distributed.pipelining``: where to cut (``split``), the stage
modules and their hints (``stages``), tied weights across stages (``tied``), meta-device
stage building (``meta``), and the schedule the loop calls (``pipeline``)."""

from typing import TYPE_CHECKING

from meshrun._lazy import lazy_exports

if TYPE_CHECKING:
    from meshrun.parallel.pp.pipeline import Pipeline, build_pipeline, pipeline_eval, pipeline_step

__getattr__ = lazy_exports(
    globals(),
    {
        "Pipeline": "meshrun.parallel.pp.pipeline",
        "build_pipeline": "meshrun.parallel.pp.pipeline",
        "pipeline_eval": "meshrun.parallel.pp.pipeline",
        "pipeline_step": "meshrun.parallel.pp.pipeline",
    },
)

__all__ = ["Pipeline", "build_pipeline", "pipeline_eval", "pipeline_step"]
