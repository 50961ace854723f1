"""Print what torchrun gave this worker, as one JSON line (no process group: fast)."""

import json
import os

KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR")
print("TOPOLOGY " + json.dumps({k: os.environ.get(k) for k in KEYS}), flush=True)
