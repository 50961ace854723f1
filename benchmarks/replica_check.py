"""What the replica check (``monitor.replica_check_every``, monitor/replicas_check.py) costs:
the digest of every parameter, interleaved with training steps of the demo GPT, medians.

    .venv/bin/python benchmarks/replica_check.py [--size tiny|small] [--rounds 30]

One process, one thread. Each round runs A (a training step: forward, backward, AdamW) and B
(the same step, then the digest of every parameter, what each check computes), in alternating
order, so both see the machine at nearly the same time. Reported: the medians of A and B, the
median of the digest alone, and the check's cost as a share of a step at N = 1, 10, 100 (the
digest once per N steps). What this leaves out: the check's one all-gather of 16 bytes per
parameter (2 int64 each) over the data-parallel ranks, a few KiB for these models, and under
DDP no other collective; on a GPU the digest runs on the device (written, not measured here).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from meshrun.demo.model import GPT, demo_config
from meshrun.monitor.replicas_check import digest


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small", choices=["tiny", "small"])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--batch", type=int, default=8)
    a = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = demo_config(a.size)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, cfg.vocab_size, (a.batch, cfg.seq_len))

    def step() -> None:
        logits = model(x)
        F.cross_entropy(logits.flatten(0, 1), x.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def check() -> float:
        t0 = time.perf_counter()
        for q in model.parameters():
            digest(q)
        return time.perf_counter() - t0

    step()  # warm-up
    plain, checked, alone = [], [], []
    for r in range(a.rounds):
        for b in (r % 2 == 1, r % 2 == 0):  # A B, then B A
            t0 = time.perf_counter()
            step()
            if b:
                alone.append(check())
            (checked if b else plain).append(time.perf_counter() - t0)
    n = sum(q.numel() for q in model.parameters())
    params = len(list(model.parameters()))
    a_s, b_s, d_s = (statistics.median(v) for v in (plain, checked, alone))
    print(f"demo GPT {a.size}: {n:,} parameters in {params} tensors, batch {a.batch}, 1 thread")
    print(
        f"A step {a_s * 1e3:.2f} ms, B step + digest {b_s * 1e3:.2f} ms (medians, {a.rounds} pairs)"
    )
    print(f"digest alone {d_s * 1e3:.3f} ms = {d_s / a_s:.1%} of a step")
    for every in (1, 10, 100):
        print(f"  replica_check_every = {every}: {d_s / a_s / every:.3%} of the step time")


if __name__ == "__main__":
    main()
