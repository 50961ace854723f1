"""``meshrun slurm submit``'s sbatch script (pure rendering from a :class:`SubmitSpec`, checked
before anything is written) and the one call that hands it to ``sbatch``. The script runs
``meshrun launch`` once per node, which derives the topology as launch/slurm.py describes."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from meshrun.launch.slurm import SlurmError

DEFAULT_SIGNAL_BEFORE_S = 120

_TIME_FORMATS = (
    r"(?P<m>\d+)",
    r"(?P<m>\d+):(?P<s>\d+)",
    r"(?P<h>\d+):(?P<m>\d+):(?P<s>\d+)",
    r"(?P<d>\d+)-(?P<h>\d+)",
    r"(?P<d>\d+)-(?P<h>\d+):(?P<m>\d+)",
    r"(?P<d>\d+)-(?P<h>\d+):(?P<m>\d+):(?P<s>\d+)",
)


def time_limit_seconds(text: str) -> int | None:
    """SLURM's --time formats in seconds (None = unlimited); a bad one is an error."""
    if text.upper() in ("INFINITE", "UNLIMITED"):
        return None
    for pattern in _TIME_FORMATS:
        m = re.fullmatch(pattern, text)
        if m:
            parts = {k: int(v) for k, v in m.groupdict().items() if v is not None}
            return (
                parts.get("d", 0) * 86400
                + parts.get("h", 0) * 3600
                + parts.get("m", 0) * 60
                + parts.get("s", 0)
            )
    raise SlurmError(
        f"--time {text!r} is not a SLURM time: use MINUTES, MM:SS, HH:MM:SS, D-HH, D-HH:MM or "
        "D-HH:MM:SS (e.g. --time 2:00:00)"
    )


@dataclass
class SubmitSpec:
    """One ``meshrun slurm submit``; ``render_sbatch`` turns it into the script."""

    target: str  # script path, or module with module=True
    module: bool = False
    script_args: list[str] = field(default_factory=list)
    nodes: int = 1
    nproc_per_node: int = 2
    gpus_per_node: int = 0
    cpus_per_task: int = 0  # 0 = one CPU per process
    partition: str = ""
    time: str = ""
    account: str = ""
    job_name: str = "meshrun"
    requeue: bool = False
    signal_before_s: int = DEFAULT_SIGNAL_BEFORE_S
    output_dir: str = "runs/meshrun/slurm"
    workdir: str = "."
    python: str = sys.executable
    config: str = ""  # passed to meshrun launch --config
    sets: list[str] = field(default_factory=list)  # --set SECTION.KEY=VALUE

    def validate(self) -> None:
        """Every flag checked before a file is written."""
        for name, value, low in (
            ("--nodes", self.nodes, 1),
            ("--nproc-per-node", self.nproc_per_node, 1),
            ("--gpus-per-node", self.gpus_per_node, 0),
            ("--cpus-per-task", self.cpus_per_task, 0),
        ):
            if value < low:
                raise SlurmError(f"{name} {value} is not allowed: must be >= {low}")
        if self.gpus_per_node and self.nproc_per_node > self.gpus_per_node:
            raise SlurmError(
                f"--nproc-per-node {self.nproc_per_node} exceeds --gpus-per-node "
                f"{self.gpus_per_node}: one process per GPU at most"
            )
        self._validate_signal()
        if not re.fullmatch(r"[\w.+-]+", self.job_name):
            raise SlurmError(f"--job-name {self.job_name!r}: use letters, digits, . _ + -")

    def _validate_signal(self) -> None:
        limit = time_limit_seconds(self.time) if self.time else None
        if not 0 <= self.signal_before_s <= 65535:  # SLURM's own bound on sig_time
            raise SlurmError(
                f"--signal-before {self.signal_before_s} is not allowed: 0 (off) to 65535 s"
            )
        if limit is not None and self.signal_before_s >= limit:
            raise SlurmError(
                f"--signal-before {self.signal_before_s} s is not before the end of --time "
                f"{self.time} ({limit} s): lower it or give a longer --time"
            )

    @property
    def cpus(self) -> int:
        return self.cpus_per_task or self.nproc_per_node


