"""Which device and backend this process takes: cuda + nccl with one GPU per local rank, else
cpu + gloo, as the config asks, and never a silent fallback. Read by ``meshrun.init()``
(train/startup.py) and by a Ray worker checking the group Ray made (launch/ray/worker.py)."""

from __future__ import annotations

import torch

from meshrun.config import Config, ConfigError
from meshrun.runtime.launcher_env import LauncherEnv


def pick_device(cfg: Config, env: LauncherEnv) -> tuple[torch.device, str]:
    """cuda + nccl with one GPU per local rank, else cpu + gloo; never a silent fallback."""
    want, backend = cfg.job.device, cfg.job.backend
    has_cuda = torch.cuda.is_available()
    if want == "cuda" and not has_cuda:
        raise ConfigError("job.device = 'cuda' but no CUDA device is visible; use job.device=cpu")
    use_cuda = want == "cuda" or (want == "auto" and has_cuda)
    if backend == "nccl" and not use_cuda:
        raise ConfigError("job.backend = 'nccl' needs CUDA devices; use job.backend=gloo on CPU")
    if use_cuda:
        if env.local_rank >= torch.cuda.device_count():
            raise ConfigError(
                f"local rank {env.local_rank} has no GPU: only {torch.cuda.device_count()} visible; "
                "start at most one process per GPU (meshrun launch --nproc-per-node)"
            )
        torch.cuda.set_device(env.local_rank)
        device = torch.device("cuda", env.local_rank)
    else:
        device = torch.device("cpu")
    if backend == "auto":
        backend = "nccl" if use_cuda else "gloo"
    return device, backend
