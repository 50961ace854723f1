"""``meshrun compare``: the user's script run for K steps on one process and under each layout,
each through ``meshrun launch`` (one run at a time, a fresh run directory each), then compared
step by step (diagnose/compare.py).

Every run gets the same global batch, seed and data: the global batch is written into each
launch (the configured one, else micro-batch x the largest data-parallel size of the layouts,
which one process takes as one micro-batch), the seed and data order are the config's and
``run.dataloader``'s, which do not depend on the world size. A layout is the planner's syntax
(``zero=3``, ``tp=2``, ``pp=2,schedule=1f1b``: plan/search.py's ``parse_layout``), written as
``--parallel.KEY=VALUE`` overrides.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from meshrun.config import ConfigError, load_config, split_overrides
from meshrun.diagnose.compare import LayoutComparison, compare_runs, read_run, summary_lines
from meshrun.plan.inputs import Cluster, Layout
from meshrun.plan.search import parse_layout

__all__ = ["CompareSpec", "layout_overrides", "run_compare", "shared_global_batch"]

DEFAULT_LAYOUTS = ("zero=0", "zero=3")
MESH_KEYS = ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep", "zero")
LOG_TAIL = 15  # lines of a failed run's output shown


@dataclass(frozen=True)
class CompareSpec:
    """What ``meshrun compare`` was asked: the script, its arguments, the runs and where."""

    script: str
    script_args: list[str]
    nproc: int
    steps: int
    layouts: list[str]
    tolerance: float
    out: Path | None = None
    config: str | None = None


def _cluster(world: int) -> Cluster:
    """The planner's cluster for parsing a layout: only its size (one node of ``world``)."""
    return Cluster(1, world, 0.0, 0.0, 0.0, 0.0)


def layout_overrides(text: str, nproc: int) -> list[str]:
    """``zero=3`` on ``nproc`` processes as the config overrides of one launch: every mesh key
    (a layout replaces the configured one whole), and the pipeline schedule, virtual stages,
    micro-batch and recomputation where ``text`` names them."""
    lay = parse_layout(text, _cluster(nproc))
    if lay.size != nproc:
        raise ConfigError(
            f"--layout {text!r}: its sizes multiply to {lay.size} processes, --nproc is {nproc}; "
            f"give sizes whose product is {nproc}, or leave dp_shard out (it takes what is left)"
        )
    given = {item.split("=", 1)[0].strip() for item in text.split(",") if item.strip()}
    out = [f"--parallel.{k}={getattr(lay, k)}" for k in MESH_KEYS]
    if "schedule" in given:
        out.append(f"--parallel.pp_schedule={lay.schedule}")
    if "vpp" in given:
        out.append(f"--parallel.pp_virtual_stages={lay.vpp}")
    if "micro_batch" in given:
        out.append(f"--data.micro_batch={lay.micro_batch}")
    if given & {"ac", "activation_checkpointing"}:
        out.append(f"--parallel.activation_checkpoint={_recompute(text, lay)}")
    return out


def _recompute(text: str, lay: Layout) -> int:
    if lay.activation_checkpointing == "selective":
        raise ConfigError(
            f"--layout {text!r}: activation_checkpointing=selective has no meshrun setting "
            "(meshrun recomputes whole blocks); use none or full"
        )
    return 1 if lay.activation_checkpointing == "full" else 0


def shared_global_batch(spec: CompareSpec) -> int:
    """The global batch every run trains on: the configured one, else the micro-batch x the
    largest data-parallel size among the layouts."""
    overrides, _ = split_overrides(list(spec.script_args))
    cfg = load_config(spec.config, overrides)
    if cfg.data.global_batch:
        return cfg.data.global_batch
    dps = [_dp(parse_layout(text, _cluster(spec.nproc))) for text in spec.layouts]
    return cfg.data.micro_batch * max(dps, default=1)


def _dp(lay: Layout) -> int:
    return lay.dp_replicate * lay.dp_shard


@dataclass(frozen=True)
class _Launch:
    name: str  # "1 process" or the layout's text
    nproc: int
    overrides: list[str]
    run_dir: Path


def _plan_launches(spec: CompareSpec, out: Path, global_batch: int) -> list[_Launch]:
    """One process first, then each layout; every override checked before anything runs.
    One process takes the global batch as one micro-batch, as a one-GPU script would: a loss
    that depends on the micro-batch (``reduction="sum"``) then differs from step 1."""
    whole = [*layout_overrides("", 1), f"--data.micro_batch={global_batch}"]
    runs = [_Launch("1 process", 1, whole, out / "0-one-process")]
    for i, text in enumerate(spec.layouts, 1):
        slug = re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-") or "default"
        runs.append(
            _Launch(text, spec.nproc, layout_overrides(text, spec.nproc), out / f"{i}-{slug}")
        )
    return runs


