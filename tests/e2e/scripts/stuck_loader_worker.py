"""A loader whose workers never answer (each waits for ever in ``__getitem__``, as a worker
deadlocked while it started would): the first step never gets its batch, the watchdog ends
the rank, and ``meshrun launch`` must end the workers, which outlive it, too."""

import threading
from typing import Any

import torch
from torch.utils.data import Dataset

import meshrun


class Stuck(Dataset[Any]):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        threading.Event().wait()  # no signal ends it: meshrun's SIGTERM handler only records
        return torch.zeros(1)


@meshrun.main
def main() -> None:
    run = meshrun.init()
    model = run.parallelize(torch.nn.Linear(1, 1))
    for batch in run.steps(run.dataloader(Stuck())):
        run.backward(model(batch).sum())


if __name__ == "__main__":
    main()
