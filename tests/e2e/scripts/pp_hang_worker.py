"""A 2-stage pipeline (meshrun's run.pipeline / run.pipeline_step, the demo GPT) that the hang
tests stop at a chosen step (env, read by this test script only):

- TEST_PARK_AT=K: the last stage parks inside its loss function at step K, after writing its pid
  to RUN_DIR/parked, so that the test SIGSTOPs it there while the first stage waits for its
  gradient (a receive); it leaves the park once a hang file exists (the launcher continued it).
- TEST_STALL_AT=K: the first stage sleeps in this script before step K (it never sends that
  step's activations), so the last stage waits in a receive with no matching send.
"""

import dataclasses
import os
import time

import torch
import torch.nn.functional as F
from torch import Tensor

import meshrun
from meshrun.demo.model import GPT, demo_config


class Windows(torch.utils.data.Dataset[dict[str, Tensor]]):
    def __init__(self) -> None:
        self.tokens = torch.randint(0, 16, (512, 33), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"input": self.tokens[i, :-1], "target": self.tokens[i, 1:]}


def park_until_hang_reported(run: meshrun.Run) -> None:
    (run.run_dir / "parked").write_text(str(os.getpid()))
    deadline = time.monotonic() + 120
    while not (run.run_dir / "hang").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


@meshrun.main
def main() -> None:
    run = meshrun.init()
    pids = run.run_dir / "pids"  # for the test's clean-up (tests/e2e/test_monitor_signals.py)
    pids.mkdir(exist_ok=True)
    (pids / f"rank{run.rank}").write_text(str(os.getpid()))
    park_at = int(os.environ.get("TEST_PARK_AT", "0"))
    stall_at = int(os.environ.get("TEST_STALL_AT", "0"))

    def loss_fn(logits: Tensor, target: Tensor) -> Tensor:
        if run.step + 1 == park_at:
            park_until_hang_reported(run)
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())

    torch.manual_seed(0)
    pipe = run.pipeline(GPT(dataclasses.replace(demo_config("tiny"), n_layer=2)), loss_fn)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.01)
    for batch in run.steps(run.dataloader(Windows())):
        if run.rank == 0 and run.step + 1 == stall_at:
            time.sleep(120)  # stuck in user code: this step's sends are never posted
        run.pipeline_step(pipe, batch["input"], batch["target"])
        run.optimizer_step(opt)


if __name__ == "__main__":
    main()
