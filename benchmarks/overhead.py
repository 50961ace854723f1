"""What meshrun costs over plain torch at launch and per step: one benchmark, six modes.

    .venv/bin/python benchmarks/overhead.py [--mode MODE] [--pairs N] [the mode's flags]

Every mode measures its variants in one run, interleaved, so that a machine getting slower
or faster hits them alike, and prints ``/proc/loadavg`` before and after. The processes it
starts are the scripts in ``benchmarks/overhead_workers/``; benchmarks/README.md has each
mode's method, targets and figures.

- ``step`` (default): a meshrun script (``with_meshrun.py``) against a hand-written DDP loop
  (``plain.py``), both training the demo GPT identically under torchrun, in pairs: the
  per-step ratio (target <= 1.02), the CPU-time ratio, (b) launch to the end of the first
  step (target +0.25 s), the final losses (equal); then ``--launch-pairs`` pairs of (a).
- ``launch``: (a) ``meshrun launch`` against ``torchrun --standalone`` starting ``plain.py
  --bare`` (process group, one all-reduce, exit): wall and CPU of launcher + workers,
  alternating pairs (target +0.15 s wall).
- ``breakdown`` / ``insitu``: where the per-step time goes, in one torchrun world
  (``diagnose.py``): whole steps interleaved and each extra alone / the step loop's own
  functions timed in place.
- ``secret``: launch to the end of the first step with this checkout's ``src`` against
  ``--baseline-src DIR`` (a checkout without the job secret, e.g. ``git archive f78e750 src |
  tar -x -C /tmp/pre``), alternating pairs (target +0.05 s).
- ``secret-parts``: in one process, the secret file, the bound store and a signed 1-node
  rendezvous against a free port and c10d's rendezvous.

``--out FILE`` writes a mode's figures as JSON (not ``breakdown``/``insitu``, which print).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from overhead_workers.common import T0_ENV

HERE = Path(__file__).resolve().parent
WORKERS = HERE / "overhead_workers"
ROOT = HERE.parent
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
TARGETS = {"step_ratio": 1.02, "startup_diff_s": 0.25, "launch_diff_s": 0.15, "secret_diff_s": 0.05}
# Each mode's flags and their defaults (None: optional, no default); a flag another mode
# takes is refused by name.
MODES: dict[str, dict[str, Any]] = {
    "step": {"pairs": 3, "steps": 30, "skip": 3, "size": "small", "nproc": 2, "seed": 1234}
    | {"timeout": 600, "launch_pairs": 6, "out": None, "keep": None},
    "launch": {"pairs": 6, "nproc": 2, "timeout": 300, "out": None},
    "breakdown": {"steps": 20, "skip": 2, "reps": 200, "size": "small", "nproc": 2}
    | {"timeout": 600},
    "insitu": {"steps": 50, "skip": 5, "size": "small", "nproc": 2, "timeout": 600},
    "secret": {"pairs": 8, "nproc": 2, "timeout": 300, "baseline_src": None, "out": None},
    "secret-parts": {"pairs": 30, "out": None},
}
# The demo's settings (src/meshrun/demo/demo.toml), passed to both step workers explicitly.
HYPER = {
    "global-batch": 32,
    "micro-batch": 4,
    "lr": 2e-3,
    "warmup-steps": 10,
    "min-lr-ratio": 0.1,
    "weight-decay": 0.1,
    "corpus-bytes": 4_000_000,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = (  # None: a flag without a default
        f"{mode}: "
        + " ".join(f"--{k.replace('_', '-')} {'...' if v is None else v}" for k, v in d.items())
        for mode, d in MODES.items()
    )
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="each mode's flags and defaults:\n  " + "\n  ".join(defaults),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--mode", default="step", choices=list(MODES))
    p.add_argument("--pairs", "--repeats", type=int, help="interleaved pairs (rounds)")
    p.add_argument("--steps", type=int, help="optimizer steps per run (breakdown: per kind)")
    p.add_argument("--skip", type=int, help="warm-up steps left out of the times")
    p.add_argument("--size", choices=["tiny", "small"], help="demo model size")
    p.add_argument("--nproc", type=int, help="processes (ranks) per run")
    p.add_argument("--seed", type=int)
    p.add_argument("--timeout", type=float, help="seconds allowed per run")
    p.add_argument("--launch-pairs", type=int, help="step: then pairs of (a) (0: none)")
    p.add_argument("--reps", type=int, help="breakdown: calls per per-step extra")
    p.add_argument("--baseline-src", type=Path, help="secret: the src of a checkout without it")
    p.add_argument("--out", type=Path, help="also write the results here as JSON")
    p.add_argument("--keep", type=Path, help="step: keep run logs and results here")
    args = p.parse_args(argv)
    apply_mode_defaults(p, args)
    check_args(p, args)
    return args


def apply_mode_defaults(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    takes = MODES[args.mode]
    for name in set().union(*MODES.values()):
        value = getattr(args, name)
        if value is not None and name not in takes:
            flags = ", ".join(f"--{k.replace('_', '-')}" for k in takes)
            p.error(
                f"--{name.replace('_', '-')} is not a flag of --mode {args.mode} (it takes {flags})"
            )
        if value is None:
            setattr(args, name, takes.get(name))


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.mode in ("step", "breakdown", "insitu") and args.steps <= args.skip:
        p.error(f"--steps ({args.steps}) must be larger than --skip ({args.skip})")
    if args.mode == "step" and HYPER["global-batch"] % (HYPER["micro-batch"] * args.nproc):
        p.error(
            f"global batch {HYPER['global-batch']} is not a multiple of micro-batch "
            f"{HYPER['micro-batch']} x --nproc {args.nproc}"
        )
    if args.mode == "secret" and (args.baseline_src is None or not args.baseline_src.is_dir()):
        p.error(
            f"--mode secret needs --baseline-src DIR, the src folder of a checkout without the "
            f"job secret (got {args.baseline_src}); e.g. git archive f78e750 src | tar -x -C /tmp/pre"
        )


# --- what every mode uses -------------------------------------------------------------------


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().strip()


def load_average() -> float:
    return float(loadavg().split()[0])


def children_cpu() -> float:
    """CPU seconds of every child process this one has waited for (user + system)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_timed(cmd: list[str], env: dict[str, str], timeout: float, what: str) -> dict[str, float]:
    """Wall and CPU (the command and everything it started) seconds of one command, and the
    load average before it; exits naming ``what`` with the end of its output if it fails."""
    load, cpu, start = load_average(), children_cpu(), time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, timeout=timeout, check=False)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).decode(errors="replace")[-3000:]
        sys.exit(f"{what} failed with exit {proc.returncode}:\n{tail}")
    return {"wall_s": wall, "cpu_s": children_cpu() - cpu, "load_before": load}


