"""One script that proves meshrun's CUDA paths on a GPU machine, in at most 8 minutes on one H200.

    PYTHONPATH=src python3 benchmarks/gpu_check.py [--out DIR] [--nproc N] [--steps 20]
    .venv/bin/python benchmarks/gpu_check.py --device cpu --tiny [--out DIR]   # the CI smoke run

Writes ``DIR/gpu_check.json`` and ``DIR/gpu_check.md``: one entry per check, each with a
status (pass, fail or skip), its figures, the issue's targets where the check has one (on
CUDA only: met or not; a missed target is a figure, not a failed path) and, for a failure,
the error. Every check is a function that records what it measured and never stops the
others: an exception is caught and recorded with the check.

The checks, in the order they run:

- ``environment``: torch, CUDA, the GPUs, NVML, the planner's table entry for the GPU.
- world A, started by ``meshrun launch`` on every GPU (``--nproc``; 2 Gloo ranks on CPU):
  ``nccl_init`` (backend, time from the launch to an initialised process group, one
  all-reduce checked), ``fsdp2_compile`` (the same GPT under ``parallel.zero = 3`` with
  bf16 parameters and ``parallel.compile``: tokens/s, MFU and step time from the run's own
  ``metrics.jsonl``, FSDP2's exposed communication from the sampled profiler),
  ``plan_vs_fsdp2`` (the planner's memory and time for that run against the measured
  peak and step time), ``nvml_metrics`` (``gpu_util_pct``, ``gpu_power_w``,
  ``gpu_mem_util_pct`` in the metrics, and NVML's used memory against torch's reserved),
  ``async_checkpoint`` (a sync ``run.save_checkpoint()`` against two async saves' blocked
  time: the call plus the wait before the next optimizer update; the first also allocates
  the stager's pinned CPU copy, the target is on the second).
- world B, started the same way with a small model: ``comm_timing`` (meshrun's
  ``CommTimer`` on DDP's all-reduce hook: CUDA events on CUDA), ``numerics_guard`` (a NaN
  loss forced at one step: every rank skips it and the weights do not change), then
  ``hang_watchdog`` (the last rank stops in user code: the watchdog must end the job with
  exit code 124 and a hang report well before the collective timeout).
- ``plan_vs_gpu``: ``benchmarks/plan_vs_gpu.py``'s 1B GPT on one device, with and without
  activation checkpointing: its ``predict`` (the planner) against its ``measure`` (peak
  allocated memory, median step time), in this process once the workers have ended.

No GPU was available where this script was written: the CUDA branches (NCCL, the CUDA memory
figures, CUDA events, NVML, ``torch.compile``, pinned-memory staging, the targets) sit behind
device checks and run only with ``--device cuda``. ``--device cpu --tiny`` runs every check on
Gloo with small sizes and no CUDA assertion (``torch.compile`` off: on CPU it needs a C++
compiler and minutes; MFU against a nominal 1e11 FLOP/s peak, which only exercises the path;
the planner compared with its H100 entry, a stand-in whose ratios mean nothing) and is the CI
smoke test (tests/e2e/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

import meshrun

sys.path.insert(0, str(Path(__file__).resolve().parent))  # plan_vs_gpu, also when imported
import plan_vs_gpu  # the 1B GPT, the planner's one-GPU prediction, its measure

CHECKS = (
    "environment",
    "plan_vs_gpu",
    "nccl_init",
    "fsdp2_compile",
    "plan_vs_fsdp2",
    "nvml_metrics",
    "async_checkpoint",
    "comm_timing",
    "numerics_guard",
    "hang_watchdog",
)
WORLD_A = ("nccl_init", "fsdp2_compile", "plan_vs_fsdp2", "nvml_metrics", "async_checkpoint")
WORLD_B = ("comm_timing", "numerics_guard")
CPU_PEAK_FLOPS = 1e11  # nominal, for the CPU smoke run's MFU path only
HANG_TIMEOUT_S = 5.0  # monitor.step_timeout_s of world B
NAN_STEP, HANG_STEP = 4, 7  # world B's forced NaN and forced hang (1-based optimizer steps)
ASYNC_SAVES = 2  # the first also allocates the stager's (pinned) CPU copy; the second reuses it
T0_ENV = "GPU_CHECK_T0"  # the launch's start (time.time()), for the workers' init time


# --- recording ---------------------------------------------------------------------------------


class Skip(Exception):
    """A check that does not apply here (the reason is recorded)."""


@dataclass
class Result:
    name: str
    status: str = "fail"
    figures: dict[str, float] = field(default_factory=dict)
    targets: dict[str, dict[str, Any]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0

    def figure(self, key: str, value: float | int | bool) -> float:
        self.figures[key] = float(value)
        return float(value)

    def target(self, key: str, value: float, op: str, bound: float, cuda: bool) -> None:
        """The issue's target for ``key``, recorded on CUDA only (on CPU it means nothing)."""
        if cuda:
            met = value >= bound if op == ">=" else value <= bound
            self.targets[key] = {"value": value, "op": op, "bound": bound, "met": met}


