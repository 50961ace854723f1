"""Print what torchrun gave this worker, as one JSON line (no process group: fast)."""

import json
import os
import sys

KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR")
line = "TOPOLOGY " + json.dumps({k: os.environ.get(k) for k in KEYS}) + "\n"
# One write of the whole line: the node's workers share one pipe, and print() under
# PYTHONUNBUFFERED writes the text and its newline separately, so another worker's line
# could land between them.
sys.stdout.write(line)
sys.stdout.flush()
