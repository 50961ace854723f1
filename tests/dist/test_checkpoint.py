"""Checkpoints through meshrun on Gloo, in real processes.

Resharding: a run saved on 4 ranks (ZeRO-3 = FSDP2, accumulation 2) resumes on 2 ranks (DDP,
accumulation 4) and on 1 rank (accumulation 8): the global batch is kept, the samples of every
later step are exactly those of the uninterrupted 4-rank run (no replay, no skip), and the
parameters match it, while a user object registered by name comes back. Validation on the way: a tampered shard
is skipped by auto-resume with a warning naming the file, and ``resume=PATH`` to it fails loudly.
"""

import logging
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils.data import Dataset

import meshrun
from _dist import run_distributed
from meshrun.checkpoint import CheckpointError, on_disk
from meshrun.checkpoint.checks import pick
from meshrun.cli.main import main as cli_main

GLOBAL_BATCH = 16
MICRO = 2
SAVE_AT = 3
STEPS = 6

Batch = dict[str, torch.Tensor]


class Indexed(Dataset[Batch]):
    """96 fixed regression samples that also return their index (to audit the data order)."""

    def __init__(self, n: int = 96) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = torch.tanh(self.x @ torch.randn(8, 2, generator=g))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int | list[int]) -> Batch:
        return {"x": self.x[i], "y": self.y[i], "idx": torch.tensor(i)}


class Counter:
    """A user object registered by name: its state must come back."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = state["n"]


def build_model() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


def make_config(
    run_dir: Path, ckpt_dir: Path, resume: str, interval: int, zero: int = 0
) -> meshrun.Config:
    cfg = meshrun.Config()
    cfg.job.run_dir = str(run_dir)
    cfg.job.device = "cpu"
    cfg.job.timeout_s = 60.0
    cfg.data.global_batch, cfg.data.micro_batch = GLOBAL_BATCH, MICRO
    cfg.optim.steps, cfg.optim.lr, cfg.optim.warmup_steps = STEPS, 0.05, 2
    cfg.metrics.progress = False
    cfg.checkpoint.dir, cfg.checkpoint.resume = str(ckpt_dir), resume
    cfg.checkpoint.interval = interval
    cfg.parallel.zero = zero
    return cfg


def train(rank: int, world_size: int, cfg: meshrun.Config) -> dict[str, Any]:
    """The user's loop: AdamW, a scheduler, a named object; records the sample ids per step."""
    run = meshrun.init(cfg, argv=[])
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda r: warnings.append(r.getMessage())  # type: ignore[method-assign]
    logging.getLogger("meshrun").addHandler(handler)
    model = run.parallelize(build_model())
    opt = torch.optim.AdamW(model.parameters(), lr=run.scaled_lr())
    run.lr_scheduler(opt)
    loader = run.dataloader(Indexed())
    counter = Counter()
    start = run.resume(model, opt, loader, counter=counter)
    restored_counter = counter.n
    ids: dict[int, list[int]] = {}
    for batch in run.steps(loader):
        ids.setdefault(run.step + 1, []).extend(batch["idx"].tolist())
        counter.n += 1  # micro-batches; updated before optimizer_step, which may save
        run.backward(F.mse_loss(model(batch["x"]), batch["y"]))
        run.optimizer_step(opt)
    # full (unsharded) weights on rank 0, whatever the layout: a collective
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    probe = Indexed()[list(range(8))]  # type: ignore[index]
    with torch.no_grad():  # the distributed model's loss on a fixed batch (for the export check)
        probe_loss = float(F.mse_loss(model(probe["x"]), probe["y"]))
    out = {
        "probe_loss": probe_loss,
        "start": start,
        "counter": restored_counter,
        "accum": run.accum,
        "ids": ids,
        "params": {k: v.detach().clone() for k, v in full.items()},
        "lr": opt.param_groups[0]["lr"],
        "warnings": warnings,
    }
    run.close()
    return out


def flip_one_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def ids_per_step(results: list[dict[str, Any]]) -> dict[int, list[int]]:
    """The sorted sample ids of each optimizer step, over all ranks."""
    steps = sorted({s for r in results for s in r["ids"]})
    return {s: sorted(i for r in results for i in r["ids"].get(s, [])) for s in steps}


