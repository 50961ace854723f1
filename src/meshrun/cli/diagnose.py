"""``meshrun bench comm|compute|all|data``, ``meshrun doctor`` and ``meshrun scale-test``: their
flags, and the parent side
of ``bench`` (a config and ``launch_local`` of diagnose/bench_worker.py on every rank).

``bench`` measures this machine and writes the calibration file ``meshrun plan --calibration``
reads: ``comm``, collectives over a sweep of message sizes (diagnose/bench_comm.py) and the
layer-level cases (diagnose/bench_compute.py); ``compute``, matmul FLOP/s and the demo GPT's
step; rank 0 merges its results into the file (diagnose/calibration.py), so ``bench compute``
then ``bench comm`` accumulate. ``bench data`` (the loader alone) is mounted from cli/data.py.
"""

from __future__ import annotations

import argparse
import json
import socket
from pathlib import Path
from typing import Any

from meshrun.cli.args import Subparsers, add_command, add_network_flags, add_set, add_target
from meshrun.diagnose import doctor_checks as dc
from meshrun.diagnose.doctor import DoctorOptions, exit_code, local_checks, render

# What every rank of `meshrun bench` runs (python -m); not imported here: the command line
# parses its flags without loading the measurements.
BENCH_WORKER = "meshrun.diagnose.bench_worker"

# --- meshrun bench ---------------------------------------------------------------------------


def cmd_bench(a: argparse.Namespace) -> int:
    from meshrun.config import ConfigError
    from meshrun.diagnose.bench_request import BenchRequest
    from meshrun.launch.agent.local import default_nproc_per_node, launch_local

    nproc = a.nproc_per_node or default_nproc_per_node()
    cfg, nodes = _bench_config(a, nproc)
    if nproc * nodes < 2 and a.kind in ("comm", "all"):
        raise ConfigError(f"--nproc-per-node {nproc}: bench comm needs at least 2 processes")
    if a.max_mb <= 0:
        raise ConfigError(f"--max-mb {a.max_mb}: must be > 0")
    request = BenchRequest(
        out=str(Path(a.out).resolve()),
        kind=a.kind,
        max_mb=a.max_mb,
        precision=a.precision,
        seconds=a.seconds,
        pairs=getattr(a, "pairs", False),
        pair_mb=getattr(a, "pair_mb", 4.0),
        nodes=nodes,
    )
    code = launch_local(_bench_spec(cfg, nproc, request, a.run_dir))
    if code == 0 and (nodes == 1 or cfg.launch.node_rank == 0):
        print(f"wrote {a.out}; use it with `meshrun plan --calibration {a.out} ...`")
    return code


def _bench_config(a: argparse.Namespace, nproc: int) -> tuple[Any, int]:
    """The bench job's config, with the multi-node flags applied as ``meshrun launch`` applies
    them (the same ``[launch]`` keys and checks), and its node count (fixed: the collectives'
    sizes and the calibration are per world)."""
    from meshrun.config import Config, ConfigError, nnodes_range
    from meshrun.launch.front.torchrun import apply_launch_flags
    from meshrun.launch.spec import LaunchKeys

    cfg = Config()
    cfg.job.name, cfg.job.run_dir = "bench", a.run_dir
    cfg.metrics.progress = False
    keys = LaunchKeys(
        nproc_per_node=a.nproc_per_node,
        nnodes=a.nnodes,
        node_rank=a.node_rank,
        rdzv_endpoint=a.rdzv_endpoint,
        rdzv_id=a.rdzv_id,
        interface=a.interface,
        join_timeout=a.join_timeout,
    )
    apply_launch_flags(cfg, keys)
    low, high = nnodes_range(cfg.launch.nnodes)
    if low != high:
        raise ConfigError(
            f"--nnodes {cfg.launch.nnodes}: meshrun bench measures one world; give a node "
            "count N, not MIN:MAX"
        )
    cfg.data.micro_batch, cfg.data.global_batch = 1, nproc * high
    return cfg, high


def _bench_spec(cfg: Any, nproc: int, request: Any, run_dir: str) -> Any:
    from meshrun.config import write_config
    from meshrun.launch.multinode.nodes import shared_digest, shared_settings
    from meshrun.launch.spec import LaunchSpec

    config_path = write_config(cfg, Path(run_dir) / "config.toml")
    return LaunchSpec.of(
        cfg.launch,
        procs_per_node=nproc,
        module=BENCH_WORKER,
        script_args=request.to_argv(),
        config_digest=shared_digest(cfg),  # the nodes' handshake compares it
        shared_config=shared_settings(cfg),
        config_path=str(config_path),
        run_dir=run_dir,
    )


def add_bench_parser(sub: Subparsers) -> None:
    from meshrun.cli.data import add_bench_data

    p = sub.add_parser(
        "bench",
        help="measure links, compute and the data loader (links and compute: a calibration file)",
        description="Run collectives over a sweep of message sizes (comm) and matmul plus the "
        "demo GPT's step (compute) in N processes started by torchrun's agent; rank 0 writes "
        "the calibration file that `meshrun plan --calibration` reads (docs/plan.md). `data`: "
        "samples/s of the data loader alone, per rank (docs/data.md).",
    )
    kinds = p.add_subparsers(dest="kind", required=True, metavar="{comm,compute,all,data}")
    common = argparse.ArgumentParser(add_help=False)
    _add_calibration_options(common)
    for kind, help in (
        ("comm", "collectives over a sweep of message sizes"),
        ("compute", "matmul and the demo GPT's step, FLOP/s"),
        ("all", "comm and compute"),
    ):
        k = kinds.add_parser(kind, help=help, parents=[common])
        k.set_defaults(fn=cmd_bench)
        if kind != "compute":
            k.add_argument(
                "--pairs",
                action="store_true",
                help="also measure every pair of "
                "nodes (of ranks on one node) alone: a matrix, to find a slow link",
            )
            k.add_argument(
                "--pair-mb", type=float, default=4.0, help="message per pair and direction, MiB (4)"
            )
    add_bench_data(kinds, "data")