def interleaved(
    n: int, names: tuple[str, str], one: Callable[[str, int], Any], alternate: bool = True
) -> list[dict[str, Any]]:
    """``n`` pairs of ``one(name, i)``; with ``alternate``, odd pairs start with ``names[1]``."""
    rows = []
    for i in range(n):
        order = names if i % 2 == 0 or not alternate else names[::-1]
        rows.append({v: one(v, i) for v in order})
        print(f"pair {i + 1}/{n} done", file=sys.stderr, flush=True)
    return rows


def paired(rows: list[dict[str, Any]], a: str, b: str, key: str) -> dict[str, float]:
    """Medians of ``key`` for ``a`` and ``b``, and of the per-pair ratio b/a and difference."""
    xs, ys = [r[a][key] for r in rows], [r[b][key] for r in rows]
    return {
        a: statistics.median(xs),
        b: statistics.median(ys),
        "ratio": statistics.median(
            y / x if x > 0 else float("nan") for x, y in zip(xs, ys, strict=True)
        ),
        "diff": statistics.median(y - x for x, y in zip(xs, ys, strict=True)),
    }


def verdict(value: float, target: float) -> str:
    return "ok" if value <= target else "ABOVE TARGET"


# --- step: a meshrun script against a hand-written DDP loop ---------------------------------