@contextlib.contextmanager
def checking(results: list[Result], name: str) -> Iterator[Result]:
    """Run the ``with`` body as check ``name``: pass unless it raises; never re-raises."""
    res = Result(name)
    t0 = time.perf_counter()
    try:
        yield res
        res.status = "pass"
    except Skip as s:
        res.status = "skip"
        res.notes.append(str(s))
    except (Exception, SystemExit) as e:  # recorded, and the next check runs
        res.status = "fail"
        tail = "".join(traceback.format_exception(type(e), e, e.__traceback__)[-3:])
        res.error = f"{type(e).__name__}: {e}\n{tail}"[-4000:]
    res.seconds = time.perf_counter() - t0
    results.append(res)


def require(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)


def finite(x: Any) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


# --- the parent: environment, plan_vs_gpu, the two worlds ------------------------------------


def check_environment(res: Result, a: argparse.Namespace) -> None:
    cuda = a.device == "cuda"
    res.notes.append(f"torch {torch.__version__}, python {sys.version.split()[0]}")
    res.figure("cuda_available", torch.cuda.is_available())
    if not cuda:
        res.notes.append("--device cpu: Gloo, no CUDA assertion")
        return
    require(torch.cuda.is_available(), "--device cuda but torch sees no CUDA device")
    res.figure("gpus", torch.cuda.device_count())
    res.notes.append(f"GPU 0: {torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}")
    res.notes.append(f"planner's table entry: {plan_vs_gpu.gpu_table_name(torch.device('cuda'))}")
    try:
        import pynvml

        pynvml.nvmlInit()
        res.notes.append(f"NVML driver {pynvml.nvmlSystemGetDriverVersion()}")
    except Exception as e:  # recorded; nvml_metrics says what it means
        res.notes.append(f"NVML not usable: {e}")


def check_plan_vs_gpu(res: Result, a: argparse.Namespace) -> None:
    device = torch.device(a.device, 0) if a.device == "cuda" else torch.device("cpu")
    cfg = plan_vs_gpu.gpt_1b(a.tiny)
    gpu = plan_vs_gpu.gpu_table_name(device)
    cuda = device.type == "cuda"
    for ac in (False, True):
        tag = "ac_full" if ac else "ac_none"
        pred_bytes, pred_s = plan_vs_gpu.predict(cfg, ac, a.micro_batch, gpu)
        steps, skip = (3, 1) if a.tiny else (6, 2)
        peak, step_s = plan_vs_gpu.measure(cfg, ac, a.micro_batch, steps, skip, device)
        res.figure(f"{tag}_pred_step_s", pred_s)
        res.figure(f"{tag}_step_s", step_s)
        res.target(f"{tag}_time_ratio", step_s / pred_s, "<=", 1.15, cuda)
        res.figure(f"{tag}_pred_gb", pred_bytes / 1e9)
        if cuda:  # the allocator's peak exists on CUDA only
            res.figure(f"{tag}_peak_gb", peak / 1e9)
            res.target(f"{tag}_memory_error", abs(peak / pred_bytes - 1), "<=", 0.05, cuda)
    if not cuda:
        res.notes.append(f"planner for {gpu} (a stand-in) against this CPU: ratios mean nothing")


def worker_command(a: argparse.Namespace, mode: str, run_dir: Path, extra: list[str]) -> list[str]:
    cuda = a.device == "cuda"
    common = [
        f"--job.run_dir={run_dir}",
        f"--job.device={a.device}",
        "--job.timeout_s=180",
        "--metrics.progress=false",
        "--metrics.log_every=1",
        *([] if cuda else [f"--metrics.peak_flops={CPU_PEAK_FLOPS}"]),
    ]
    return [
        *(sys.executable, "-m", "meshrun", "launch", "--nproc-per-node", str(a.nproc)),
        str(Path(__file__).resolve()),
        *("--worker", mode, "--device", a.device, "--micro-batch", str(a.micro_batch)),
        *("--steps", str(a.steps), *(["--tiny"] if a.tiny else [])),
        *common,
        *extra,
    ]


