"""The smallest distributed script: init over env:// (rank 0 listens on MASTER_PORT), one
barrier, done. No meshrun import: what a user's plain script does."""

import torch.distributed as dist

dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
