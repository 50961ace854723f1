"""A plain DDP run imports none of torch's heavy distributed parts it does not use.

``torch.distributed.pipelining``, ``torch.distributed.tensor`` (DTensor), FSDP,
``torch.distributed.optim`` (ZeRO-1) and DCP cost about 2 s of CPU to import together (issue 19:
a meshrun script's launch-to-first-step against a hand-written loop). meshrun imports each where
a layout, a pipeline or a checkpoint first needs it. Checked in a fresh interpreter, since this
test process has imported them all already. torch itself imports DTensor and FSDP when a DDP
model or an optimizer is built (``torch._dynamo``), so those two are checked before that.

meshrun's own modules that such a run does not use are checked the same way: the node-local
checkpoint tier (``checkpoint.local_interval = 0``), async saves (``checkpoint.async = false``),
the initial-weights loader with its Hugging Face reading (no ``checkpoint.init_from``) and the
pipeline's modules (``parallel/pp*.py``: no ``run.pipeline``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

HEAVY = ["pipelining", "tensor", "fsdp", "optim", "checkpoint"]
UNUSED = [
    "meshrun.checkpoint.local.tier",
    "meshrun.checkpoint.local.files",
    "meshrun.checkpoint.local.rules",
    "meshrun.checkpoint.local.p2p",
    "meshrun.checkpoint.local.restore",
    "meshrun.checkpoint.async_save",
    "meshrun.checkpoint.init_from",
    "meshrun.hf.reading",
    "meshrun.parallel.pp.pipeline",
    "meshrun.parallel.pp.split",
    "meshrun.parallel.pp.stages",
    "meshrun.parallel.pp.tied",
    "meshrun.parallel.pp.meta",
]

SCRIPT = """
import json, sys
import torch
from torch import nn
import meshrun

heavy = ["torch.distributed." + m for m in %r]
unused = %r
seen = {}
run = meshrun.init(argv=["--job.run_dir=%s"])
model = run.parallelize(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)))
seen["parallelize"] = [m for m in heavy if m in sys.modules]
opt = run.optimizer(model, torch.optim.AdamW, lr=1e-2)
loss = model(torch.randn(2, 4)).sum()
run.backward(loss)
run.optimizer_step(opt)
seen["step"] = [m for m in heavy if m in sys.modules]
seen["meshrun"] = [m for m in unused if m in sys.modules]
print("SEEN", json.dumps(seen), flush=True)
"""


def test_ddp_path_imports_no_pipelining_dtensor_zero1_or_dcp(tmp_path: object) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("MESHRUN_CONFIG", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT % (HEAVY, UNUSED, tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("SEEN "))
    seen = json.loads(line[len("SEEN ") :])
    # Up to the layout: none of them.
    assert seen["parallelize"] == [], seen
    # After torch's own optimizer and a step: DTensor and FSDP may come from torch._dynamo,
    # never pipelining, ZeRO-1's optimizer or DCP (this run neither pipelines nor saves).
    assert not {"torch.distributed." + m for m in ("pipelining", "optim", "checkpoint")} & set(
        seen["step"]
    ), seen
    # No node-local tier, no async save, no init_from, no pipeline: none of their modules.
    assert seen["meshrun"] == [], seen
