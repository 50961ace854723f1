"""A small training job for the replica-group tests (tests/e2e/test_ft.py, benchmarks/ft.py).

It records what the tests compare: every process start (its PID) in RUN_DIR/pids.txt, the
dataset indices of every committed step in RUN_DIR/samples.rank<r>.jsonl (a line per step
this rank's optimizer_step committed; a step that did not commit writes none), and at the
end a checksum of this rank's parameters and its data position in
RUN_DIR/checksum.rank<r>.json.

Faults, by environment (the group's index comes from the config, so only the named group's
processes act; a marker file keeps a restarted worker from repeating a kill it already did):
- FT_KILL_STEPS="G:S1,S2,..": group G's rank 0 SIGKILLs itself in the forward of step S, or
  of the first step after S that this process reaches having committed a step (a restarted
  process has healed first: each kill breaks a recovered group).
- FT_KILL_IN_ALLREDUCE="G:S": group G's rank 0 dies at step S's cross-group all-reduce,
  after its peers are in it (they see the connection reset mid-collective).
- FT_RESUME=1: register model, optimizer and loader with run.resume (shared checkpoints).
- FT_OPTIM=sgd: plain SGD instead of AdamW, and targets a quarter the size (losses near 1).
- FT_SLEEP_S: seconds to sleep each step (room for the faults to land mid-run).
- FT_HOLD_AT=S, FT_ALONE=K: the groups without faults take at most K steps alone, then ask for
  the step's quorum again until the missing group is back in it; from step S on they take no
  step alone (_hold_quorum). So every planned kill and heal happens within the run, whatever a
  restart costs on a loaded machine, and no outcome depends on timing.
- FT_PAUSE_AT=S: every process, before the quorum of step S, writes RUN_DIR/paused.rank<r>
  and waits for the file `go` in the job's run directory (the test acts in between: a
  stranger's quorum request, tests/e2e/test_ft.py).
"""

import hashlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import meshrun
from meshrun.ft import data_share


def _plan(name: str, group: int) -> list[int]:
    text = os.environ.get(name, "")
    if not text:
        return []
    g, _, steps = text.partition(":")
    return [int(s) for s in steps.split(",") if s] if int(g) == group else []


def _once(run_dir: Path, tag: str) -> bool:
    """True the first time ``tag`` is asked for in this run directory (across restarts)."""
    marker = run_dir / f"done.{tag}"
    if marker.exists():
        return False
    marker.write_text("1")
    return True


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _hook_allreduce(run: meshrun.Run, step: int, run_dir: Path) -> None:
    manager = run._parts.replicas.manager  # type: ignore[union-attr]
    original = manager.allreduce

    def allreduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if run.step + 1 == step and _once(run_dir, f"allreduce{step}"):
            time.sleep(1.0)  # the peers enter the all-reduce and wait for this rank
            _die()
        return original(tensor, *args, **kwargs)

    manager.allreduce = allreduce


def _hold_quorum(run: meshrun.Run, groups: int, hold_at: int) -> None:
    """Test hook, every rank of a group without faults: wrap the step's quorum (ReplicaGroup's
    start_step). After ``FT_ALONE`` quorums without some group (or any, from step ``hold_at``
    on), ask for it again until every group is in it, as a fresh job's first step does
    (ft/replica.py). Waiting at the quorum itself, not before a step's forward: a survivor
    that sleeps outside a quorum request leaves the restarted group's request alone at the
    lighthouse, which refuses a quorum of half the live groups (no split brain), and a survivor
    that only waits for the restarted process to be up runs ahead of it until it requests. Both
    ranks of the group see the same live count, so both ask again alike."""
    replicas = run._parts.replicas
    assert replicas is not None
    original = replicas.start_step
    limit = int(os.environ.get("FT_ALONE", "3"))
    alone = 0  # consecutive quorums without every group

    def start_step() -> None:
        nonlocal alone
        original()
        alone = alone + 1 if replicas.live_groups < groups else 0
        deadline = time.monotonic() + 600
        final = run.step + 1 >= hold_at > 0
        while replicas.live_groups < groups and (alone >= limit or final):
            if time.monotonic() > deadline:
                raise RuntimeError("ft_worker: the missing replica group did not rejoin in 600 s")
            time.sleep(0.2)
            original()
        if replicas.live_groups == groups:
            alone = 0

    replicas.start_step = start_step  # type: ignore[method-assign]


def _pause_before_quorum(run: meshrun.Run, step: int, run_dir: Path) -> None:
    """Test hook (FT_PAUSE_AT): before step ``step``'s quorum, say so and wait for `go`."""
    replicas = run._parts.replicas
    assert replicas is not None
    original = replicas.start_step

    def start_step() -> None:
        if run.step + 1 == step:
            (run_dir / f"paused.rank{run.rank}").write_text(str(os.getpid()))
            go, deadline = run_dir.parent / "go", time.monotonic() + 600
            while not go.exists():
                if time.monotonic() > deadline:
                    raise RuntimeError("ft_worker: no `go` from the test in 600 s")
                time.sleep(0.05)
        original()

    replicas.start_step = start_step  # type: ignore[method-assign]


