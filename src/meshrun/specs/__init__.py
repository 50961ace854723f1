"""Pure numbers, at the bottom of the tree: the GPU table (peak FLOP/s, memory, links) that the
planner and the MFU metric both read."""

from meshrun.specs.gpus import GPU, GPUS, get_gpu, gpu_key

__all__ = ["GPU", "GPUS", "get_gpu", "gpu_key"]
