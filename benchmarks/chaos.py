"""Chaos benchmark: N runs of the demo under ``meshrun launch --max-restarts``, one fault each.

    .venv/bin/python benchmarks/chaos.py [--n 10] [--seed 0] [--faults kill,stop,...]
        [--configs ddp2,zero3_2,ddp4,zero3_4] [--steps 24] [--interval 4] [--json OUT]

Every run trains the tiny demo GPT (``meshrun launch -m meshrun.demo --size tiny``, a
checkpoint every ``--interval`` steps) on 2 or 4 Gloo workers, DDP or ZeRO-3 (DDP on 4 with
``parallel.find_unused_parameters = true``, see ``command``), and suffers one
fault at a seeded random moment. The moment is found by watching the run (metrics.jsonl for
steps, inotify on the checkpoint directory for saves and resumes, /proc for the workers),
never by sleeping on a guess:

- ``kill_step``: SIGKILL of a random worker during a step;
- ``kill_save``: SIGKILL of a random worker inside a save (after the j-th file of the
  ``step_N.tmp`` directory is closed);
- ``kill_resume``: SIGKILL of a worker at a random step, then SIGKILL of a worker of the
  restarted group while it reads the checkpoint it resumes from (the n-th file opened);
- ``kill_agent``: SIGKILL of the launcher's whole process group (the torchrun agent), as a
  lost node would see it; torch starts each worker in its own session, so it is the
  launcher's guard (launch/agent/orphans.py) that ends them: the benchmark reports how long that
  took and kills any still running after 30 s; then the same command is run again;
- ``stop``: SIGSTOP of a random worker, left stopped: the hang watchdog
  (``monitor.step_timeout_s``) of the others must end the group, the agent restarts it;
- ``disk_full``: the checkpoint directory is a small tmpfs, sized so that a save fails
  partway; once the failed group has exited the tmpfs is enlarged (space freed by an
  operator) and the agent's restart must carry on;
- ``corrupt``: the run finishes, then one file of its newest checkpoint is truncated or has a
  byte flipped, and the same command is run again: it must skip that checkpoint, resume the
  previous one and redo the steps.

Each run is checked against an uninterrupted reference run of the same configuration (run
once per configuration): every logged step's loss (replays included) and every tensor of the
final checkpoint (model and optimizer, read with DCP's own reader) bitwise equal; the run
finished (by itself, or by the rerun); no checkpoint lost (the newest valid checkpoint before
the fault still verifies and is the one resumed; every checkpoint left at the end verifies);
and the recovery time, from the fault to the first step completed by the next worker group.
Prints one line per run, a tally per fault kind and a final line; exits 1 if any run failed.
Needs Linux (/proc, inotify) and, for ``disk_full``, root (``mount -t tmpfs``).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import math
import os
import random
import re
import select
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

import meshrun.demo
from meshrun.checkpoint import on_disk
from meshrun.checkpoint.export.dcp import tensor_table
from meshrun.launch.hostfile.guard import descendants

FAULTS = ("kill_step", "kill_save", "kill_resume", "kill_agent", "stop", "disk_full", "corrupt")
ALIASES = {"kill": ("kill_step", "kill_save", "kill_resume"), "all": FAULTS}
CONFIGS = {"ddp2": (2, 0), "zero3_2": (2, 3), "ddp4": (4, 0), "zero3_4": (4, 3)}
DEMO_CONFIG = Path(meshrun.demo.__file__).with_name("demo.toml")
RESUMED_RE = re.compile(r"resumed from (\S+) \(step (\d+)")

# inotify(7) event bits
IN_CLOSE_WRITE, IN_OPEN, IN_MOVED_FROM, IN_CREATE = 0x8, 0x20, 0x40, 0x100
_PR_SET_CHILD_SUBREAPER = 36


@dataclass(frozen=True)
class Settings:
    steps: int
    interval: int
    step_timeout_s: float
    max_restarts: int
    timeout_s: float
    root: Path


class FaultMissed(RuntimeError):
    """The run ended (or stalled) before the fault could be injected at its moment."""


# --- watching a run ------------------------------------------------------------------------


class Inotify:
    """A minimal inotify(7) reader (ctypes): wakes on checkpoint files as they appear, close
    and are opened, without polling the directory from a 2-core machine's spare CPU."""

    def __init__(self) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        self.paths: dict[int, Path] = {}

    def watch(self, path: Path, mask: int) -> None:
        wd = self._libc.inotify_add_watch(self.fd, str(path).encode(), mask)
        if wd >= 0:  # the directory may already be gone (renamed, deleted): nothing to see
            self.paths[wd] = path

    def events(self, timeout: float) -> list[tuple[Path, int, str]]:
        """(watched directory, mask, file name) of the events within ``timeout`` seconds."""
        if not select.select([self.fd], [], [], timeout)[0]:
            return []
        try:
            data = os.read(self.fd, 1 << 16)
        except BlockingIOError:
            return []
        out, pos = [], 0
        while pos < len(data):
            wd, mask, _cookie, size = struct.unpack_from("iIII", data, pos)
            name = data[pos + 16 : pos + 16 + size].rstrip(b"\0").decode()
            pos += 16 + size
            if wd in self.paths:
                out.append((self.paths[wd], mask, name))
        return out

    def close(self) -> None:
        os.close(self.fd)


