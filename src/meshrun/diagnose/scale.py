"""``meshrun scale-test --nproc 1,2,4 SCRIPT|-m MODULE args...``: the same job at several
world sizes, one after the other, through ``meshrun launch``'s path (torchrun's agent), one run
directory per size under ``--out``, then ``meshrun report`` over all of them.

Every size's config is loaded and validated (batch arithmetic, mesh) before the first process
starts, so a size that cannot run stops the test at once rather than after the others. The
global batch stays as configured, so the default is strong scaling; raise ``data.global_batch``
with the size yourself (separate runs, then ``meshrun report``) for weak scaling.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from meshrun.config import (
    Config,
    ConfigError,
    LaunchConfig,
    load_config,
    resolve_global_batch,
    split_overrides,
    validate_for_world,
)
from meshrun.launch.target import default_config, require_script
from meshrun.report.analysis import ReportError
from meshrun.report.html import summary_lines, write_report
from meshrun.runtime.logs import say_error

__all__ = ["ScaleRequest", "parse_sizes", "run_dirs", "run_scale_test", "scale_configs"]


def parse_sizes(text: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]`` (sorted, distinct, each >= 1), or a ConfigError."""
    try:
        sizes = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        sizes = []
    if not sizes or sizes[0] < 1:
        raise ConfigError(
            f"--nproc {text!r} is not allowed: expected process counts >= 1 separated by "
            "commas, e.g. --nproc 1,2,4"
        )
    return sizes


def run_dirs(parent: Path, sizes: list[int]) -> dict[int, Path]:
    """One run directory per size: ``PARENT/nproc<N>``."""
    return {n: parent / f"nproc{n}" for n in sizes}


@dataclasses.dataclass
class ScaleRequest:
    """What ``meshrun scale-test`` was asked for (cli/diagnose.py fills it from its flags)."""

    sizes: list[int]
    out: Path
    target: str | None = None  # a script path, or the module with ``module`` set
    module: bool = False
    args: list[str] = dataclasses.field(default_factory=list)  # after the script
    steps: int | None = None
    config: str | None = None
    sets: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # --set pairs


def scale_configs(req: ScaleRequest) -> dict[int, Config]:
    """Each size's resolved config, validated for its world size (no process started yet)."""
    overrides, _ = split_overrides(list(req.args))
    keys = {k for k, _ in overrides}
    if "job.run_dir" in keys:
        raise ConfigError(
            "job.run_dir is set by scale-test (OUT/nproc<N> per size); leave it out and pass --out"
        )
    if req.steps is not None and "optim.steps" in keys:
        raise ConfigError("--steps and --optim.steps both given; pass one of them")
    default = default_config(req.target if req.module else None)
    out: dict[int, Config] = {}
    for n, run_dir in run_dirs(req.out, req.sizes).items():
        steps = [] if req.steps is None else [("optim.steps", str(req.steps))]
        cfg = load_config(req.config or default, [*req.sets, *overrides, *steps])
        cfg.job.run_dir = str(run_dir)
        try:
            validate_for_world(cfg, n)
        except ConfigError as e:
            raise ConfigError(f"at --nproc {n}: {e}") from None
        if (run_dir / "metrics.jsonl").exists():
            raise ConfigError(
                f"{run_dir} already holds a run (metrics.jsonl); pass a new --out or remove it"
            )
        out[n] = cfg
    _resolve_batch(out)
    return out


def _resolve_batch(configs: dict[int, Config]) -> None:
    """An unset global batch gets one number for every size (strong scaling), said once."""
    first = next(iter(configs.values()))
    if note := resolve_global_batch(first, list(configs)):
        print(f"meshrun scale-test: {note}; kept at every size", file=sys.stderr)
        for cfg in configs.values():
            cfg.data.global_batch = first.data.global_batch


def _one_node(launch: LaunchConfig, nproc: int) -> LaunchConfig:
    """The config's [launch] keys (restarts, threads, rendezvous id) for ``nproc`` processes
    on this node: scale-test runs every size here, whatever nodes the config names."""
    return dataclasses.replace(launch, nproc_per_node=nproc, nnodes="1", rdzv_endpoint="")


def run_scale_test(req: ScaleRequest) -> int:
    """Run every size one after the other, then write OUT/report; the exit status."""
    from meshrun.config import write_config
    from meshrun.launch.agent.local import launch_local
    from meshrun.launch.spec import LaunchSpec

    require_script("scale-test", req.target, req.module)
    configs = scale_configs(req)
    done: list[Path] = []
    failed: list[int] = []
    for n, cfg in configs.items():
        run_dir = cfg.resolved_run_dir()
        print(f"meshrun scale-test: {n} process(es) -> {run_dir}", file=sys.stderr, flush=True)
        spec = LaunchSpec.of(
            _one_node(cfg.launch, n),
            script=None if req.module else req.target,
            module=req.target if req.module else None,
            script_args=list(req.args),
            config_path=str(write_config(cfg, run_dir / "config.toml")),
            run_dir=str(run_dir),
        )
        if launch_local(spec) == 0:
            done.append(run_dir)
        else:
            failed.append(n)
    return _report(done, failed, req.out / "report")


def _report(done: list[Path], failed: list[int], out: Path) -> int:
    if failed:
        print(f"meshrun scale-test: the run(s) at --nproc {failed} failed", file=sys.stderr)
    if not done:
        return 1
    try:
        report = write_report(done, out)
    except ReportError as e:
        say_error("scale-test", e)
        return 2
    print("\n".join(summary_lines(report)))
    return 1 if failed else 0
