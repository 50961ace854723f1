"""The demo GPT for the replica-group layout tests (tests/e2e/test_ft_layouts.py): split into 2
stages (``--parallel.pp=2``) inside each group and trained through ``run.pipeline(model,
loss_fn)`` and ``run.pipeline_step``; without ``parallel.pp`` through ``run.parallelize`` (its
tensor-parallel plan under ``--parallel.tp=2``) and ``run.backward``.

It writes what ft_worker.py writes, with that script's helpers (imported from it, so the
faults and test hooks are the same): RUN_DIR/pids.txt, RUN_DIR/samples.rank<r>.jsonl (every
rank of a pipeline, and of a tensor-parallel group, reads the same micro-batches, so both
ranks record the same indices) and at the end RUN_DIR/checksum.rank<r>.json over this rank's
stage parameters (its shards under TP). Faults by
environment, as ft_worker.py reads them: FT_KILL_STEPS="G:S,..." (group G's rank 0, the first
stage, SIGKILLs itself in step S's forward), FT_HOLD_AT / FT_ALONE (the groups without faults
wait at their quorum for a missing group; ft_worker._hold_quorum).
"""

import dataclasses
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import meshrun
from meshrun.demo.model import GPT, demo_config
from meshrun.ft import data_share

sys.path.insert(0, str(Path(__file__).parent))
import ft_worker as base  # the helpers of the other replica-group worker, from its folder

SAMPLES = 4096  # as ft_worker.py's dataset: the test rebuilds its order from this


def build_model() -> GPT:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)  # the same initial weights in every group and in plain PP
        return GPT(dataclasses.replace(demo_config("tiny"), n_layer=2, seq_len=16))


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


@meshrun.main
def main() -> None:
    run, run_dir = base._start()
    ft = run.config.fault_tolerance
    tokens = torch.randint(0, 16, (SAMPLES, 17), generator=torch.Generator().manual_seed(0))
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:], torch.arange(SAMPLES))
    pipelined = run.config.parallel.pp > 1
    if pipelined:
        pipe = run.pipeline(build_model(), lm_loss)
        modules: nn.Module = nn.ModuleList(pipe.modules)
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    else:
        model = run.parallelize(build_model())  # TP by the GPT's plan under --parallel.tp
        modules = model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sampler = run.sampler(len(data))
    assert (sampler.rank, sampler.world_size) == data_share(ft, run.dp_rank, run.dp_size)
    loader = DataLoader(data, batch_size=run.config.data.micro_batch, sampler=sampler)
    kills = base._plan("FT_KILL_STEPS", ft.group_index) if run.rank == 0 else []
    if ft.enabled and not base._plan("FT_KILL_STEPS", ft.group_index):
        base._hold_quorum(run, ft.replica_groups, int(os.environ.get("FT_HOLD_AT", "0")))
    committed = 0
    trained: list[int] = []
    for inputs, targets, index in run.steps(loader):
        step = run.step + 1
        due = [k for k in kills if k <= step and not (run_dir / f"done.kill{k}").exists()]
        if due and committed and base._once(run_dir, f"kill{due[0]}"):
            base._wait_for_records(run_dir, run.world_size, run.step)
            print(f"ft_pp_worker: group {ft.group_index} dies at step {step}", flush=True)
            base._die()
        if pipelined:
            run.pipeline_step(pipe, inputs, targets)
        else:
            run.backward(lm_loss(model(inputs), targets))
        trained += index.tolist()
        boundary = run._parts.state.micro == run.accum - 1
        if run.optimizer_step(opt):
            committed += 1
            base._record(run_dir / f"samples.rank{run.rank}.jsonl", run.step, trained)
        if boundary:
            trained = []
    state = run._parts.state.sampler
    out = {
        "step": run.step,
        "checksum": base._checksum(modules),
        "pid": os.getpid(),
        "consumed": None if state is None else state.consumed,
    }
    if pipelined:
        out.update(first_stage=pipe.is_first, last_stage=pipe.is_last)
    (run_dir / f"checksum.rank{run.rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