def read_records(path: Path) -> list[dict[str, Any]]:
    """Every JSON record of a metrics.jsonl (a partly written last line is left out)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def is_step(r: dict[str, Any]) -> bool:
    return "step" in r and "event" not in r  # not the straggler check's {"event": "ranks"}


def count_steps(path: Path) -> int:
    if not path.exists():
        return 0
    return sum(line.startswith('{"step"') for line in path.read_text().splitlines())


def _env(pid: int) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return []


def _ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def alive(pid: int) -> bool:
    """Running or stopped, not a zombie (an orphan's zombie waits for its reaper)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def workers(launcher: int) -> dict[int, int]:
    """``{pid: local rank}`` of the torchrun workers below ``launcher`` (processes that the
    agent gave a LOCAL_RANK; their own children, e.g. loader workers, inherit it: left out)."""
    found: dict[int, int] = {}
    below = descendants(launcher)
    for pid in below:
        rank = [e for e in _env(pid) if e.startswith(b"LOCAL_RANK=")]
        if rank and alive(pid):
            found[pid] = int(rank[0].split(b"=", 1)[1])
    return {p: r for p, r in found.items() if _ppid(p) not in found}


def _reap(pids: list[int]) -> None:
    """Orphaned workers are re-parented to us (subreaper): collect their exit status."""
    for pid in pids:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)


def _kill(pids: list[int], sig: int = signal.SIGKILL) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


# --- one run --------------------------------------------------------------------------------


@dataclass
class Reference:
    losses: dict[int, float]
    tensors: dict[str, torch.Tensor]
    ckpt_bytes: int  # one checkpoint, page-rounded as tmpfs counts it