def launch(cmd: list[str], run_dir: Path, timeout_s: float) -> tuple[int, str, float]:
    """Run ``meshrun launch`` in its own process group; on a timeout end that group and the
    workers (torchrun starts each in a session of its own: they would outlive the group)."""
    env = {**os.environ, T0_ENV: repr(time.time())}
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its agent
        end_workers(run_dir)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # a worker not found still holds the pipe
            out = ""
        out += f"\n[gpu_check: killed after {timeout_s:.0f} s]"
    return proc.returncode, out, time.perf_counter() - t0


def end_workers(run_dir: Path) -> None:
    """SIGKILL the workers by the pid files they wrote, each checked to be this run's."""
    for f in (run_dir / "pids").glob("rank*"):
        with contextlib.suppress(ValueError, OSError):  # gone already
            pid = int(f.read_text())
            if str(run_dir) in Path(f"/proc/{pid}/cmdline").read_text(errors="replace"):
                os.kill(pid, signal.SIGKILL)


def write_pid(a: argparse.Namespace) -> None:
    """A worker's pid, for :func:`end_workers` (before anything that could hang)."""
    pids = Path(a.run_dir) / "pids"
    pids.mkdir(parents=True, exist_ok=True)
    (pids / f"rank{os.environ.get('RANK', '0')}").write_text(str(os.getpid()))


def collect(results: list[Result], names: tuple[str, ...], path: Path, rc: int, out: str) -> None:
    """The worker's results; a check the worker never reported fails with the launch's tail."""
    got = {r["name"]: r for r in json.loads(path.read_text())} if path.exists() else {}
    for name in names:
        if name in got:
            results.append(Result(**got[name]))
        else:
            results.append(
                Result(name, error=f"no result (meshrun launch exit {rc}):\n{out[-3000:]}")
            )


def world_a(results: list[Result], a: argparse.Namespace) -> None:
    cuda = a.device == "cuda"
    run_dir = a.out / "world_a"
    extra = [
        "--parallel.zero=3",
        "--parallel.param_dtype=bfloat16",
        f"--parallel.compile={str(cuda).lower()}",
        f"--data.micro_batch={a.micro_batch}",
        f"--optim.steps={a.steps + 2 * ASYNC_SAVES}",
        "--checkpoint.keep_last=1",
        "--checkpoint.async=true",
        "--checkpoint.resume=never",
        f"--monitor.comm_sample_every={max(2, a.steps // 2)}",
    ]
    cmd = worker_command(a, "train", run_dir, extra)
    rc, out, _ = launch(cmd, run_dir, 330 if cuda else 150)
    (a.out / "world_a.log").write_text(out)
    collect(results, WORLD_A, run_dir / "results.json", rc, out)


def world_b(results: list[Result], a: argparse.Namespace) -> None:
    cuda = a.device == "cuda"
    run_dir = a.out / "world_b"
    extra = [
        "--parallel.zero=0",
        "--data.micro_batch=8",
        f"--optim.steps={HANG_STEP + 5}",
        "--monitor.nonfinite=skip",
        f"--monitor.step_timeout_s={HANG_TIMEOUT_S}",
        "--checkpoint.resume=never",
    ]
    rc, out, _ = launch(worker_command(a, "health", run_dir, extra), run_dir, 90 if cuda else 150)
    ended = time.time()
    (a.out / "world_b.log").write_text(out)
    collect(results, WORLD_B, run_dir / "results.json", rc, out)
    with checking(results, "hang_watchdog") as res:
        check_hang(res, run_dir, rc, out, ended)


def check_hang(res: Result, run_dir: Path, rc: int, out: str, ended: float) -> None:
    stuck = run_dir / "hang_started"
    require(stuck.exists(), f"the forced hang never started (exit {rc}):\n{out[-2000:]}")
    res.figure("exit_code", rc)
    require(rc == 124, f"exit code {rc}, not the watchdog's 124:\n{out[-2000:]}")
    reports = sorted((run_dir / "hang").glob("rank*.txt"))
    res.figure("hang_reports", len(reports))
    require(bool(reports), "no RUN_DIR/hang/rank<R>.txt written")
    require("hang detected" in out, "the launcher's output does not report the hang")
    # From the stop to the launcher's exit: the watchdog's limit plus its dump and teardown.
    res.figure("hang_to_exit_s", ended - float(stuck.read_text()))
    res.figure("step_timeout_s", HANG_TIMEOUT_S)


