"""``meshrun slurm submit``'s sbatch script (pure rendering from a :class:`SubmitSpec`, checked
before anything is written) and the one call that hands it to ``sbatch``. By default the
script runs ``meshrun launch`` once per node, which derives the topology as launch/slurm/job.py
describes; ``launcher="mpirun"`` or ``"srun"`` starts every worker directly instead (one SLURM
task each), and ``meshrun.init()`` reads the ranks from Open MPI's or SLURM's variables
(runtime/launcher_env.py, docs/slurm.md)."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from meshrun.launch.slurm.job import SlurmError

DEFAULT_SIGNAL_BEFORE_S = 120
# "meshrun": srun starts one meshrun launch per node (torchrun's agent: restarts, elastic);
# "mpirun": Open MPI's mpirun starts every worker; "srun": srun --mpi=pmix starts every worker.
LAUNCHERS = ("meshrun", "mpirun", "srun")

# Characters refused in #SBATCH values (see SubmitSpec._validate_header).
_NAME_BAD = re.compile(r"[^A-Za-z0-9_.+,-]")
_LIST_NOTE = {"--partition": " (several partitions: comma-separated)"}
_PATH_BAD = re.compile(r"[\s\x00-\x1f\x7f-\x9f\"'\\#]")
CONFIG_END = "MESHRUN_CONFIG_TOML"  # the here-document's terminator in the script

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
    launcher: str = "meshrun"  # one of LAUNCHERS
    # mpirun/srun: the resolved config (TOML) the script writes to config_path and exports as
    # MESHRUN_CONFIG, as meshrun launch does on the node; no meshrun process runs there first.
    config_toml: str = ""
    config_path: str = ""

    @property
    def direct(self) -> bool:
        """Workers started by mpirun/srun themselves, one SLURM task each (no meshrun launch)."""
        return self.launcher != "meshrun"

    def validate(self) -> None:
        """Every flag checked before a file is written."""
        if self.launcher not in LAUNCHERS:
            raise SlurmError(f"--launcher {self.launcher!r} is not one of {', '.join(LAUNCHERS)}")
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
        self._validate_direct()
        self._validate_header()

    def _validate_header(self) -> None:
        """What goes into an ``#SBATCH`` line: sbatch reads those lines itself, not a shell, so
        nothing there can be quoted (whitespace ends the value, ``#`` starts a comment, ``"``
        and ``\\`` are its own quoting, and a newline would start a shell line that runs
        and ends the ``#SBATCH`` block). Names get SLURM's own characters; paths anything
        but those."""
        names = (
            ("--job-name", self.job_name),
            ("--partition", self.partition),
            ("--account", self.account),
        )
        for flag, value in names:
            if bad := _NAME_BAD.search(value):
                raise SlurmError(
                    f"{flag} {value!r}: {bad.group()!r} cannot go into an #SBATCH line; a SLURM "
                    f"name is letters, digits and . _ + -{_LIST_NOTE.get(flag, '')}"
                )
        for flag, value in (("--output", self.output_dir), ("the working directory", self.workdir)):
            if bad := _PATH_BAD.search(value):
                raise SlurmError(
                    f"{flag} {value!r}: {bad.group()!r} cannot go into an #SBATCH line (sbatch "
                    "reads it without a shell: no quoting); use a directory whose path has no "
                    "whitespace, control characters, quotes, backslashes or #"
                )

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

    def _validate_direct(self) -> None:
        if self.direct and self.cpus % self.nproc_per_node:
            raise SlurmError(
                f"--cpus-per-task {self.cpus_per_task} with --launcher {self.launcher}: each of "
                f"the {self.nproc_per_node} processes per node is its own SLURM task with the "
                f"same CPUs; give a multiple of --nproc-per-node ({self.nproc_per_node}, "
                f"{2 * self.nproc_per_node}, ...)"
            )

    @property
    def cpus(self) -> int:
        """CPUs per node."""
        return self.cpus_per_task or self.nproc_per_node

    @property
    def task_cpus(self) -> int:
        """CPUs per SLURM task: a node's under meshrun launch, a process's under mpirun/srun."""
        return self.cpus // self.nproc_per_node if self.direct else self.cpus


def check_direct_config(launcher: str, max_restarts: int, replica_groups: int) -> None:
    """What only meshrun launch (torchrun's agent) does, refused for mpirun/srun: they stop the
    job at the first failed process and start nothing again."""
    if launcher == "meshrun":
        return
    if max_restarts:
        raise SlurmError(
            f"launch.max_restarts = {max_restarts} with --launcher {launcher}: restarting the "
            f"workers is torchrun's agent's, and {launcher} ends the job at the first failure; "
            "use --launcher meshrun, or launch.max_restarts = 0 (--requeue still resumes a "
            "preempted job from its checkpoint)"
        )
    if replica_groups > 1:
        raise SlurmError(
            f"fault_tolerance.replica_groups = {replica_groups} with --launcher {launcher}: "
            "replica groups are torchrun jobs that meshrun launch starts and heals; use "
            "--launcher meshrun, or fault_tolerance.replica_groups = 1"
        )


def _sbatch_header(spec: SubmitSpec) -> list[str]:
    out = Path(spec.output_dir)
    # One meshrun launch per node, which starts the processes; or one task per process.
    tasks = spec.nproc_per_node if spec.direct else 1
    lines = [
        f"--job-name={spec.job_name}",
        f"--nodes={spec.nodes}",
        f"--ntasks-per-node={tasks}",
        f"--cpus-per-task={spec.task_cpus}",
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
    return argv + worker_argv(spec)[1:]


def worker_argv(spec: SubmitSpec) -> list[str]:
    """The command of one worker: the script (or module) and its arguments."""
    target = ["-m", spec.target] if spec.module else [spec.target]
    return [spec.python, *target, *spec.script_args]


_START = {
    "meshrun": """\
# One task per node: each runs meshrun launch, which derives nodes, node rank, master address
# and port from SLURM and starts {nproc} processes through torchrun's agent.
srun --ntasks-per-node=1 --cpus-per-task={cpus} --kill-on-bad-exit=1 --open-mode=append \\
    --output={node_out} \\
    {command}""",
    "srun": """\
# One task per process: meshrun.init() reads its rank from SLURM_PROCID, rank 0's host from
# the step's node list and a port from the job id; --mpi=pmix wires up MPI for a script that
# uses it (SLURM's pmix plugin needs libpmix: Debian's libpmix-dev).
srun --mpi=pmix --ntasks-per-node={nproc} --cpus-per-task={cpus} --kill-on-bad-exit=1 \\
    --open-mode=append --output={node_out} \\
    {command}""",
    "mpirun": """\
# Open MPI's mpirun starts {world} processes, {nproc} per node, on the allocation's nodes (it
# reads them from SLURM); meshrun.init() reads the ranks from OMPI_COMM_WORLD_* and finds rank
# 0's address and a free port over mpi4py (docs/mpirun.md). No binding to cores, as under
# torchrun. Every rank's output goes to this script's output file.
mpirun -np {world} --map-by ppr:{nproc}:node --bind-to none \\
    -x OMP_NUM_THREADS -x MESHRUN_CONFIG \\
    {command}""",
}

# The job secret for every node's meshrun launch (docs/security.md): made in the batch step,
# once per job (and per requeue), from the kernel's random bytes; never printed, never on a
# command line (a shell assignment and `export` are builtins), and handed to every task in
# srun's environment. Made here rather than before sbatch: SLURM may store the submitting
# environment (AccountingStoreFlags=job_env), not what this script exports.
_SECRET = """\
# The job secret, one per job: every node's meshrun launch gets it in srun's environment
# (docs/security.md). One exported before sbatch is kept. Never printed, even under set -x.
case $- in *x*) MESHRUN_XTRACE=1; {{ set +x; }} 2>/dev/null ;; *) MESHRUN_XTRACE=0 ;; esac
if [ -z "${{MESHRUN_JOB_SECRET:-}}" ] && [ -z "${{MESHRUN_JOB_SECRET_FILE:-}}" ]; then
    MESHRUN_JOB_SECRET="$(od -An -vtx1 -N32 /dev/urandom | tr -d ' \\n')"
    if [ "${{#MESHRUN_JOB_SECRET}}" -ne 64 ]; then
        echo "meshrun: could not make the job secret from /dev/urandom" >&2
        exit 1
    fi
    export MESHRUN_JOB_SECRET