@pytest.mark.timeout(240)
def test_resume_on_other_world_sizes_keeps_batch_data_and_loss(tmp_path: Path) -> None:
    saved = tmp_path / "ckpt4"
    ref = run_distributed(train, 4, make_config(tmp_path / "r4", saved, "never", SAVE_AT, zero=3))
    ref_ids = ids_per_step(ref)
    assert [c.step for c in on_disk.list_checkpoints(saved)] == [SAVE_AT, STEPS]
    # every sample of the first epoch exactly once over the 6 steps of 16 (96 samples)
    assert sorted(i for s in ref_ids.values() for i in s) == list(range(96))
    # 2 ranks resume with "auto" from a copy whose newest checkpoint has a tampered shard: they
    # must skip it (warning naming the file) and take step 3; 1 rank resumes step 3 by path.
    tampered = tmp_path / "tampered"
    shutil.copytree(saved, tampered)
    flip_one_byte(on_disk.step_dir(tampered, STEPS) / "__1_0.distcp")
    on_disk.tmp_dir(tampered, 9).mkdir()  # what a save killed midway leaves behind
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp: SHA-256"):
        pick(tampered, str(on_disk.step_dir(tampered, STEPS)))  # resume=PATH fails loudly
    resume = {2: "auto", 1: str(on_disk.step_dir(saved, SAVE_AT))}
    for world, accum in ((2, 4), (1, 8)):
        ckpt = tampered if world == 2 else tmp_path / "ckpt1"
        cfg = make_config(tmp_path / f"r{world}", ckpt, resume[world], 0)
        got = run_distributed(train, world, cfg, timeout=150)
        if world == 2:
            got_auto_warnings = got[0]["warnings"]
        assert {r["start"] for r in got} == {SAVE_AT} and got[0]["counter"] == SAVE_AT * 2
        assert got[0]["accum"] == accum
        got_ids = ids_per_step(got)
        assert sorted(got_ids) == list(range(SAVE_AT + 1, STEPS + 1))
        for step, samples in got_ids.items():
            assert samples == ref_ids[step], f"world {world}, step {step}: other samples"
        diff = max(
            float((got[0]["params"][k] - ref[0]["params"][k]).abs().max()) for k in ref[0]["params"]
        )
        print(
            f"resumed 4 (ZeRO-3) -> {world} ranks: max |param diff| vs uninterrupted = {diff:.2e}"
        )
        assert diff < 1e-5
        assert got[0]["lr"] == pytest.approx(ref[0]["lr"])
    [warning] = got_auto_warnings
    assert "skipping" in warning and "__1_0.distcp" in warning and "SHA-256" in warning
    check_cli_verify_and_export(tmp_path, saved, tampered, ref[0]["probe_loss"])


def check_cli_verify_and_export(tmp: Path, saved: Path, tampered: Path, probe_loss: float) -> None:
    """`meshrun ckpt verify` names the tampered shard; `meshrun ckpt export` loads into a plain
    single-process model that gives the distributed model's loss on a batch."""
    assert cli_main(["ckpt", "verify", str(saved)]) == 0
    assert cli_main(["ckpt", "verify", str(tampered)]) == 1
    for name in ("model.safetensors", "model.pt"):
        out = tmp / name
        assert cli_main(["ckpt", "export", str(on_disk.step_dir(saved, STEPS)), str(out)]) == 0
        sd = load_file(out) if name.endswith("safetensors") else torch.load(out, weights_only=True)
        plain = build_model()
        plain.load_state_dict(sd, strict=True)
        probe = Indexed()[list(range(8))]  # type: ignore[index]
        with torch.no_grad():
            loss = float(F.mse_loss(plain(probe["x"]), probe["y"]))
        print(f"export {name}: loss {loss:.6f} vs distributed model {probe_loss:.6f}")
        assert loss == pytest.approx(probe_loss, rel=1e-6)


class Noise(Dataset[Batch]):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> Batch:
        return {"x": torch.full((256,), float(i) / 64)}


def fill_the_disk(rank: int, world_size: int, cfg: meshrun.Config) -> dict[str, Any]:
    """Step, save (fits), step, save (the disk is full): the error must reach every rank, the
    state must be untouched by the failed save, and training must go on."""
    run = meshrun.init(cfg, argv=[])
    model = run.parallelize(nn.Linear(256, 256))  # ~0.8 MB of checkpoint with AdamW
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    loader = run.dataloader(Noise())
    run.resume(model, opt, loader)
    batches = iter(run.steps(loader, steps=3))

    def one_step() -> None:
        run.backward(model(next(batches)["x"]).square().mean())
        run.optimizer_step(opt)

    one_step()
    first = run.save_checkpoint()
    one_step()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        run.save_checkpoint()
        error = ""
    except CheckpointError as e:
        error = str(e)
    intact = all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    one_step()  # training goes on
    run.close()
    return {"error": error, "intact": intact, "first": str(first), "step": run.step}