# --- world A: NCCL, the 1B GPT under FSDP2 + compile, the planner, NVML, checkpoints ----------


def check_nccl(res: Result, run: Any, a: argparse.Namespace) -> None:
    import torch.distributed as dist

    t0 = float(os.environ.get(T0_ENV, "nan"))
    res.figure("launch_to_init_s", time.time() - t0)
    res.figure("world_size", run.world_size)
    res.notes.append(f"backend {run.backend}, device {run.device}")
    if a.device == "cuda":
        require(run.backend == "nccl", f"backend {run.backend}, expected nccl on CUDA")
        require(
            run.device.index == run.local_rank, f"rank on {run.device}, not cuda:{run.local_rank}"
        )
    ones = torch.ones(1024, device=run.device)
    t1 = time.perf_counter()
    dist.all_reduce(ones)
    total = float(ones[0].item())
    res.figure("first_all_reduce_s", time.perf_counter() - t1)
    require(total == run.world_size, f"all-reduce of ones gave {total}, not {run.world_size}")


@dataclass
class Trained:
    model: Any
    opt: Any
    loader: Any
    cfg: Any
    rows: list[dict[str, Any]]


def token_dataset(cfg: Any, n: int) -> Any:
    from torch.utils.data import TensorDataset

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (n, cfg.seq_len + 1), generator=gen)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def train_steps(run: Any, t: Trained, steps: int) -> None:
    """The user's loop."""
    for x, y in run.steps(t.loader, steps=run.step + steps):
        run.backward(t.model(x, y))
        run.optimizer_step(t.opt)


def async_save_round(run: Any, t: Trained) -> dict[str, float]:
    """Two steps with an async save after the first: blocked = the call + the wait for its
    copy of the state before the next update (what ``run.optimizer_step`` would wait)."""
    out: dict[str, float] = {}
    for x, y in run.steps(t.loader, steps=run.step + 2):
        run.backward(t.model(x, y))
        if "call_s" in out:
            t0 = time.perf_counter()
            run._parts.checkpointer.before_update()
            out["wait_s"] = time.perf_counter() - t0
        run.optimizer_step(t.opt)
        if "call_s" not in out:
            out["t0"] = t0 = time.perf_counter()
            run._parts.checkpointer.save_async()
            out["call_s"] = time.perf_counter() - t0
    run._parts.checkpointer.wait()  # committed (collective)
    out["durable_s"] = time.perf_counter() - out["t0"]
    require("wait_s" in out, "the async save was not followed by an update")
    return out


def metric_lines(run: Any) -> list[dict[str, Any]]:
    path = run.run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def metric_rows(run: Any) -> list[dict[str, Any]]:
    """The step rows (events left out)."""
    return [r for r in metric_lines(run) if "step" in r and "event" not in r]


def check_fsdp2(res: Result, run: Any, a: argparse.Namespace) -> Trained:
    from meshrun.demo.model import GPT
    from meshrun.demo.train import plan_flops_per_token

    cfg = plan_vs_gpu.gpt_1b(a.tiny)
    with torch.device("meta"):  # FSDP2 shards first, then each rank allocates its shards
        gpt = GPT(cfg)
    model = run.parallelize(gpt)
    opt = run.optimizer(model, torch.optim.AdamW, lr=1e-4)
    run.set_flops_per_token(plan_flops_per_token(cfg))
    samples = (a.steps + 2 * ASYNC_SAVES) * run.config.data.global_batch
    loader = run.dataloader(token_dataset(cfg, samples))
    t = Trained(model, opt, loader, cfg, [])
    run.resume(model, opt, loader)  # registers what the checkpoints save (fresh run: step 0)
    train_steps(run, t, a.steps)
    if run.is_main:
        t.rows = metric_rows(run)
        fsdp2_figures(res, t.rows, a)
    return t