@dataclass
class Run:
    index: int
    fault: str
    config: str
    seed: str
    run_dir: Path
    argv: list[str]
    s: Settings
    rng: random.Random
    proc: subprocess.Popen[bytes] | None = None
    logs: list[Path] = field(default_factory=list)
    exit_codes: list[int] = field(default_factory=list)
    seen_workers: set[int] = field(default_factory=set)
    fault_time: float | None = None
    what: str = ""
    phase_hit: bool = True
    newest_before: int | None = None
    lost: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # per-fault figures for the tally
    tmpfs: bool = False

    @property
    def ckpt_dir(self) -> Path:
        return self.run_dir / "ckpt"

    @property
    def metrics(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    @property
    def nproc(self) -> int:
        return CONFIGS[self.config][0]

    def start(self) -> None:
        log = self.run_dir / f"launcher{len(self.logs) or ''}.log"
        self.logs.append(log)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        with open(log, "wb") as out:
            # Its own process group: kill_agent kills that group, as a lost node would.
            self.proc = subprocess.Popen(
                self.argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def workers(self) -> dict[int, int]:
        assert self.proc is not None
        found = workers(self.proc.pid)
        self.seen_workers |= set(found)
        return found

    def wait_exit(self, deadline: float) -> int | None:
        """The launcher's exit code, or None if it is still running at ``deadline``."""
        assert self.proc is not None
        try:
            code = self.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return None
        self.exit_codes.append(code)
        return code

    def mark_fault(self, what: str) -> None:
        self.fault_time = time.time()
        self.what = what

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def command(config: str, s: Settings, run_dir: Path) -> list[str]:
    nproc, zero = CONFIGS[config]
    argv = [sys.executable, "-m", "meshrun", "launch", "--nproc-per-node", str(nproc)]
    argv += ["--config", str(DEMO_CONFIG), "--max-restarts", str(s.max_restarts)]
    argv += ["-m", "meshrun.demo", "--size", "tiny", "--corpus-bytes", "300000"]
    argv += [f"--job.run_dir={run_dir}", f"--optim.steps={s.steps}"]
    argv += [f"--checkpoint.interval={s.interval}", f"--checkpoint.dir={run_dir / 'ckpt'}"]
    argv += ["--metrics.progress=false", "--job.timeout_s=30"]  # a lost peer: seconds, not 30 min
    argv += [f"--monitor.step_timeout_s={s.step_timeout_s}"]
    if zero:
        argv += [f"--parallel.zero={zero}"]
    elif nproc > 2:
        # DDP's default rebuilds its buckets after a process's first step, which on more than
        # 2 ranks changes the summation order of the step after a resume (a difference of
        # float rounding, named in the resume line); this keeps one layout, so replays are
        # bitwise (docs/checkpoint.md, benchmarks/ddp_first_step.py).
        argv += ["--parallel.find_unused_parameters=true"]
    return argv


def wait_steps(run: Run, k: int, deadline: float) -> None:
    """Until ``k`` steps are logged (10 ms polls of the file's size)."""
    while count_steps(run.metrics) < k:
        if not run.running() or time.monotonic() > deadline:
            raise FaultMissed(f"the run ended or stalled before step {k} was logged")
        time.sleep(0.01)


def random_worker(run: Run, deadline: float) -> tuple[int, int]:
    while True:
        found = run.workers()
        if len(found) == run.nproc:
            pid = run.rng.choice(sorted(found))
            return pid, found[pid]
        if not run.running() or time.monotonic() > deadline:
            raise FaultMissed(f"no worker group of {run.nproc} to pick a victim from")
        time.sleep(0.02)


def note_checkpoints(run: Run, exclude: int | None = None) -> None:
    """Right after the fault: the newest committed checkpoint that verifies (checksums
    included); any committed one newer than it that does not is a checkpoint lost."""
    run.newest_before = None
    for info in reversed(on_disk.list_checkpoints(run.ckpt_dir)):
        if info.step == exclude:
            continue
        bad = on_disk.problems(info.path)
        if not bad:
            run.newest_before = info.step
            return
        run.lost.append(f"{info.path.name} invalid right after the fault: {'; '.join(bad)}")


# --- the faults -----------------------------------------------------------------------------


def _kill_at_random_step(run: Run, deadline: float, lo: int = 1) -> str:
    k = run.rng.randint(lo, run.s.steps - 2)
    wait_steps(run, k, deadline)
    time.sleep(run.rng.uniform(0.0, 0.08))  # somewhere inside the next step
    pid, rank = random_worker(run, deadline)
    os.kill(pid, signal.SIGKILL)
    return f"SIGKILL local rank {rank} after step {k}"


def fault_kill_step(run: Run, deadline: float) -> None:
    run.mark_fault(_kill_at_random_step(run, deadline))
    note_checkpoints(run)


def fault_kill_save(run: Run, deadline: float) -> None:
    step = run.rng.choice(range(run.s.interval, run.s.steps + 1, run.s.interval))
    closes = run.rng.randint(0, 4)
    tmp = on_disk.tmp_dir(run.ckpt_dir, step)
    ino = Inotify()
    try:
        run.ckpt_dir.mkdir(parents=True, exist_ok=True)
        ino.watch(run.ckpt_dir, IN_CREATE | IN_MOVED_FROM)
        _wait_event(run, ino, deadline, lambda d, m, n: n == tmp.name and bool(m & IN_CREATE))
        ino.watch(tmp, IN_CLOSE_WRITE)
        seen = 0
        while seen < closes:
            evs = ino.events(0.5)
            seen += sum(bool(m & IN_CLOSE_WRITE) and d == tmp for d, m, _ in evs)
            if any(m & IN_MOVED_FROM and n == tmp.name for _, m, n in evs) or not run.running():
                break
        pid, rank = random_worker(run, deadline)
        run.phase_hit = tmp.exists()
        os.kill(pid, signal.SIGKILL)
    finally:
        ino.close()
    where = "inside" if run.phase_hit else "just after (missed the save window)"
    run.mark_fault(
        f"SIGKILL local rank {rank} {where} the save of step {step}, {seen} file(s) closed"
    )
    note_checkpoints(run)


def _wait_event(
    run: Run, ino: Inotify, deadline: float, match: Callable[[Path, int, str], bool]
) -> None:
    while not any(match(*e) for e in ino.events(0.2)):
        if not run.running() or time.monotonic() > deadline:
            raise FaultMissed("the run ended or stalled before the awaited checkpoint event")


def fault_kill_resume(run: Run, deadline: float) -> None:
    first = _kill_at_random_step(run, deadline, lo=run.s.interval + 1)
    old = set(run.seen_workers)
    while not (set(run.workers()) - old and len(run.workers()) == run.nproc):
        if not run.running() or time.monotonic() > deadline:
            raise FaultMissed("no restarted worker group appeared after the first kill")
        time.sleep(0.02)
    ino = Inotify()
    opens, target = 0, run.rng.randint(1, 10)
    try:
        for info in on_disk.list_checkpoints(run.ckpt_dir):
            ino.watch(info.path, IN_OPEN)
        while opens < target and time.monotonic() < deadline and run.running():
            # The new workers import torch for seconds before they read the checkpoint; once
            # they have begun, a pause of 2 s means the resume is over: kill now, say so.
            evs = ino.events(2.0 if opens else 1.0)
            if not evs and opens:
                break
            opens += sum(bool(m & IN_OPEN) for _, m, _ in evs)
        pid, rank = random_worker(run, deadline)
        os.kill(pid, signal.SIGKILL)
    finally:
        ino.close()
    run.phase_hit = opens >= target
    run.mark_fault(
        f"{first}; then SIGKILL local rank {rank} of the restarted group while it resumed "
        f"({opens} checkpoint file opening(s) seen{'' if run.phase_hit else ', fewer than aimed'})"
    )
    note_checkpoints(run)


def fault_kill_agent(run: Run, deadline: float) -> None:
    k = run.rng.randint(1, run.s.steps - 2)
    wait_steps(run, k, deadline)
    time.sleep(run.rng.uniform(0.0, 0.08))
    pids = list(run.workers())
    assert run.proc is not None
    os.killpg(run.proc.pid, signal.SIGKILL)
    run.mark_fault(f"SIGKILL of the agent's process group after step {k}")
    run.exit_codes.append(run.proc.wait())
    # meshrun launch's guard (launch/agent/orphans.py) ends the job's processes when its launcher is
    # SIGKILLed: SIGTERM (a meshrun worker saves its preemption checkpoint), SIGKILL 10 s
    # later. Measured here: how long the workers lasted, and any still running after 30 s.
    killed_at = time.monotonic()
    while any(alive(p) for p in pids) and time.monotonic() - killed_at < 30:
        _reap(pids)
        time.sleep(0.05)
    run.extra["guard_ended_s"] = round(time.monotonic() - killed_at, 2)
    left = [p for p in pids if alive(p)]
    run.extra["outlived_agent"] = [len(left), len(pids)]
    if left:
        run.notes.append(
            f"{len(left)}/{len(pids)} workers still alive 30 s after the agent's process group "
            "was SIGKILLed (the launcher's guard did not end them); the benchmark killed them"
        )
    _kill(left)
    while any(alive(p) for p in left):
        _reap(left)
        time.sleep(0.02)
    note_checkpoints(run)
    run.start()  # the same command again, as a scheduler would on a new node


def fault_stop(run: Run, deadline: float) -> None:
    k = run.rng.randint(1, run.s.steps - 2)
    wait_steps(run, k, deadline)
    time.sleep(run.rng.uniform(0.0, 0.08))
    pid, rank = random_worker(run, deadline)
    os.kill(pid, signal.SIGSTOP)
    saving = sorted(p.name for p in run.ckpt_dir.glob("step_*.tmp"))
    during = f", during the save {saving[0]}" if saving else ""
    run.mark_fault(f"SIGSTOP local rank {rank} after step {k} (left stopped{during})")
    note_checkpoints(run)
    while alive(pid) and run.running() and time.monotonic() < deadline:
        time.sleep(0.05)
    if alive(pid):
        run.failures.append(f"the stopped worker (pid {pid}) was still there when the run ended")
        _kill([pid])
    else:
        assert run.fault_time is not None
        run.extra["stopped_ended_s"] = time.time() - run.fault_time
        run.notes.append(f"stopped worker ended {run.extra['stopped_ended_s']:.1f} s after SIGSTOP")


def tmpfs_size(run: Run, ref: Reference) -> tuple[int, int]:
    """(saves that fit, tmpfs bytes): m whole checkpoints and a fraction of the next."""
    saves = run.s.steps // run.s.interval
    m = run.rng.randint(1, max(1, min(3, saves - 1)))
    size = m * ref.ckpt_bytes + int(run.rng.uniform(0.2, 0.8) * ref.ckpt_bytes)
    return m, size


def fault_disk_full(run: Run, deadline: float, fits: int) -> None:
    step = (fits + 1) * run.s.interval
    ino = Inotify()
    try:
        ino.watch(run.ckpt_dir, IN_CREATE)
        tmp = on_disk.tmp_dir(run.ckpt_dir, step).name
        _wait_event(run, ino, deadline, lambda d, m, n: n == tmp)
    finally:
        ino.close()
    run.mark_fault(f"disk full ({fits} checkpoint(s) fit) in the save of step {step}")
    note_checkpoints(run)
    first = set(run.workers())
    t0 = time.monotonic()
    while any(alive(p) for p in first) and time.monotonic() - t0 < 60:
        time.sleep(0.02)
    if any(alive(p) for p in first):
        run.failures.append("the save on a full disk did not end the worker group in 60 s")
    subprocess.run(["mount", "-o", "remount,size=256m", str(run.ckpt_dir)], check=True)
    run.notes.append(f"group ended {time.monotonic() - t0:.1f} s after the save began; space freed")


def fault_corrupt(run: Run, deadline: float) -> None:
    code = run.wait_exit(deadline)
    if code != 0:
        raise FaultMissed(f"the run before the corruption ended with exit code {code}")
    newest = on_disk.list_checkpoints(run.ckpt_dir)[-1]
    victim = run.rng.choice(sorted(p for p in newest.path.iterdir() if p.is_file()))
    data = victim.read_bytes()
    if run.rng.random() < 0.5 or len(data) < 2:
        victim.write_bytes(data[: run.rng.randrange(len(data))])
        how = f"truncated to {len(victim.read_bytes())} of {len(data)} bytes"
    else:
        at = run.rng.randrange(len(data))
        victim.write_bytes(data[:at] + bytes([data[at] ^ 0x40]) + data[at + 1 :])
        how = f"byte {at} flipped"
    run.mark_fault(f"{newest.path.name}/{victim.name} {how}, then the same command again")
    if not on_disk.problems(newest.path):
        run.failures.append(f"`meshrun ckpt verify` does not see the damage ({victim.name} {how})")
    note_checkpoints(run, exclude=newest.step)
    run.start()


# --- checks ---------------------------------------------------------------------------------


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, full size, through DCP's own reader (nothing unpickled
    but DCP's metadata)."""
    sd = {i.name: torch.empty(i.shape, dtype=i.dtype) for i in tensor_table(path)}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(sd, checkpoint_id=str(path))
    return sd


def check_losses(run: Run, ref: Reference) -> list[str]:
    steps = [r for r in read_records(run.metrics) if is_step(r)]
    bad = [r for r in steps if r["loss"] != ref.losses.get(r["step"])]
    missing = sorted(set(ref.losses) - {r["step"] for r in steps})
    out = []
    if bad:
        r = bad[0]
        out.append(
            f"{len(bad)} of {len(steps)} logged losses differ, first at step {r['step']}: "
            f"{r['loss']!r} vs {ref.losses.get(r['step'])!r}"
        )
    if missing:
        out.append(f"steps never logged: {missing[:5]}{'...' if len(missing) > 5 else ''}")
    return out


def check_tensors(run: Run, ref: Reference) -> list[str]:
    final = on_disk.step_dir(run.ckpt_dir, run.s.steps)
    bad = on_disk.problems(final)
    if bad:
        return [f"final checkpoint: {'; '.join(bad)}"]
    got = load_tensors(final)
    if got.keys() != ref.tensors.keys():
        return [
            f"final checkpoint holds other tensors: {sorted(got.keys() ^ ref.tensors.keys())[:3]}"
        ]
    differ = [k for k in got if not torch.equal(got[k], ref.tensors[k])]
    return [f"{len(differ)} final tensors differ, e.g. {differ[:3]}"] if differ else []


def check_checkpoints(run: Run) -> None:
    """Every checkpoint left verifies; the resume after the fault took the newest valid one."""
    for info in on_disk.list_checkpoints(run.ckpt_dir):
        bad = on_disk.problems(info.path)
        if bad:
            run.lost.append(f"{info.path.name} invalid at the end: {'; '.join(bad)}")
    if run.newest_before is None:
        return
    resumed = [int(m.group(2)) for log in run.logs for m in RESUMED_RE.finditer(log.read_text())]
    if not resumed:
        run.lost.append(f"no resume after the fault: step {run.newest_before}'s checkpoint unused")
    elif resumed[-1] < run.newest_before:
        run.lost.append(
            f"resumed step {resumed[-1]}, but step {run.newest_before}'s checkpoint was valid"
        )


def recovery_s(run: Run) -> float | None:
    """Fault -> first step completed by the next worker group (its 'start' record)."""
    if run.fault_time is None:
        return None
    started = False
    for r in read_records(run.metrics):
        if r.get("time", 0) <= run.fault_time:
            continue
        started = started or r.get("event") == "start"
        if started and is_step(r):
            return float(r["time"]) - run.fault_time
    return None


# --- driver ---------------------------------------------------------------------------------


def inject(run: Run, ref: Reference, deadline: float) -> None:
    if run.fault == "disk_full":
        fits, size = tmpfs_size(run, ref)
        run.notes.append(f"tmpfs of {size / 1e6:.2f} MB ({ref.ckpt_bytes / 1e6:.2f} MB a save)")
        mount_tmpfs(run, size)
        run.start()
        fault_disk_full(run, deadline, fits)
        return
    run.start()
    FAULT_FNS[run.fault](run, deadline)


FAULT_FNS: dict[str, Callable[[Run, float], None]] = {
    "kill_step": fault_kill_step,
    "kill_save": fault_kill_save,
    "kill_resume": fault_kill_resume,
    "kill_agent": fault_kill_agent,
    "stop": fault_stop,
    "corrupt": fault_corrupt,
}


def mount_tmpfs(run: Run, size: int) -> None:
    run.ckpt_dir.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(run.ckpt_dir)],
        check=True,
        capture_output=True,
    )
    run.tmpfs = True


