"""The planner's GPU table: re-exported from the leaf module :mod:`meshrun.specs.gpus`, which the
training metrics' MFU reads too (peak FLOP/s, memory, link bandwidths per GPU)."""

from meshrun.specs.gpus import GB_S, GPU, GPUS, TERA, get_gpu

__all__ = ["GB_S", "GPU", "GPUS", "TERA", "get_gpu"]