def _launch_argv(spec: CompareSpec, launch: _Launch, global_batch: int) -> list[str]:
    """``meshrun launch`` of one run: compare's overrides after the script's own arguments
    (later wins), before a ``--`` that ends meshrun's flags."""
    ours = [
        *launch.overrides,
        f"--optim.steps={spec.steps}",
        # K steps of a run configured longer: a warmup beyond K is refused by the config, and
        # the schedule only has to be the same for every layout, not the long run's.
        "--optim.warmup_steps=0",
        f"--data.global_batch={global_batch}",
        f"--monitor.record_steps={spec.steps}",
        "--metrics.log_every=1",
        "--checkpoint.resume=never",
        f"--job.run_dir={launch.run_dir}",
    ]
    args = list(spec.script_args)
    cut = args.index("--") if "--" in args else len(args)
    head = [sys.executable, "-m", "meshrun", "launch", "--nproc-per-node", str(launch.nproc)]
    config = ["--config", spec.config] if spec.config else []
    return [*head, *config, spec.script, *args[:cut], *ours, *args[cut:]]


def _run(argv: Sequence[str], run_dir: Path) -> int:
    """One launch, its output in ``run_dir/compare.log`` (the run directory is made first)."""
    run_dir.mkdir(parents=True)
    with open(run_dir / "compare.log", "w") as log:
        return subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, check=False).returncode


def _out_dir(spec: CompareSpec) -> Path:
    if spec.out is None:
        return Path(tempfile.mkdtemp(prefix="meshrun-compare-"))
    if spec.out.exists() and any(spec.out.iterdir()):
        raise ConfigError(
            f"--out {spec.out}: the directory is not empty; give a new or empty directory "
            "(each run needs a fresh run directory)"
        )
    return spec.out


def _say(text: str) -> None:
    print(f"meshrun compare: {text}", file=sys.stderr, flush=True)


def _launch_one(spec: CompareSpec, launch: _Launch, global_batch: int) -> bool:
    """Run one launch; say how it went; False (with its output's tail on stdout) if it failed."""
    t0 = time.perf_counter()
    code = _run(_launch_argv(spec, launch, global_batch), launch.run_dir)
    took = time.perf_counter() - t0
    _say(f"{launch.name}: exit {code} in {took:.1f} s ({launch.run_dir / 'compare.log'})")
    if code == 0:
        return True
    tail = (launch.run_dir / "compare.log").read_text(errors="replace").splitlines()[-LOG_TAIL:]
    print(f"layout {launch.name}: the run FAILED (exit {code}); the end of its output:")
    print("\n".join(f"  | {line}" for line in tail))
    return False


def run_compare(spec: CompareSpec) -> int:
    """Every run, one at a time, then each layout against one process: 0 when every layout
    agrees, 1 when one differs or fails (2, bad input, is raised before anything runs)."""
    if spec.nproc < 1:
        raise ConfigError(f"--nproc {spec.nproc}: must be >= 1 (the processes of each layout)")
    if spec.steps < 1:
        raise ConfigError(f"--steps {spec.steps}: must be >= 1 (e.g. --steps 3)")
    if spec.tolerance < 0:
        raise ConfigError(f"--tolerance {spec.tolerance}: must be >= 0 (e.g. 1e-5 for fp32)")
    if not Path(spec.script).is_file():
        raise ConfigError(f"script {spec.script!r} does not exist; give the path of a .py file")
    global_batch = shared_global_batch(spec)
    for text in spec.layouts:  # every layout checked before a directory is made
        layout_overrides(text, spec.nproc)
    out = _out_dir(spec)
    launches = _plan_launches(spec, out, global_batch)
    _say(f"{spec.steps} steps, global batch {global_batch}, runs in {out}")
    base, *layouts = launches
    if not _launch_one(spec, base, global_batch):
        return 1
    reference = read_run(base.run_dir)
    ok = True
    for launch in layouts:
        if not _launch_one(spec, launch, global_batch):
            ok = False
            continue
        result = compare_runs(reference, read_run(launch.run_dir), spec.steps, spec.tolerance)
        ok = _report(launch.name, result, spec.tolerance) and ok
    return 0 if ok else 1


def _report(name: str, result: LayoutComparison, tolerance: float) -> bool:
    print("\n".join(summary_lines(name, result, tolerance)), flush=True)
    return result.agrees
