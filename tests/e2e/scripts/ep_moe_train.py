"""Worker for the expert-parallel kill-and-resume test: a tiny Qwen2-MoE (tests/moe_models.py)
at parallel.ep = 2 under ``meshrun launch``, a checkpoint every 2 steps, auto-resume. With
KILL_AT_STEP set, rank 1 of the first attempt dies (SIGKILL, no teardown) in the middle of that
step, after its forward; the restarted group resumes. Rank 0 writes the final weights (experts
whole) to RUN_DIR/final.pt."""

import os
import signal
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: moe_models

import meshrun
import moe_models
from meshrun.parallel.ep import full_state_dict


@meshrun.main
def main() -> None:
    torch.use_deterministic_algorithms(True)
    run = meshrun.init()
    model = run.parallelize(moe_models.tiny_qwen2_moe())
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    loader = run.dataloader(moe_models.Tokens())
    run.resume(model, opt, loader)
    kill_at = int(os.environ.get("KILL_AT_STEP", "0"))
    first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    for batch in run.steps(loader):
        loss = moe_models.loss_of(model, batch)
        if first and run.rank == 1 and run.step + 1 == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        run.backward(loss)
        run.optimizer_step(opt)
    params = full_state_dict(model)
    if run.rank == 0:
        torch.save(params, Path(run.config.job.run_dir) / "final.pt")
    run.close()


if __name__ == "__main__":
    main()