def _wait_for_records(run_dir: Path, ranks: int, step: int) -> None:
    """Before rank 0 kills its group: every rank of it has recorded the step it last committed.
    The group commits a step on all its ranks together, but torchrun ends the other ranks when
    rank 0 dies, which can land between a rank's commit and its record of the samples."""
    deadline = time.monotonic() + 120
    for r in range(ranks):
        path = run_dir / f"samples.rank{r}.jsonl"
        while not (path.exists() and any(row["step"] == step for row in _rows(path))):
            if time.monotonic() > deadline:
                raise RuntimeError(f"ft_worker: rank {r} never recorded step {step}")
            time.sleep(0.05)


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _record(path: Path, step: int, indices: list[int]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps({"step": step, "pid": os.getpid(), "indices": indices}) + "\n")


def _checksum(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p  # this rank's shard (FSDP2)
        h.update(local.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _start() -> tuple[meshrun.Run, Path]:
    """meshrun.init, and this process's start recorded in RUN_DIR/pids.txt."""
    run = meshrun.init()
    with open(run.run_dir / "pids.txt", "a") as f:
        f.write(f"{run.rank} {os.getpid()}\n")
    return run, run.run_dir


@meshrun.main
def main() -> None:
    run, run_dir = _start()
    ft = run.config.fault_tolerance
    x = torch.randn(4096, 16, generator=torch.Generator().manual_seed(0))
    y = x @ torch.randn(16, 1, generator=torch.Generator().manual_seed(1))
    if os.environ.get("FT_OPTIM") == "sgd":  # losses near 1, where float32 rounds at 1e-7
        y = y / 4
    data = TensorDataset(x, y, torch.arange(len(x)))  # the index: which samples were trained
    model = run.parallelize(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    if run.config.parallel.zero == 1:  # ZeRO-1: the state sharded over the group's ranks
        opt = run.optimizer(model, torch.optim.AdamW, lr=1e-2)
    elif os.environ.get("FT_OPTIM") == "sgd":  # DiLoCo's sync_every=1 equivalence (test_ft_diloco)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # run.sampler reads this group's share of the global batch (meshrun.ft.data_share).
    sampler = run.sampler(len(data))
    assert (sampler.rank, sampler.world_size) == data_share(ft, run.dp_rank, run.dp_size)
    loader = DataLoader(data, batch_size=run.config.data.micro_batch, sampler=sampler)
    if os.environ.get("FT_RESUME"):  # the restart-from-checkpoint baseline (benchmarks/ft.py)
        run.resume(model, opt, loader)
    kills = _plan("FT_KILL_STEPS", ft.group_index) if run.rank == 0 else []
    in_allreduce = _plan("FT_KILL_IN_ALLREDUCE", ft.group_index) if run.rank == 0 else []
    if in_allreduce:
        _hook_allreduce(run, in_allreduce[0], run_dir)
    sleep_s = float(os.environ.get("FT_SLEEP_S", "0"))
    faulty = _plan("FT_KILL_STEPS", ft.group_index) + _plan("FT_KILL_IN_ALLREDUCE", ft.group_index)
    if ft.enabled and not faulty:
        _hold_quorum(run, ft.replica_groups, int(os.environ.get("FT_HOLD_AT", "0")))
    if os.environ.get("FT_PAUSE_AT"):
        _pause_before_quorum(run, int(os.environ["FT_PAUSE_AT"]), run_dir)
    committed = 0  # steps this process committed
    trained: list[int] = []  # this step's dataset indices, written once it commits
    for inputs, targets, index in run.steps(loader):
        step = run.step + 1
        due = [k for k in kills if k <= step and not (run_dir / f"done.kill{k}").exists()]
        if due and committed and _once(run_dir, f"kill{due[0]}"):
            _wait_for_records(run_dir, run.world_size, run.step)
            print(f"ft_worker: group {ft.group_index} dies at step {step}", flush=True)
            _die()
        loss = nn.functional.mse_loss(model(inputs), targets)
        run.backward(loss)
        trained += index.tolist()
        boundary = run._parts.state.micro == run.accum - 1
        if run.optimizer_step(opt):
            committed += 1
            _record(run_dir / f"samples.rank{run.rank}.jsonl", run.step, trained)
            if sleep_s:
                time.sleep(sleep_s)
        if boundary:
            trained = []  # written, or not committed: the loop reads those positions again
    sampler = run._parts.state.sampler
    out = {
        "step": run.step,
        "checksum": _checksum(model),
        "pid": os.getpid(),
        "consumed": None if sampler is None else sampler.consumed,
    }
    (run_dir / f"checksum.rank{run.rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