fi
if [ "$MESHRUN_XTRACE" = 1 ]; then set -x; fi

"""

_CONFIG = """\
# The resolved config (file, --set and the script's overrides) for every worker, as meshrun
# launch writes it on the node; and OMP_NUM_THREADS as it sets it (CPUs per process).
mkdir -p {config_dir}
cat > {config_path} <<'{end}'
{toml}
{end}
export MESHRUN_CONFIG={config_path}
export OMP_NUM_THREADS="${{OMP_NUM_THREADS:-{cpus}}}"

"""

_BODY = """\
{start} &
WORKERS_PID=$!

# Near the time limit SLURM sends USR1 to this shell (--signal=B:USR1@{sig}); {launcher} passes it
# on to the workers, which save a checkpoint at the next step and exit 0.
PREEMPTED=0
on_usr1() {{
    echo "meshrun: SIGUSR1 from SLURM (time limit in {sig} s): workers checkpoint and stop"
    PREEMPTED=1
    kill -USR1 "$WORKERS_PID" 2>/dev/null
}}
trap on_usr1 USR1

# A trapped signal interrupts `wait`: wait again until {launcher} has really finished.
RC=0
wait "$WORKERS_PID" || RC=$?
while kill -0 "$WORKERS_PID" 2>/dev/null; do RC=0; wait "$WORKERS_PID" || RC=$?; done
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