@pytest.mark.timeout(120)
def test_disk_full_is_a_clear_error_and_the_previous_checkpoint_stays(tmp_path: Path) -> None:
    small = tmp_path / "small"
    small.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1200k", "tmpfs", str(small)], capture_output=True
        ).returncode
    ):
        pytest.skip("needs root to mount a small tmpfs")
    try:
        cfg = make_config(tmp_path / "run", small, "never", 0)
        cfg.data.global_batch, cfg.data.micro_batch = 2, 1
        got = run_distributed(fill_the_disk, 2, cfg)
        for r in got:
            print(f"rank error: {r['error']}")
            assert "step 2 failed" in r["error"] and "previous checkpoint (step 1)" in r["error"]
            assert r["intact"] and r["step"] == 3
        assert "(disk full)" in got[0]["error"] + got[1]["error"]
        assert [c.step for c in on_disk.list_checkpoints(small)] == [1]
        assert on_disk.problems(Path(got[0]["first"])) == []
        assert not on_disk.tmp_dir(small, 2).exists()  # the space was given back
    finally:
        subprocess.run(["umount", str(small)], check=False)


def train_async(rank: int, world_size: int, cfg: meshrun.Config) -> dict[str, Any]:
    """Async interval saves while training goes on: each checkpoint must hold the state of
    its own step, although the parameters changed while it was written."""
    run = meshrun.init(cfg, argv=[])
    records: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda r: records.append(r.getMessage())  # type: ignore[method-assign]
    logging.getLogger("meshrun").addHandler(handler)
    model = run.parallelize(build_model())
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    loader = run.dataloader(Indexed())
    run.resume(model, opt, loader)
    snapshots: dict[int, dict[str, torch.Tensor]] = {}
    for batch in run.steps(loader):
        run.backward(F.mse_loss(model(batch["x"]), batch["y"]))
        if run.optimizer_step(opt):
            net = getattr(model, "module", model)
            snapshots[run.step] = {k: v.detach().clone() for k, v in net.state_dict().items()}
    run.close()  # commits the save still in flight
    return {"snapshots": snapshots, "log": [m for m in records if "async" in m]}


@pytest.mark.timeout(120)
def test_async_save_holds_the_state_of_its_step_and_reports_times(tmp_path: Path) -> None:
    cfg = make_config(tmp_path / "run", tmp_path / "ckpt", "never", 2)
    cfg.checkpoint.async_, cfg.checkpoint.keep_last = True, 10
    got = run_distributed(train_async, 2, cfg)
    assert [c.step for c in on_disk.list_checkpoints(tmp_path / "ckpt")] == [2, 4, 6]
    for step in (2, 4, 6):
        path = on_disk.step_dir(tmp_path / "ckpt", step)
        assert on_disk.problems(path) == []
        out = tmp_path / f"s{step}.pt"
        assert cli_main(["ckpt", "export", str(path), str(out)]) == 0
        saved = torch.load(out, weights_only=True)
        snap = got[0]["snapshots"][step]
        assert all(torch.equal(saved[k], snap[k]) for k in snap), f"step {step} differs"
    print("\n".join(got[0]["log"]))
    assert len(got[0]["log"]) == 3 and all("training blocked" in m for m in got[0]["log"])


@pytest.mark.timeout(150)
def test_new_global_batch_is_an_error_unless_allowed_then_lr_rescaled(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"

    def config(resume: str, global_batch: int, allow: bool = False) -> meshrun.Config:
        cfg = make_config(tmp_path / f"r{global_batch}{allow}", ckpt, resume, SAVE_AT)
        cfg.data.global_batch = global_batch
        cfg.optim.lr_scaling, cfg.optim.ref_batch = "linear", GLOBAL_BATCH
        cfg.checkpoint.allow_new_global_batch = allow
        return cfg

    [ref] = run_distributed(train, 1, config("never", GLOBAL_BATCH))
    at = str(on_disk.step_dir(ckpt, SAVE_AT))
    with pytest.raises(pytest.fail.Exception, match=r"allow_new_global_batch"):
        run_distributed(train, 1, config(at, 2 * GLOBAL_BATCH))
    [got] = run_distributed(train, 1, config(at, 2 * GLOBAL_BATCH, allow=True))
    assert got["start"] == SAVE_AT
    # the data position carries over in samples: the first bigger batch holds exactly the
    # samples the uninterrupted run saw in its next two steps
    assert sorted(got["ids"][SAVE_AT + 1]) == sorted(
        ref["ids"][SAVE_AT + 1] + ref["ids"][SAVE_AT + 2]
    )
    # linear rule: twice the batch, twice the LR at the same point of the same schedule
    assert got["lr"] == pytest.approx(2 * ref["lr"])
    assert any("LR x 2" in w for w in got["warnings"])
