"""The planner's GPU table: re-exported from the leaf module :mod:`meshrun.gpus`, which the
training metrics' MFU reads too (peak FLOP/s, memory, link bandwidths per GPU)."""

from meshrun.gpus import GB_S, GPU, GPUS, TERA, get_gpu

__all__ = ["GB_S", "GPU", "GPUS", "TERA", "get_gpu"]