def _start_lines(spec: SubmitSpec) -> str:
    command = launch_argv(spec) if spec.launcher == "meshrun" else worker_argv(spec)
    start = _START[spec.launcher].format(
        nproc=spec.nproc_per_node,
        world=spec.nodes * spec.nproc_per_node,
        cpus=spec.task_cpus,
        node_out=shlex.quote(str(Path(spec.output_dir) / "%x-%j-node%n.out")),
        command=shlex.join(command),
    )
    if not spec.direct:
        return _SECRET.format() + start
    if not spec.config_toml or not spec.config_path:
        raise SlurmError(f"--launcher {spec.launcher}: the spec has no resolved config to pass")
    if CONFIG_END in spec.config_toml.splitlines():  # it would end the here-document early
        raise SlurmError(f"the config holds a line {CONFIG_END!r}: change that value")
    config = _CONFIG.format(
        end=CONFIG_END,
        config_dir=shlex.quote(str(Path(spec.config_path).parent)),
        config_path=shlex.quote(spec.config_path),
        toml=spec.config_toml.rstrip("\n"),
        cpus=spec.task_cpus,
    )
    return config + start


def render_sbatch(spec: SubmitSpec) -> str:
    """The whole sbatch script for ``spec`` (validated first)."""
    spec.validate()
    body = _BODY.format(
        start=_start_lines(spec),
        launcher="srun" if spec.launcher == "meshrun" else spec.launcher,
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


def output_files(spec: SubmitSpec, job_id: str) -> str:
    """Where the job's output goes, for the line ``meshrun slurm submit`` prints."""
    out = Path(spec.output_dir)
    batch = out / f"{spec.job_name}-{job_id}.out"
    if spec.launcher == "mpirun":
        return f"{batch} (batch script and every rank)"
    return f"{batch} (batch script), {out / f'{spec.job_name}-{job_id}-node<N>.out'} (one per node)"


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