def cleanup(run: Run) -> None:
    """Kill what this run left behind (reported), unmount its tmpfs."""
    below = descendants(os.getpid())
    stray = [p for p in run.seen_workers if alive(p)]
    if stray:
        run.failures.append(f"{len(stray)} worker(s) still alive after the run: {stray}")
    _kill(list(set(below) | set(stray)), signal.SIGCONT)
    _kill(list(set(below) | set(stray)))
    _reap(list(set(below) | set(stray)))
    if run.tmpfs:
        time.sleep(0.2)
        done = subprocess.run(["umount", str(run.ckpt_dir)], capture_output=True)
        if done.returncode:
            subprocess.run(["umount", "-l", str(run.ckpt_dir)], capture_output=True)


def one_run(run: Run, ref: Reference) -> dict[str, Any]:
    deadline = time.monotonic() + run.s.timeout_s
    run.run_dir.mkdir(parents=True, exist_ok=True)
    try:
        try:
            inject(run, ref, deadline)
        except FaultMissed as e:
            run.failures.append(f"fault not injected: {e}")
        except (OSError, subprocess.CalledProcessError) as e:  # e.g. mount refused
            run.failures.append(f"benchmark error while injecting the fault: {e!r}")
        if len(run.exit_codes) < len(run.logs) and run.wait_exit(deadline) is None:
            run.failures.append(f"did not finish within {run.s.timeout_s:.0f} s")
        result = evaluate(run, ref)
    finally:
        cleanup(run)
    result["failures"] = run.failures  # cleanup may add one
    result["passed"] = result["passed"] and not run.failures
    return result