def fsdp2_figures(res: Result, rows: list[dict[str, Any]], a: argparse.Namespace) -> None:
    steady = rows[min(3, len(rows) - 1) :]  # the first steps compile and warm up
    require(bool(steady), "no step rows in metrics.jsonl")

    def median(key: str) -> float | None:
        values = [r[key] for r in steady if finite(r.get(key))]
        return statistics.median(values) if values else None

    for key in ("step_time_s", "tokens_per_s", "tokens_per_s_per_rank", "mfu", "loss"):
        value = median(key)
        require(value is not None, f"metrics.jsonl has no {key}")
        res.figure(key, value)  # type: ignore[arg-type]
    res.target("mfu", res.figures["mfu"], ">=", 0.5, a.device == "cuda")
    for key in ("comm_exposed_s", "comm_s", "mem_peak_alloc_mb", "mem_reserved_mb"):
        if (value := median(key)) is not None:
            res.figure(key, value)
    res.figure("steps_measured", len(steady))


def check_plan_fsdp2(res: Result, run: Any, a: argparse.Namespace, t: Trained) -> None:
    if run.world_size != 1:
        raise Skip("plan_vs_gpu.predict is the one-GPU layout: compared on world 1 only")
    if not run.is_main:
        return
    gpu = plan_vs_gpu.gpu_table_name(run.device)
    pred_bytes, pred_s = plan_vs_gpu.predict(t.cfg, False, a.micro_batch, gpu)
    step_s = statistics.median(r["step_time_s"] for r in t.rows[3:] or t.rows)
    res.figure("pred_step_s", pred_s)
    res.figure("step_s", step_s)
    res.target("time_ratio", step_s / pred_s, "<=", 1.15, a.device == "cuda")
    res.figure("pred_gb", pred_bytes / 1e9)
    if a.device == "cuda":
        peak = torch.cuda.max_memory_allocated(run.device)
        res.figure("peak_gb", peak / 1e9)
        res.target("memory_error", abs(peak / pred_bytes - 1), "<=", 0.05, True)
    res.notes.append("measured under torch.compile (bf16 params, FSDP2), predicted uncompiled")


def check_nvml(res: Result, run: Any, a: argparse.Namespace, t: Trained) -> None:
    if run.device.type != "cuda":
        raise Skip("NVML figures exist on CUDA only")
    if not run.is_main:
        return
    if importlib.util.find_spec("pynvml") is None:
        raise AssertionError("nvidia-ml-py is not installed: pip install meshrun[nvml]")
    keys = ("gpu_util_pct", "gpu_mem_util_pct", "gpu_power_w", "gpu_sm_clock_mhz")
    for key in keys:
        values = [r[key] for r in t.rows if finite(r.get(key))]
        require(bool(values), f"metrics.jsonl has no {key}")
        res.figure(f"{key}_max", max(values))
    used = torch.cuda.device_memory_used(run.device)  # NVML's reading, by torch's device match
    reserved = torch.cuda.memory_reserved(run.device)
    res.figure("nvml_used_gb", used / 1e9)
    res.figure("torch_reserved_gb", reserved / 1e9)
    require(used >= reserved, "NVML reports less memory used than torch has reserved")
    require(res.figures["gpu_power_w_max"] > 0, "no power drawn")


def check_async_checkpoint(res: Result, run: Any, a: argparse.Namespace, t: Trained) -> None:
    t0 = time.perf_counter()
    run.save_checkpoint()
    sync_s = res.figure("sync_save_s", time.perf_counter() - t0)
    for i in range(1, ASYNC_SAVES + 1):
        r = async_save_round(run, t)
        res.figure(f"async{i}_call_s", r["call_s"])
        res.figure(f"async{i}_wait_before_update_s", r["wait_s"])
        res.figure(f"async{i}_durable_s", r["durable_s"])
        blocked = res.figure(f"async{i}_blocked_s", r["call_s"] + r["wait_s"])
    # The target on the last save: the first one also allocates the stager's CPU copy.
    res.target("blocked_over_sync", blocked / sync_s, "<=", 0.05, a.device == "cuda")
    saved = sorted(p.name for p in (run.run_dir / "checkpoints").iterdir())
    res.notes.append(f"checkpoints left (keep_last 1): {saved}")