def _add_calibration_options(p: argparse.ArgumentParser) -> None:
    from meshrun.cli.torchrun import add_node_arguments

    p.add_argument(
        "--nproc-per-node", type=int, help="processes on this node (default: GPUs, else 2)"
    )
    p.add_argument("--out", default="calibration.json", help="calibration file (merged into)")
    p.add_argument("--max-mb", type=float, default=16.0, help="largest message, MiB (16)")
    p.add_argument(
        "--precision",
        choices=["fp32", "bf16", "fp16"],
        default="fp32",
        help="matmul precision (fp32; bf16/fp16 on GPUs)",
    )
    p.add_argument("--seconds", type=float, default=0.3, help="time per measurement (0.3)")
    p.add_argument("--run-dir", default="runs/bench", help="logs and config (runs/bench)")
    add_network_flags(add_node_arguments(p))


# --- meshrun doctor --------------------------------------------------------------------------


def cmd_doctor(a: argparse.Namespace) -> int:
    opts = options_from_args(a)
    if opts.rdzv_endpoint:
        try:
            dc.split_endpoint(opts.rdzv_endpoint)
        except ValueError as err:
            from meshrun.config import ConfigError

            raise ConfigError(str(err)) from None
    checks = local_checks(opts)
    if a.json:
        print(json.dumps(dc.as_dicts(checks), indent=2))
    else:
        print(render([("", c) for c in checks], f"meshrun doctor on {socket.gethostname()}"))
    return exit_code(checks)


def options_from_args(a: argparse.Namespace) -> DoctorOptions:
    """Flags first, then the config file's keys, then defaults."""
    from meshrun.config import ConfigError, load_config
    from meshrun.launch.agent.local import default_nproc_per_node

    cfg = load_config(a.config, list(getattr(a, "overrides", [])))
    launch: Any = cfg.launch
    nproc = a.nproc_per_node
    if nproc is None:
        nproc = cfg.launch.nproc_per_node or default_nproc_per_node()
    if nproc < 1:
        raise ConfigError(f"--nproc-per-node {nproc} is not allowed: must be >= 1")
    ckpt = a.checkpoint_dir or cfg.checkpoint.dir or str(cfg.resolved_run_dir() / "checkpoints")
    return DoctorOptions(
        nproc=nproc,
        checkpoint_dir=Path(ckpt),
        # The multi-node keys, when the config has them (the flags win).
        rdzv_endpoint=a.rdzv_endpoint or getattr(launch, "rdzv_endpoint", ""),
        interface=a.interface or getattr(launch, "interface", ""),
        keep_last=cfg.checkpoint.keep_last,
        num_workers=cfg.data.num_workers,
    )


def add_doctor_parser(sub: Subparsers) -> None:
    p = add_command(
        sub,
        "doctor",
        cmd_doctor,
        help="check this node before a job: versions, GPUs, network, ports, /dev/shm, disk",
        description="A pre-flight checklist of this node; each line PASS/WARN/FAIL with the fix "
        "for each FAIL; exit status 1 on any FAIL. Across all nodes of a launch (clock skew, a "
        "timed all-reduce): `meshrun launch --doctor ...`. See docs/doctor.md.",
    )
    p.add_argument("--nproc-per-node", type=int, help="processes per node (default: GPUs, else 2)")
    p.add_argument(
        "--rdzv-endpoint", default="", help="HOST:PORT of the rendezvous (default: one node)"
    )
    p.add_argument("--interface", default="", help="network interface the job will use")
    p.add_argument(
        "--checkpoint-dir", help="where checkpoints go (default: the config's checkpoint.dir)"
    )
    p.add_argument("--config", help="TOML config file (data.num_workers, checkpoint.*)")
    p.add_argument("--json", action="store_true", help="print the checks as a JSON list")


# --- meshrun scale-test ----------------------------------------------------------------------


def cmd_scale_test(a: argparse.Namespace) -> int:
    from meshrun.diagnose.scale import ScaleRequest, parse_sizes, run_scale_test

    req = ScaleRequest(
        sizes=parse_sizes(a.nproc),
        out=Path(a.out),
        target=a.target,
        module=bool(a.module),
        args=list(a.args),
        steps=a.steps,
        config=a.config,
        sets=list(a.set),
    )
    return run_scale_test(req)


def add_scale_parser(sub: Subparsers) -> None:
    p = sub.add_parser(
        "scale-test",
        help="run one job at several process counts and report the scaling efficiency",
        description="Run SCRIPT (or -m MODULE) once per process count on this node through "
        "torchrun's agent, each in OUT/nproc<N>, then write OUT/report (meshrun report). The "
        "global batch stays as configured (strong scaling). Arguments after the script go to "
        "it; --section.key=value among them override the config, validated for every size "
        "before any process starts.",
    )
    p.add_argument("--nproc", required=True, help="process counts, e.g. 1,2,4")
    p.add_argument("--steps", type=int, help="optimizer steps per run (= --optim.steps)")
    p.add_argument(
        "--out", default="runs/scale-test", help="parent folder (default runs/scale-test)"
    )
    p.add_argument("--config", help="TOML config file")
    add_set(p)
    add_target(p)
    p.set_defaults(fn=cmd_scale_test)