def evaluate(run: Run, ref: Reference) -> dict[str, Any]:
    losses = check_losses(run, ref)
    tensors = check_tensors(run, ref)
    check_checkpoints(run)
    finished = bool(run.exit_codes) and run.exit_codes[-1] == 0 and not run.running()
    if not finished:
        run.failures.append(f"did not finish: launcher exit codes {run.exit_codes}")
    bitwise = not losses and not tensors
    run.failures += losses + tensors + run.lost
    text = " ".join(log.read_text(errors="replace") for log in run.logs)
    if run.fault == "disk_full" and "No space left" not in text and "disk full" not in text:
        run.failures.append("the failed save's error does not say the disk is full")
    return {
        "index": run.index,
        "fault": run.fault,
        "config": run.config,
        "seed": run.seed,
        "what": run.what,
        "phase_hit": run.phase_hit,
        "bitwise": bitwise,
        "finished": finished,
        "lost": len(run.lost),
        "recovery_s": recovery_s(run),
        "group_starts": sum(r.get("event") == "start" for r in read_records(run.metrics)),
        "exit_codes": run.exit_codes,
        "notes": run.notes,
        **run.extra,
        "passed": bitwise and finished and not run.lost,
        "run_dir": str(run.run_dir),
    }


def reference(config: str, s: Settings) -> Reference:
    run_dir = s.root / f"reference_{config}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    argv = command(config, s, run_dir)
    with open(run_dir / "launcher.log", "wb") as out:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        code = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, env=env).returncode
    if code != 0:
        tail = (run_dir / "launcher.log").read_text(errors="replace")[-3000:]
        raise SystemExit(f"reference run {config} failed (exit {code}):\n{tail}")
    final = on_disk.step_dir(run_dir / "ckpt", s.steps)
    losses = {r["step"]: r["loss"] for r in read_records(run_dir / "metrics.jsonl") if is_step(r)}
    pages = sum(math.ceil(p.stat().st_size / 4096) * 4096 for p in final.iterdir())
    return Reference(losses, load_tensors(final), pages)


