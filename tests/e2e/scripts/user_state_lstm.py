"""A user's own loop with its own state, as ported scripts have it: an LSTM language model
with dropout whose hidden state is carried from one step to the next on each rank (truncated
backpropagation through time: per rank by nature), and the user's own LambdaLR (warmup, then
linear decay), stepped after ``run.optimizer_step``. Both are registered with ``run.resume``.

Every rank appends ``{step, loss, lr, hidden}`` (exact: float.hex and a digest) to
``$RECORD_DIR/rank_<r>.jsonl`` after each step. With ``$KILL_AT`` set, rank 1 SIGKILLs itself
after that step once (``$RECORD_DIR/killed`` records it), so ``meshrun launch --max-restarts``
restarts the job and it resumes from the newest checkpoint.
"""

import hashlib
import json
import os
import signal
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import meshrun

VOCAB, SEQ, STEPS = 24, 12, 12
RECORD = Path(os.environ["RECORD_DIR"])
KILL_AT = int(os.environ.get("KILL_AT", "0"))


class LSTMModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.drop = nn.Dropout(0.3)
        self.lstm = nn.LSTM(16, 16, batch_first=True)
        self.head = nn.Linear(16, VOCAB)

    def forward(
        self, x: torch.Tensor, hidden: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        out, hidden = self.lstm(self.drop(self.emb(x)), hidden)
        return self.head(self.drop(out)), hidden


class Carried:
    """The hidden state carried over this rank's stream of batches (per rank)."""

    def __init__(self) -> None:
        self.hidden: tuple[torch.Tensor, torch.Tensor] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {} if self.hidden is None else {"h": self.hidden[0], "c": self.hidden[1]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.hidden = (state["h"], state["c"]) if state else None


def digest(carried: Carried) -> str:
    assert carried.hidden is not None
    data = b"".join(t.numpy().tobytes() for t in carried.hidden)
    return hashlib.sha256(data).hexdigest()[:16]


def schedule(step: int) -> float:
    return min(1.0, (step + 1) / 4) * max(0.05, 1.0 - step / STEPS)


@meshrun.main
def main() -> None:
    run = meshrun.init()
    model = run.parallelize(LSTMModel())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    corpus = torch.randint(0, VOCAB, (256, SEQ + 1), generator=torch.Generator().manual_seed(0))
    loader = run.dataloader(corpus)
    carried = Carried()
    run.resume(model, opt, loader, sched=sched, per_rank={"hidden": carried})
    records = (RECORD / f"rank_{run.rank}.jsonl").open("a")
    for batch in run.steps(loader, steps=STEPS):
        logits, hidden = model(batch[:, :-1], carried.hidden)
        carried.hidden = (hidden[0].detach(), hidden[1].detach())
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        run.backward(loss)
        lr = opt.param_groups[0]["lr"]
        run.optimizer_step(opt)
        sched.step()
        row = {
            "step": run.step,
            "loss": loss.item().hex(),
            "lr": lr.hex(),
            "hidden": digest(carried),
        }
        records.write(json.dumps(row) + "\n")
        records.flush()
        marker = RECORD / "killed"
        if run.step == KILL_AT and run.rank == 1 and not marker.exists():
            marker.write_text(f"rank 1 killed after step {KILL_AT}\n")
            os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