def step_run(variant: str, args: argparse.Namespace, workdir: Path, pair: int) -> dict[str, Any]:
    """One run through torchrun; rank 0's result record."""
    tag = f"{variant}_{pair + 1}"
    result = workdir / f"{tag}.json"
    script = WORKERS / ("plain.py" if variant == "plain" else "with_meshrun.py")
    cmd = [
        *(*TORCHRUN, "--nproc-per-node", str(args.nproc), str(script)),
        *(f"--result={result}", f"--run-dir={workdir / tag}", f"--steps={args.steps}"),
        *(f"--skip={args.skip}", f"--size={args.size}", f"--seed={args.seed}"),
        *(f"--{k}={v}" for k, v in HYPER.items()),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    load = load_average()  # other work on the machine shows up here
    with open(workdir / f"{tag}.log", "w", encoding="utf-8") as log:
        env[T0_ENV] = repr(time.time())  # as late as possible: startup counts from here
        proc = subprocess.run(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout, check=False
        )
    if proc.returncode != 0 or not result.exists():
        tail = (workdir / f"{tag}.log").read_text(encoding="utf-8")[-4000:]
        sys.exit(f"{tag} failed (exit {proc.returncode}); end of its output:\n{tail}")
    record: dict[str, Any] = json.loads(result.read_text(encoding="utf-8"))
    return record | {"load_before": load}


def summarize_steps(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-pair medians and ratios, then the medians of those over the pairs."""
    rows = []
    for pair in runs:
        row: dict[str, Any] = {}
        for v in ("plain", "meshrun"):
            row[v] = {
                "step_s": statistics.median(pair[v]["step_times_s"]),
                "cpu_s": statistics.median(pair[v]["cpu_times_s"]),
            } | {k: pair[v][k] for k in ("startup_s", "final_loss", "marks_s", "load_before")}
        rows.append(row)
    out = {key: paired(rows, "plain", "meshrun", key) for key in ("step_s", "cpu_s", "startup_s")}
    return out | {"final_loss": {v: rows[-1][v]["final_loss"] for v in rows[-1]}, "pairs": rows}


def report_steps(s: dict[str, Any], args: argparse.Namespace) -> None:
    print(
        f"meshrun overhead | model {args.size} | {args.steps} steps ({args.steps - args.skip} "
        f"timed, {args.skip} warm-up) | {args.nproc} processes, gloo, OMP_NUM_THREADS=1 | "
        f"{args.pairs} pairs, plain then meshrun"
    )
    print(
        "pair | s/step plain meshrun ratio | cpu s/step plain meshrun ratio"
        " | startup s plain meshrun ratio | load avg"
    )
    for i, r in enumerate(s["pairs"], 1):
        cols = [f"{i:>4}"]
        for key in ("step_s", "cpu_s", "startup_s"):
            a, b = r["plain"][key], r["meshrun"][key]
            cols.append(f"{a:.4f} {b:.4f} {b / a:.3f}")
        cols.append(f"{r['plain']['load_before']:.1f} {r['meshrun']['load_before']:.1f}")
        print(" | ".join(cols))
    step, cpu, start = s["step_s"], s["cpu_s"], s["startup_s"]
    print(f"median step time: plain {step['plain']:.4f} s, meshrun {step['meshrun']:.4f} s")
    print(
        f"per-step ratio meshrun/plain: {step['ratio']:.3f} (target <= "
        f"{TARGETS['step_ratio']}: {verdict(step['ratio'], TARGETS['step_ratio'])})"
    )
    print(
        f"per-step CPU-time ratio meshrun/plain: {cpu['ratio']:.3f} "
        f"(plain {cpu['plain']:.4f} s, meshrun {cpu['meshrun']:.4f} s)"
    )
    print(
        f"(b) startup ratio meshrun/plain (launch to end of first step): {start['ratio']:.3f} "
        f"(plain {start['plain']:.2f} s, meshrun {start['meshrun']:.2f} s; median pair "
        f"difference {start['diff']:+.2f} s, target <= +{TARGETS['startup_diff_s']} s: "
        f"{verdict(start['diff'], TARGETS['startup_diff_s'])})"
    )
    loss = s["final_loss"]
    print(
        f"final loss at step {args.steps}: plain {loss['plain']:.4f}, meshrun "
        f"{loss['meshrun']:.4f} (difference {abs(loss['plain'] - loss['meshrun']):.1e})"
    )
    for v in ("plain", "meshrun"):  # where startup goes, last pair: seconds since launch
        marks = s["pairs"][-1][v]["marks_s"]
        print(f"startup marks {v:>7}: " + ", ".join(f"{k} {t:.2f}" for k, t in marks.items()))


def mode_step(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="meshrun-overhead-") as tmp:
        workdir = args.keep or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        runs = interleaved(
            args.pairs,
            ("plain", "meshrun"),
            lambda v, i: step_run(v, args, workdir, i),
            alternate=False,  # A then B, as every figure of this mode was measured
        )
    summary = summarize_steps(runs)
    report_steps(summary, args)
    out = {"hyper": HYPER, "summary": summary, "runs": runs}
    if args.launch_pairs > 0:
        out["launcher"] = launcher_pairs(args.launch_pairs, args.nproc, args.timeout)
    return out


# --- launch: meshrun launch against torchrun on a plain script ----------------------------


def program(name: str) -> list[str]:
    """The console script next to this interpreter, else ``python -m`` of its module."""
    found = Path(sys.executable).with_name(name)
    if found.is_file():
        return [str(found)]
    return [sys.executable, "-m", "torch.distributed.run" if name == "torchrun" else "meshrun"]


def launch_command(launcher: str, nproc: int, run_dir: Path) -> list[str]:
    script = [str(WORKERS / "plain.py"), "--bare"]
    if launcher == "torchrun":
        return [*program("torchrun"), "--standalone", "--nproc-per-node", str(nproc), *script]
    return [
        *program("meshrun"),
        *("launch", "--nproc-per-node", str(nproc), "--set", f"job.run_dir={run_dir}", *script),
    ]


def report_launch(s: dict[str, Any], nproc: int) -> None:
    print(
        f"launcher overhead | plain script (process group, one all-reduce) | {nproc} processes,"
        f" OMP_NUM_THREADS=1 | {len(s['pairs'])} pairs, alternating order"
    )
    print("pair | wall s torchrun meshrun diff | cpu s torchrun meshrun diff | load avg t m")
    for i, r in enumerate(s["pairs"], 1):
        t, m = r["torchrun"], r["meshrun"]
        print(
            f"{i:>4} | {t['wall_s']:.3f} {m['wall_s']:.3f} {m['wall_s'] - t['wall_s']:+.3f}"
            f" | {t['cpu_s']:.3f} {m['cpu_s']:.3f} {m['cpu_s'] - t['cpu_s']:+.3f}"
            f" | {t['load_before']:.1f} {m['load_before']:.1f}"
        )
    w, c = s["wall_s"], s["cpu_s"]
    print(
        f"(a) meshrun launch vs torchrun, wall: {w['meshrun']:.3f} s vs {w['torchrun']:.3f} s"
        f" (medians); median pair ratio {w['ratio']:.3f}, median pair difference"
        f" {w['diff']:+.3f} s (target <= +{TARGETS['launch_diff_s']} s:"
        f" {verdict(w['diff'], TARGETS['launch_diff_s'])})"
    )
    print(
        f"(a) meshrun launch vs torchrun, CPU of launcher + workers: {c['meshrun']:.3f} s vs"
        f" {c['torchrun']:.3f} s; median pair ratio {c['ratio']:.3f}, difference"
        f" {c['diff']:+.3f} s"
    )


def launcher_pairs(pairs: int, nproc: int, timeout: float) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory(prefix="meshrun-launch-overhead-") as tmp:

        def one(launcher: str, i: int) -> dict[str, float]:
            cmd = launch_command(launcher, nproc, Path(tmp) / f"{launcher}_{i}")
            return run_timed(cmd, env, timeout, f"{launcher} (pair {i + 1})")

        rows = interleaved(pairs, ("torchrun", "meshrun"), one)
    s = {k: paired(rows, "torchrun", "meshrun", k) for k in ("wall_s", "cpu_s")} | {"pairs": rows}
    report_launch(s, nproc)
    return s


def mode_launch(args: argparse.Namespace) -> dict[str, Any]:
    return launcher_pairs(args.pairs, args.nproc, args.timeout)


# --- breakdown, insitu: where the per-step time goes --------------------------------------


def mode_diagnose(args: argparse.Namespace) -> None:
    cmd = [
        *(*TORCHRUN, "--nproc-per-node", str(args.nproc), str(WORKERS / "diagnose.py")),
        *(args.mode, f"--size={args.size}", f"--steps={args.steps}", f"--skip={args.skip}"),
        f"--reps={args.reps or 0}",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory(prefix=f"meshrun-{args.mode}-") as run_dir:
        cmd.append(f"--run-dir={run_dir}")  # one for every rank: meshrun checks it is shared
        code = subprocess.run(cmd, env=env, timeout=args.timeout, check=False).returncode
    if code != 0:
        sys.exit(f"--mode {args.mode}: the torchrun world failed with exit {code}")


# --- secret: the job secret at start ----------------------------------------------------------


def secret_run(src: Path, args: argparse.Namespace, tmp: Path, tag: str) -> dict[str, float]:
    first = tmp / f"{tag}.first"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHRUN_JOB_SECRET")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(src), FIRST_STEP=str(first))
    cmd = [
        *(sys.executable, "-m", "meshrun", "launch", "--nproc-per-node", str(args.nproc)),
        *(str(WORKERS / "with_meshrun.py"), "first-step", f"--job.run_dir={tmp / tag}"),
        *("--optim.steps=1", "--data.global_batch=16", "--data.micro_batch=8"),
    ]
    start = time.time()
    run = run_timed(cmd, env, args.timeout, tag)
    if not first.exists():
        sys.exit(f"{tag}: rank 0 wrote no first-step time to {first}")
    return run | {"first_step_s": float(first.read_text()) - start}


def mode_secret(args: argparse.Namespace) -> dict[str, Any]:
    srcs = {"without": args.baseline_src.resolve(), "with": ROOT / "src"}
    with tempfile.TemporaryDirectory(prefix="meshrun-secret-overhead-") as tmp:
        rows = interleaved(
            args.pairs,
            ("with", "without"),
            lambda v, i: secret_run(srcs[v], args, Path(tmp), f"{v}_{i}"),
        )
    print(
        f"launch to the end of the first step | {args.nproc} processes, OMP_NUM_THREADS=1 | "
        f"{len(rows)} pairs, alternating | with = {srcs['with']}, without = {srcs['without']}"
    )
    print("pair | to first step: without s | with s | diff s | CPU s (whole run): without | with")
    for i, r in enumerate(rows, 1):
        a, b = r["without"], r["with"]
        print(
            f"{i:>4} | {a['first_step_s']:.3f} | {b['first_step_s']:.3f} | "
            f"{b['first_step_s'] - a['first_step_s']:+.3f} | {a['cpu_s']:.2f} | "
            f"{b['cpu_s']:.2f} | load {a['load_before']:.1f}"
        )
    s = {k: paired(rows, "without", "with", k) for k in ("first_step_s", "cpu_s")}
    first, cpu = s["first_step_s"], s["cpu_s"]
    print(f"CPU seconds of launcher + workers: median pair difference {cpu['diff']:+.3f} s")
    print(
        f"medians: without {first['without']:.3f} s, with {first['with']:.3f} s; median pair "
        f"difference {first['diff']:+.3f} s (target <= +{TARGETS['secret_diff_s']} s: "
        f"{verdict(first['diff'], TARGETS['secret_diff_s'])})"
    )
    return s | {"pairs": rows, "srcs": {k: str(v) for k, v in srcs.items()}}


def mode_secret_parts(args: argparse.Namespace) -> dict[str, Any]:
    """The secret file, the bound store and a signed 1-node rendezvous, against a free port
    and c10d's, in this process."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    from meshrun.launch.multinode.handshake import publish_attempt
    from meshrun.launch.trust.rendezvous import forget_store, listen_store, new_nonce, register
    from meshrun.launch.trust.secret import resolve
    from meshrun.runtime.ports import free_port
    from meshrun.runtime.secret import NONCE_ENV, SECRET_ENV

    def rendezvous(backend: str, port: int, run_id: str) -> float:
        params = RendezvousParameters(
            backend=backend,
            endpoint=f"127.0.0.1:{port}",
            run_id=run_id,
            min_nodes=1,
            max_nodes=1,
            local_addr="127.0.0.1",
            is_host="1",
        )
        start = time.perf_counter()
        handler = get_rendezvous_handler(params)
        handler.next_rendezvous()
        took = time.perf_counter() - start
        handler.shutdown()
        return took

    def signed(i: int, tmp: Path) -> float:
        start = time.perf_counter()
        secret = resolve(str(tmp / f"run{i}"), {}, create=True)
        os.environ[SECRET_ENV] = secret.key.decode()
        store = listen_store("127.0.0.1", 0, 60)
        publish_attempt(store, f"job{i}", secret)
        setup = time.perf_counter() - start
        took = rendezvous("meshrun", store.port, f"job{i}")
        forget_store(store)
        return setup + took

    def plain(i: int, tmp: Path) -> float:
        start = time.perf_counter()
        port = free_port()
        return time.perf_counter() - start + rendezvous("c10d", port, f"plain{i}")

    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    os.environ.setdefault(NONCE_ENV, new_nonce())  # one launch, as meshrun launch sets it
    register()
    variants = {"plain": plain, "signed": signed}
    with tempfile.TemporaryDirectory() as tmp:
        rows = interleaved(
            args.pairs, ("plain", "signed"), lambda v, i: {"s": variants[v](i, Path(tmp))}
        )
    s = paired(rows, "plain", "signed", "s")
    print(
        f"secret + store + 1-node rendezvous, {args.pairs} interleaved pairs: median plain "
        f"{s['plain']:.4f} s, signed {s['signed']:.4f} s, median pair difference "
        f"{s['diff']:+.4f} s"
    )
    return s | {"pairs": rows}


def main() -> None:
    args = parse_args()
    print(f"/proc/loadavg before: {loadavg()}", flush=True)
    modes: dict[str, Callable[[argparse.Namespace], Any]] = {
        "step": mode_step,
        "launch": mode_launch,
        "breakdown": mode_diagnose,
        "insitu": mode_diagnose,
        "secret": mode_secret,
        "secret-parts": mode_secret_parts,
    }
    result = modes[args.mode](args)
    print(f"/proc/loadavg after: {loadavg()}")
    if args.out is not None:
        payload = {"args": {k: str(v) for k, v in vars(args).items()}, "result": result}
        args.out.write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