def plan(n: int, faults: list[str], configs: list[str]) -> list[tuple[str, str]]:
    """Run i: fault i mod F; its configuration turns by one each round, so F x C runs cover
    every (fault, configuration) pair."""
    return [
        (faults[i % len(faults)], configs[(i % len(faults) + i // len(faults)) % len(configs)])
        for i in range(n)
    ]


def tally(results: list[dict[str, Any]], faults: list[str]) -> list[str]:
    """Per fault kind (and all): runs, passed, bitwise, finished, checkpoints lost, in phase,
    median recovery."""
    widths = (12, 6, 8, 9, 10, 12, 10, 17)
    names = ("fault", "runs", "passed", "bitwise", "finished", "ckpts lost", "in phase")
    rows = [_row((*names, "recovery median"), widths)]
    for name in [*faults, "all"]:
        rs = [r for r in results if name in ("all", r["fault"])]
        if not rs:
            continue
        rec = [r["recovery_s"] for r in rs if r["recovery_s"] is not None]
        n = len(rs)
        cells = [name, str(n)]
        cells += [f"{sum(r[k] for r in rs)}/{n}" for k in ("passed", "bitwise", "finished")]
        cells += [str(sum(r["lost"] for r in rs)), f"{sum(r['phase_hit'] for r in rs)}/{n}"]
        cells += [f"{statistics.median(rec):.1f} s" if rec else "-"]
        rows.append(_row(cells, widths))
    return rows


def findings(results: list[dict[str, Any]], step_timeout_s: float) -> list[str]:
    """What the tally's columns do not say: workers that outlived their agent, how long a
    stopped worker lasted."""
    out = []
    outlived = [r["outlived_agent"] for r in results if "outlived_agent" in r]
    if outlived:
        alive_n, total = sum(a for a, _ in outlived), sum(t for _, t in outlived)
        ended_s = [r["guard_ended_s"] for r in results if "guard_ended_s" in r]
        out.append(
            f"kill_agent: {alive_n} of {total} workers were still running 30 s after their "
            f"agent's process group was SIGKILLed ({len(outlived)} run(s)); the launcher's guard "
            f"ended the others in {statistics.median(ended_s):.1f} s (median; max "
            f"{max(ended_s):.1f} s)"
        )
    ended = [r["stopped_ended_s"] for r in results if "stopped_ended_s" in r]
    if ended:
        within = sum(e <= step_timeout_s + 10 for e in ended)
        out.append(
            f"stop: the stopped worker was ended {statistics.median(ended):.1f} s (median; max "
            f"{max(ended):.1f} s) after SIGSTOP, with monitor.step_timeout_s = {step_timeout_s:g}; "
            f"within step_timeout_s + 10 s in {within} of {len(ended)} run(s)"
        )
    return out


def _row(cells: tuple[str, ...] | list[str], widths: tuple[int, ...]) -> str:
    return cells[0].ljust(widths[0]) + "".join(
        c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True)
    )


def run_line(r: dict[str, Any], n: int) -> str:
    verdict = "PASS" if r["passed"] else "FAIL"
    rec = "-" if r["recovery_s"] is None else f"{r['recovery_s']:.1f} s"
    line = f"[{r['index'] + 1}/{n}] {r['fault']} {r['config']} (seed {r['seed']}): {r['what']}"
    line += f"\n    {verdict}: bitwise {r['bitwise']}, finished {r['finished']} "
    line += f"({r['group_starts']} worker group starts, exit {r['exit_codes']}), lost {r['lost']}, "
    line += f"recovery {rec}"
    for text in r["notes"]:
        line += f"\n    note: {text}"
    for text in r["failures"]:
        line += f"\n    failure: {text}"
    return line


def parse_names(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    out: list[str] = []
    for name in filter(None, text.split(",")):
        if name in ALIASES and what == "fault":
            out += [f for f in ALIASES[name] if f not in out]
        elif name in allowed:
            out += [name] if name not in out else []
        else:
            extra = f", or {', '.join(ALIASES)}" if what == "fault" else ""
            raise SystemExit(
                f"--{what}s: unknown {what} {name!r}; choose from {', '.join(allowed)}{extra}"
            )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=5, help="number of faulted runs (default 5)")
    p.add_argument("--seed", type=int, default=0, help="seeds every moment, victim and size")
    p.add_argument("--faults", default="all", help=f"comma list of {', '.join(FAULTS)}; kill, all")
    p.add_argument(
        "--configs", default=",".join(CONFIGS), help="comma list of " + ", ".join(CONFIGS)
    )
    p.add_argument("--steps", type=int, default=24, help="optimizer steps per run")
    p.add_argument("--interval", type=int, default=4, help="checkpoint.interval")
    p.add_argument("--step-timeout", type=float, default=10.0, help="monitor.step_timeout_s")
    p.add_argument("--max-restarts", type=int, default=2)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds allowed per run")
    p.add_argument("--dir", default="/tmp/meshrun-chaos", help="where runs are written")
    p.add_argument(
        "--max-minutes",
        type=float,
        default=math.inf,
        help="start no run after this many minutes; the tally says how many of --n ran",
    )
    p.add_argument("--keep", action="store_true", help="keep the run directories of passed runs")
    p.add_argument("--json", help="write every run's result and the tally to this file")
    a = p.parse_args(argv)
    faults = parse_names(a.faults, FAULTS, "fault")
    configs = parse_names(a.configs, tuple(CONFIGS), "config")
    if a.n < 1 or a.interval < 1:
        raise SystemExit(f"--n {a.n}, --interval {a.interval}: both must be at least 1")
    if "disk_full" in faults and os.geteuid() != 0:
        raise SystemExit(
            "--faults includes disk_full, which mounts a tmpfs: run as root, or leave it out "
            f"(--faults {','.join(f for f in faults if f != 'disk_full')})"
        )
    if a.steps < 3 * a.interval:
        raise SystemExit(f"--steps {a.steps}: needs at least 3 x --interval ({3 * a.interval})")
    s = Settings(a.steps, a.interval, a.step_timeout, a.max_restarts, a.timeout, Path(a.dir))
    s.root.mkdir(parents=True, exist_ok=True)
    # Workers orphaned by kill_agent become our children, so that we can find and reap them.
    ctypes.CDLL(None).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    results = run_all(a.n, a.seed, faults, configs, s, a.keep, a.max_minutes)
    table = tally(results, faults)
    passed = sum(r["passed"] for r in results)
    final = f"chaos: {passed}/{len(results)} runs passed (bitwise equal, finished, no checkpoint "
    final += f"lost), seed {a.seed}, {a.steps} steps, checkpoint every {a.interval}"
    if len(results) < a.n:
        final += f"; only {len(results)} of the {a.n} planned runs fitted in --max-minutes"
    notes = findings(results, a.step_timeout)
    table += ["", *notes] if notes else []
    print("\n" + "\n".join(table) + "\n" + final, flush=True)
    if a.json:
        Path(a.json).write_text(
            json.dumps(
                {
                    "settings": {**asdict(s), "root": str(s.root), "seed": a.seed},
                    "runs": results,
                    "tally": table,
                    "final": final,
                },
                indent=1,
            )
        )
    return 0 if passed == len(results) else 1


def run_all(
    n: int,
    seed: int,
    faults: list[str],
    configs: list[str],
    s: Settings,
    keep: bool,
    max_minutes: float,
) -> list[dict[str, Any]]:
    refs: dict[str, Reference] = {}
    results: list[dict[str, Any]] = []
    t_start = time.monotonic()
    for i, (fault, config) in enumerate(plan(n, faults, configs)):
        if time.monotonic() - t_start > max_minutes * 60:
            print(f"time budget (--max-minutes {max_minutes:g}) spent: {i} of {n} runs done")
            break
        if config not in refs:
            t0 = time.monotonic()
            refs[config] = reference(config, s)
            print(
                f"reference {config}: {s.steps} steps in {time.monotonic() - t0:.0f} s", flush=True
            )
        run_dir = s.root / f"run_{i:03d}_{fault}_{config}"
        if run_dir.exists():
            shutil.rmtree(run_dir)
        tag = f"{seed}:{i}"
        run = Run(
            i, fault, config, tag, run_dir, command(config, s, run_dir), s, random.Random(tag)
        )
        result = one_run(run, refs[config])
        results.append(result)
        print(run_line(result, n), flush=True)
        if result["passed"] and not keep:
            shutil.rmtree(run_dir, ignore_errors=True)
    return results


if __name__ == "__main__":
    sys.exit(main())