def worker_train(a: argparse.Namespace) -> None:
    """World A. Rank 0 rewrites its results after each check: a launch ended on a timeout
    still leaves the checks done before it."""
    results: list[Result] = []
    path = Path(a.run_dir) / "results.json"
    run: Any = None
    with checking(results, "nccl_init") as res:
        run = meshrun.init()
        check_nccl(res, run, a)
    main = run is None or run.is_main
    if main:
        write_results(path, results)
    if run is None:
        return
    trained: Trained | None = None
    with checking(results, "fsdp2_compile") as res:
        trained = check_fsdp2(res, run, a)
    later = (
        ("plan_vs_fsdp2", check_plan_fsdp2),
        ("nvml_metrics", check_nvml),
        ("async_checkpoint", check_async_checkpoint),
    )
    for name, fn in later:
        with checking(results, name) as res:
            require(trained is not None, "not run: fsdp2_compile failed")
            fn(res, run, a, trained)
        if main:
            write_results(path, results)


def write_results(path: Path, results: list[Result]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([asdict(r) for r in results], indent=1))


# --- world B: CUDA-event comm timing, the numerics guard, the hang watchdog -------------------


def check_comm_timing(res: Result, run: Any) -> None:
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    from meshrun.monitor.comm import CommTimer

    cuda = run.device.type == "cuda"
    torch.manual_seed(0)
    layers = [nn.Linear(1024, 1024) for _ in range(8)]
    model = nn.Sequential(*layers).to(run.device)
    ddp = DDP(model, device_ids=[run.device.index] if cuda else None, bucket_cap_mb=1)
    timer = CommTimer(run.device)
    ddp.register_comm_hook(None, timer.wrap(default_hooks.allreduce_hook))
    x = torch.randn(64, 1024, device=run.device)
    figures: list[dict[str, float]] = []
    for _ in range(6):
        ddp(x).square().mean().backward()
        timer.backward_ends()
        if cuda:
            torch.cuda.synchronize(run.device)  # the events are read once they are done
        figures.append(timer.take())
    res.notes.append("CUDA events" if timer.cuda else "host clock (CPU)")
    require(timer.cuda == cuda, "CommTimer did not use CUDA events on CUDA")
    for key in ("comm_s", "comm_exposed_s", "comm_hidden_s"):
        values = [f[key] for f in figures[2:]]
        require(all(finite(v) for v in values), f"{key} not measured: {values}")
        res.figure(key, statistics.median(values))
    require(res.figures["comm_s"] > 0, "no communication time measured")


def check_guard(res: Result, run: Any) -> tuple[Any, Any, Any]:
    """A NaN loss on every rank at NAN_STEP: the step is skipped everywhere, weights kept."""
    from torch import nn
    from torch.utils.data import TensorDataset

    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(4096, 16, generator=gen), torch.randn(4096, 1, generator=gen))
    model = run.parallelize(nn.Linear(16, 1).to(run.device))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = run.dataloader(data)
    # Up to HANG_STEP - 2: the hang comes at the second step of the next run.steps() call,
    # since the first step of each call is allowed the longer monitor.phase_timeout_s.
    for x, y in run.steps(loader, steps=HANG_STEP - 2):
        loss = nn.functional.mse_loss(model(x), y)
        nan_step = run.step + 1 == NAN_STEP
        if nan_step:
            loss = loss * float("nan")
            before = [p.detach().clone() for p in model.parameters()]
        run.backward(loss)
        run.optimizer_step(opt)
        if nan_step:
            same = all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
            res.figure("weights_unchanged_by_skipped_step", same)
    require(
        res.figures.get("weights_unchanged_by_skipped_step") == 1.0, "the NaN step changed weights"
    )
    if run.is_main:
        guard_figures(res, run)
    return model, opt, loader


def guard_figures(res: Result, run: Any) -> None:
    events = [r for r in metric_lines(run) if r.get("event") == "nonfinite"]
    res.figure("nonfinite_events", len(events))
    require(len(events) == 1, f"expected one nonfinite event, got {events}")
    require(events[0].get("step") == NAN_STEP, f"nonfinite event at another step: {events}")
    require(events[0].get("action") == "skip", f"the guard did not skip: {events}")
    rows = metric_rows(run)
    bad = [r["step"] for r in rows if not finite(r.get("loss"))]
    require(bad == [NAN_STEP], f"steps with a non-finite loss: {bad}")
    res.figure("loss_after", rows[-1]["loss"])