def _sbatch_header(spec: SubmitSpec) -> list[str]:
    out = Path(spec.output_dir)
    lines = [
        f"--job-name={spec.job_name}",
        f"--nodes={spec.nodes}",
        "--ntasks-per-node=1",  # one meshrun launch per node; it starts the processes
        f"--cpus-per-task={spec.cpus}",
        f"--output={out / '%x-%j.out'}",
        "--open-mode=append",  # a requeued job adds to its output files, does not erase them
        f"--chdir={spec.workdir}",
    ]
    if spec.gpus_per_node:
        lines.append(f"--gpus-per-node={spec.gpus_per_node}")
    lines += [f"--{k}={v}" for k, v in (("partition", spec.partition), ("account", spec.account))]
    lines = [line for line in lines if not line.endswith("=")]
    if spec.time:
        lines.append(f"--time={spec.time}")
    if spec.signal_before_s:
        # B: signals the batch shell only; it forwards USR1 to the step (see the trap below).
        lines.append(f"--signal=B:USR1@{spec.signal_before_s}")
    lines.append("--requeue" if spec.requeue else "--no-requeue")
    return [f"#SBATCH {line}" for line in lines]


def launch_argv(spec: SubmitSpec) -> list[str]:
    """The ``meshrun launch`` command each node runs (the topology comes from SLURM)."""
    argv = [spec.python, "-m", "meshrun", "launch", "--nproc-per-node", str(spec.nproc_per_node)]
    if spec.config:
        argv += ["--config", spec.config]
    for kv in spec.sets:
        argv += ["--set", kv]
    argv += ["-m", spec.target] if spec.module else [spec.target]
    return argv + spec.script_args


_BODY = """\
# One task per node: each runs meshrun launch, which derives nodes, node rank, master address
# and port from SLURM and starts {nproc} processes through torchrun's agent.
srun --ntasks-per-node=1 --cpus-per-task={cpus} --kill-on-bad-exit=1 --open-mode=append \\
    --output={node_out} \\
    {launch} &
SRUN_PID=$!

# Near the time limit SLURM sends USR1 to this shell (--signal=B:USR1@{sig}); srun passes it to
# meshrun launch and its workers, which save a checkpoint at the next step and exit 0.
PREEMPTED=0
on_usr1() {{
    echo "meshrun: SIGUSR1 from SLURM (time limit in {sig} s): workers checkpoint and stop"
    PREEMPTED=1
    kill -USR1 "$SRUN_PID" 2>/dev/null
}}
trap on_usr1 USR1

# A trapped signal interrupts `wait`: wait again until srun has really finished.
RC=0
wait "$SRUN_PID" || RC=$?
while kill -0 "$SRUN_PID" 2>/dev/null; do RC=0; wait "$SRUN_PID" || RC=$?; done
{requeue}echo "meshrun: job $SLURM_JOB_ID finished with exit code $RC"
exit "$RC"
"""

_REQUEUE = """\
if [ "$PREEMPTED" = 1 ] && [ "$RC" = 0 ]; then
    # The checkpoint is written: back into the queue; the next start resumes from it.
    echo "meshrun: requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
fi
"""


def render_sbatch(spec: SubmitSpec) -> str:
    """The whole sbatch script for ``spec`` (validated first)."""
    spec.validate()
    node_out = Path(spec.output_dir) / "%x-%j-node%n.out"
    body = _BODY.format(
        nproc=spec.nproc_per_node,
        cpus=spec.cpus,
        node_out=shlex.quote(str(node_out)),
        launch=shlex.join(launch_argv(spec)),
        sig=spec.signal_before_s,
        requeue=_REQUEUE if spec.requeue else "",
    )
    head = [
        "#!/bin/bash",
        "# Written by `meshrun slurm submit`; submit it again with: sbatch THIS_FILE",
        *_sbatch_header(spec),
        "",
        "set -u",
    ]
    return "\n".join(head) + "\n" + body


def submit(script: Path, sbatch: Sequence[str] = ("sbatch",)) -> str:
    """``sbatch --parsable SCRIPT``; returns the job id."""
    if shutil.which(sbatch[0]) is None:
        raise SlurmError(
            f"{sbatch[0]} not found: run meshrun slurm submit on a SLURM login node, or use "
            "--dry-run to print the script"
        )
    r = subprocess.run(
        [*sbatch, "--parsable", str(script)], capture_output=True, text=True, timeout=120
    )
    if r.returncode != 0:
        raise SlurmError(f"sbatch rejected {script}: {r.stderr.strip() or r.stdout.strip()}")
    return r.stdout.strip().split(";")[0]  # "ID" or "ID;CLUSTER"