def force_hang(run: Any, model: Any, opt: Any, loader: Any) -> None:
    """The last rank stops in its own code at HANG_STEP: the watchdog must end the job."""
    from torch import nn

    for x, y in run.steps(loader):
        if run.step + 1 == HANG_STEP and run.rank == run.world_size - 1:
            (run.run_dir / "hang_started").write_text(repr(time.time()))
            time.sleep(600)
        run.backward(nn.functional.mse_loss(model(x), y))
        run.optimizer_step(opt)


def worker_health(a: argparse.Namespace) -> None:
    """World B; ends with the forced hang."""
    run = meshrun.init()
    results: list[Result] = []
    with checking(results, "comm_timing") as res:
        check_comm_timing(res, run)
    held: tuple[Any, Any, Any] | None = None
    with checking(results, "numerics_guard") as res:
        held = check_guard(res, run)
    if run.is_main:
        write_results(run.run_dir / "results.json", results)
    if held is not None:
        force_hang(run, *held)  # ends the job: the parent checks how


# --- report ------------------------------------------------------------------------------------


def markdown(results: list[Result], a: argparse.Namespace, total_s: float) -> str:
    lines = [
        f"# gpu_check: {a.device}{' --tiny' if a.tiny else ''}, {a.nproc} process(es), "
        f"{total_s:.0f} s",
        "",
        "| check | status | figures | targets |",
        "|---|---|---|---|",
    ]
    for r in results:
        figs = ", ".join(f"{k} {v:.4g}" for k, v in r.figures.items())
        tgts = ", ".join(
            f"{k} {t['value']:.3g} {t['op']} {t['bound']:g}: {'met' if t['met'] else 'MISSED'}"
            for k, t in r.targets.items()
        )
        lines.append(f"| {r.name} | {r.status} | {figs} | {tgts} |")
    for r in results:
        if r.error or r.notes:
            lines += ["", f"## {r.name} ({r.status})", *(f"- {n}" for n in r.notes)]
            if r.error:
                lines += ["", "```", r.error.strip(), "```"]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="small sizes (the CPU smoke run)")
    p.add_argument("--out", type=Path, default=Path("gpu_check_out"))
    p.add_argument("--nproc", type=int, default=0, help="0 = every GPU (2 on CPU)")
    p.add_argument("--steps", type=int, default=0, help="0 = 20 (6 with --tiny)")
    p.add_argument("--micro-batch", type=int, default=0, help="0 = 8 (2 with --tiny)")
    p.add_argument("--worker", choices=("train", "health"), help=argparse.SUPPRESS)
    p.add_argument("--job.run_dir", dest="run_dir", help=argparse.SUPPRESS)  # a worker's own
    a, _ = p.parse_known_args(argv)  # under --worker, meshrun.init() took its own overrides
    if not a.nproc:
        a.nproc = torch.cuda.device_count() if a.device == "cuda" else 2
    a.steps = a.steps or (6 if a.tiny else 20)
    a.micro_batch = a.micro_batch or (2 if a.tiny else 8)
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.worker:
        write_pid(a)
        # The user's entry point: tracebacks reach the launcher's summary, the run is closed.
        meshrun.main(worker_train if a.worker == "train" else worker_health)(a)
    a.out = a.out.resolve()
    for old in ("world_a", "world_b"):  # this script's own output of an earlier run
        shutil.rmtree(a.out / old, ignore_errors=True)
    a.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    results: list[Result] = []
    with checking(results, "environment") as res:
        check_environment(res, a)
    world_a(results, a)
    world_b(results, a)
    # Last: this process allocates on the GPU only once the workers are done with it.
    with checking(results, "plan_vs_gpu") as res:
        check_plan_vs_gpu(res, a)
    total = time.perf_counter() - t0
    order = {name: i for i, name in enumerate(CHECKS)}
    results.sort(key=lambda r: order.get(r.name, len(order)))
    doc = {
        "device": a.device,
        "tiny": a.tiny,
        "nproc": a.nproc,
        "seconds": total,
        "checks": [asdict(r) for r in results],
    }
    (a.out / "gpu_check.json").write_text(json.dumps(doc, indent=1))
    (a.out / "gpu_check.md").write_text(markdown(results, a, total))
    for r in results:
        print(
            f"{r.name:18} {r.status:5} {r.seconds:6.1f} s  {r.error.splitlines()[0] if r.error else ''}"
        )
    print(f"wrote {a.out / 'gpu_check.json'} and gpu_check.md in {total:.0f} s")
    return 0 if all(r.status != "fail" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
