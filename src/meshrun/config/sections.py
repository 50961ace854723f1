"""The config's sections: one small dataclass per subsystem, each checking itself.

Every section's ``__post_init__`` runs the checks a TOML file or an override gets, so a
section built in code, read from a file, changed by ``--section.key=value`` or by a
``meshrun launch`` flag goes through the same code (``load.py`` re-runs ``__post_init__``
after it sets keys). Checks that need the world size are in ``world.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, get_type_hints

from meshrun.config.checkpoint_local import check_local_tier
from meshrun.config.fault_tolerance import FaultToleranceConfig
from meshrun.config.fields import ConfigError, ConfigWarning, check_section, key_of, setting
from meshrun.config.job_values import check_job_name, check_run_dir
from meshrun.config.launch_values import check_launch_values
from meshrun.config.monitor import MonitorConfig


@dataclass
class JobConfig:
    """What this run is and where it writes."""

    SECTION: ClassVar[str] = "job"  # the [section] of the TOML file

    def __post_init__(self) -> None:
        check_section(self)
        check_job_name(self.name)
        check_run_dir(self.run_dir)

    name: str = setting(
        "meshrun",
        "Run name, used in the default run directory runs/<name>: letters, digits, '.', '_', "
        "'+' and '-', not starting with '.'.",
    )
    run_dir: str = setting("", "Run directory (metrics, logs, checkpoints). Empty = runs/<name>.")
    seed: int = setting(
        1234, "Seed: model init uses it on every rank; data augmentation adds the rank."
    )
    device: Literal["auto", "cpu", "cuda"] = setting("auto", "auto = cuda if available, else cpu.")
    backend: Literal["auto", "gloo", "nccl"] = setting("auto", "auto = nccl on cuda, gloo on cpu.")
    timeout_s: float = setting(
        600.0, "Process-group timeout in seconds (Gloo's default is 30 min).", min=1
    )
    log_level: Literal["debug", "info", "warning", "error"] = setting("info", "Console log level.")
    cpu_mmap_threshold_kib: int = setting(
        0,
        "CPU device on glibc: host allocations of at least this many KiB are mmapped and "
        "returned to the OS when freed, so the peak RSS follows live memory (glibc's sliding "
        "threshold keeps freed buffers resident); costs page faults (ZeRO-2/3 steps ~15% "
        "slower on the demo). 0 = glibc's default.",
        min=0,
        max=32768,
    )


@dataclass
class ParallelConfig:
    """The parallel layout: one named DeviceMesh (pp, dp_replicate, dp_shard, cp, tp)."""

    SECTION: ClassVar[str] = "parallel"  # the [section] of the TOML file

    def __post_init__(self) -> None:
        check_section(self)

    dp_replicate: int = setting(1, "Replicated data-parallel degree (HSDP outer dim).", min=1)
    dp_shard: int = setting(
        -1, "Sharded data-parallel degree; -1 = what is left of the world.", min=-1
    )
    tp: int = setting(1, "Tensor-parallel degree.", min=1)
    cp: int = setting(
        1,
        "Context-parallel degree: each sample's sequence split over cp ranks, which read the "
        "same batch (docs/parallel.md, Context parallel).",
        min=1,
    )
    pp: int = setting(1, "Pipeline-parallel degree.", min=1)
    ep: int = setting(
        1,
        "Expert-parallel degree for mixture-of-experts models: each MoE layer's experts are "
        "split over groups of ep consecutive data-parallel ranks, tokens exchanged with "
        "all_to_all. Borrowed from the data-parallel ranks (does not multiply the world "
        "size): must divide dp_replicate x dp_shard.",
        min=1,
    )
    zero: int = setting(
        0,
        "ZeRO stage: 0 = DDP, 1 = + sharded optimizer state (ZeroRedundancyOptimizer), "
        "2 = + sharded gradients (FSDP2, no reshard after forward), 3 = + sharded parameters.",
        min=0,
        max=3,
    )
    bucket_cap_mb: float = setting(25.0, "DDP gradient bucket size in MiB.", min=0.001)
    gradient_as_bucket_view: bool = setting(
        True, "DDP: gradients are views into the buckets (saves memory)."
    )
    static_graph: bool = setting(
        False, "DDP: the graph is the same every step (enables optimisations)."
    )
    find_unused_parameters: bool = setting(
        False, "DDP: search for parameters without gradients (slower)."
    )
    cpu_offload: bool = setting(
        False, "FSDP2 (zero 2/3): keep sharded parameters, gradients and optimizer step on CPU."
    )
    activation_checkpoint: int = setting(
        0, "Recompute every k-th block's activations in backward; 0 = off, 1 = every block.", min=0
    )
    memory_limit_gb: float = setting(
        0.0,
        "Memory per device, GB (1e9 bytes), that run.parallelize checks a meta-built model's "
        "traced peak against before step 1 (train/fit.py); 0 = the device's total on CUDA, "
        "no check on CPU; -1 = never check.",
        min=-1.0,
    )
    param_dtype: Literal["float32", "bfloat16", "float16"] = setting(
        "float32",
        "Compute dtype: FSDP2 (zero 2/3) all-gathers parameters in it, DDP runs the forward "
        "under autocast; float16 adds a loss scaler (run.grad_scaler). Master weights stay fp32.",
    )
    reduce_dtype: Literal["float32", "bfloat16", "float16"] = setting(
        "float32", "FSDP2 (zero 2/3): dtype of the gradient reduce-scatter."
    )
    ddp_comm_hook: Literal["none", "fp16", "bf16", "powersgd"] = setting(
        "none", "DDP (zero 0/1): compress the gradient all-reduce."
    )
    powersgd_rank: int = setting(1, "Rank of PowerSGD's low-rank gradient approximation.", min=1)
    sequence_parallel: bool = setting(
        False, "With tp > 1: norms and residual adds inside each block split along the sequence."
    )
    pp_schedule: Literal["gpipe", "1f1b", "interleaved", "zb1p", "zbv", "dualpipev"] = setting(
        "1f1b",
        "Pipeline schedule (pp > 1), torch's: interleaved = interleaved 1F1B; zb1p, zbv, "
        "dualpipev = zero bubble (split backward) with pp_virtual_stages looped stages per "
        "rank (zb1p) or 2 per rank in a V (zbv, dualpipev: pp_microbatches >= 2 pp).",
    )
    pp_microbatches: int = setting(
        2, "Chunks each micro-batch is split into for the pipeline; >= pp.", min=1
    )
    pp_virtual_stages: int = setting(
        2,
        "Stages per rank for the interleaved and zb1p schedules (pp x this <= blocks); zbv "
        "and dualpipev hold 2.",
        min=1,
    )
    fsdp_prefetch: int = setting(
        0,
        "FSDP2: all-gather the next N blocks ahead in forward and backward; 0 = FSDP2's own "
        "one-block implicit prefetch.",
        min=0,
    )
    fsdp_blocks_per_unit: int = setting(
        1,
        "FSDP2: consecutive blocks sharded as one unit (one all-gather and one reduce-scatter "
        "per group): fewer, larger collectives for more unsharded memory at a time.",
        min=1,
    )
    compile: bool = setting(
        False, "torch.compile each block (after TP and AC, before FSDP/DDP); needs a C++ compiler."
    )
    sync_batchnorm: bool = setting(
        False,
        "Convert BatchNorm layers to torch's SyncBatchNorm (statistics over the whole data-"
        "parallel batch) under any data-parallel layout; off: statistics are per rank.",
    )
    loss_parallel: bool = setting(
        False,
        "With tp > 1: the output head split over the vocabulary and cross-entropy on the "
        "sharded logits; compute the loss inside run.loss_parallel() (under pp > 1 "
        "run.pipeline_step does it on the last stage; docs/parallel.md).",
    )


@dataclass
class DataConfig:
    """Batch sizes and the loader. global_batch = micro_batch x accumulation x data-parallel size."""

    SECTION: ClassVar[str] = "data"  # the [section] of the TOML file

    def __post_init__(self) -> None:
        check_section(self)

    global_batch: int = setting(
        0,
        "Samples per optimizer step over all ranks; kept when the world changes. "
        "0 = micro_batch x data-parallel size, derived and printed (meshrun launch derives it "
        "for the world it starts, one number for all worlds of --nnodes MIN:MAX, and writes "
        "it into the resolved config; without a launcher init() derives it); a run that "
        "resumes a checkpoint takes the checkpoint's.",
        min=0,
    )
    micro_batch: int = setting(8, "Samples per forward/backward on one rank.", min=1)
    num_workers: int = setting(0, "DataLoader worker processes per rank.", min=0)
    shuffle: bool = setting(True, "Shuffle the order (a function of seed and epoch only).")
    worker_start: Literal["forkserver", "spawn", "fork"] = setting(
        "forkserver",
        "How loader workers start: forkserver and spawn pickle the dataset to each worker; "
        "fork copies this multi-threaded process and can deadlock a worker as it starts.",
    )


@dataclass
class OptimConfig:
    """Learning rate, its scaling rule and its schedule."""

    SECTION: ClassVar[str] = "optim"  # the [section] of the TOML file

    def __post_init__(self) -> None:
        check_section(self)

    lr: float = setting(
        3e-4, "Base learning rate (at ref_batch when a scaling rule is set).", min=0
    )
    lr_scaling: Literal["none", "linear", "sqrt"] = setting(
        "none", "Scale lr by global_batch/ref_batch."
    )
    ref_batch: int = setting(
        0, "Reference global batch of `lr`; 0 = global_batch (no scaling).", min=0
    )
    warmup_steps: int = setting(0, "Linear warmup steps from 0 to the peak lr.", min=0)
    decay: Literal["cosine", "linear", "constant"] = setting("cosine", "Decay after warmup.")
    min_lr_ratio: float = setting(0.1, "Final lr as a fraction of the peak lr.", min=0, max=1)
    steps: int = setting(100, "Total optimizer steps of the run (the schedule's length).", min=1)
    weight_decay: float = setting(
        0.0, "Weight decay (for helpers that build the optimizer).", min=0
    )
    grad_clip: float = setting(0.0, "Clip the global gradient norm to this value; 0 = off.", min=0)


@dataclass
class CheckpointConfig:
    """Where and when checkpoints are written, and what is resumed (docs/checkpoint.md)."""

    SECTION: ClassVar[str] = "checkpoint"  # the [section] of the TOML file

    def __post_init__(self) -> None:
        check_section(self)
        check_local_tier(self)

    dir: str = setting("", "Checkpoint directory. Empty = <run_dir>/checkpoints.")
    interval: int = setting(
        0, "Save every N optimizer steps; 0 = only at the end when asked.", min=0
    )
    async_: bool = setting(
        False, "Interval saves: stage to CPU memory, write in the background, commit later."
    )
    keep_last: int = setting(3, "Keep the newest N checkpoints.", min=1)
    keep_every: int = setting(0, "Also keep every M-th step's checkpoint; 0 = none.", min=0)
    resume: str = setting("auto", "auto = newest valid checkpoint, never, or a path.")
    init_from: str = setting(
        "",
        "A fresh run (nothing to resume) starts from these weights: a meshrun checkpoint "
        "directory or a Hugging Face directory; weights only, no optimizer or step.",
    )
    allow_new_global_batch: bool = setting(
        False,
        "Resume a checkpoint trained with another data.global_batch: the LR is rescaled by "
        "optim.lr_scaling (logged); false = such a resume is an error.",
    )
    on_error: Literal["stop", "warn"] = setting(
        "stop",
        "A failed save (e.g. disk full): stop = raise on every rank, warn = log and train on.",
    )
    on_signal: bool = setting(
        True, "On SIGTERM/SIGUSR1 (preemption) save at the next step boundary and exit 0."
    )
    local_interval: int = setting(
        0,
        "Node-local snapshot every N optimizer steps, each rank's shard also kept by a rank on "
        "the next node; restored when newer than the shared checkpoint; 0 = off. Below "
        "interval when that is set (the shared checkpoint stays the durable one).",
        min=0,
    )
    local_dir: str = setting(
        "",
        "Node-local directory (absolute) of those snapshots: RAM disk or local NVMe; {node} "
        "becomes the node index. Empty = /dev/shm/meshrun-<uid>/<hash of the checkpoint dir>.",
    )
    local_ranks_per_node: int = setting(
        0,
        "Ranks per node for the local tier (rank r's shard goes to rank r + this); 0 = the "
        "launcher's local world size. Set to simulate nodes on one host.",
        min=0,
    )
    local_keep: bool = setting(
        False,
        "Keep the node-local snapshots after a run that ends well; false = remove them then "
        "(in /dev/shm they hold RAM). A failed run always keeps them for its restart.",
    )


@dataclass
class MetricsConfig:
    """What is measured and where it goes."""

    SECTION: ClassVar[str] = "metrics"  # the [section] of the TOML file

    def __post_init__(self) -> None:
        check_section(self)

    log_every: int = setting(1, "Write metrics every N optimizer steps.", min=1)
    progress: bool = setting(True, "Progress bar on a terminal (plain lines otherwise).")
    jsonl: bool = setting(True, "Write <run_dir>/metrics.jsonl.")
    tensorboard: bool = setting(
        False, "Also write the step metrics as TensorBoard scalars (pip install tensorboard)."
    )
    tokens_per_sample: int = setting(
        0,
        "Tokens in one sample, for tokens/s and per-token MFU when meshrun cannot count them "
        "(integer-id inputs are counted); 0 = unknown: samples/s only.",
        min=0,
    )
    flops_per_sample: float = setting(
        0.0,
        "Training FLOPs (forward + backward) for one sample, for MFU on any workload; "
        "0 = from the model (causal LMs) or no MFU.",
        min=0,
    )
    peak_flops: float = setting(
        0.0,
        "Peak FLOP/s of one device, for MFU; 0 = the planner's datasheet figure on a known GPU "
        "(none on CPU).",
        min=0,
    )


@dataclass
class LaunchConfig:
    """How `meshrun launch` starts the workers (through the torchrun elastic agent)."""

    SECTION: ClassVar[str] = "launch"  # the [section] of the TOML file

    def __post_init__(self) -> None:
        check_section(self)
        check_launch_values(self)

    nproc_per_node: int = setting(
        0, "Processes per node; 0 = number of GPUs, else 2 on CPU.", min=0
    )
    nnodes: str = setting("1", "Number of nodes, or MIN:MAX for elastic jobs.")
    max_restarts: int = setting(0, "Restarts of the worker group after a failure.", min=0)
    omp_num_threads: int = setting(0, "OMP_NUM_THREADS per worker; 0 = cores / processes.", min=0)
    rdzv_endpoint: str = setting(
        "", "Multi-node: HOST:PORT of the rendezvous store, on one of the nodes (docs/launch.md)."
    )
    rdzv_id: str = setting("meshrun", "Multi-node: job id, the same on every node of one job.")
    node_rank: int = setting(
        0, "Multi-node: this node's rank in [0, nnodes); elastic jobs ignore it.", min=0
    )
    interface: str = setting(
        "", "Multi-node: network interface to use; empty = the one routing to the endpoint."
    )
    join_timeout_s: float = setting(
        300.0, "Multi-node: give up when the nodes have not all joined after this long.", min=1
    )
    rdzv_conf: str = setting(
        "",
        "Multi-node: extra torchrun --rdzv-conf KEY=VALUE,... (e.g. last_call_timeout=5); "
        "they win over meshrun's own (is_host, join_timeout).",
    )


@dataclass
class Config:
    """The whole configuration tree."""

    job: JobConfig = field(default_factory=JobConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)

    def __post_init__(self) -> None:
        validate(self)

    def resolved_run_dir(self) -> Path:
        return Path(self.job.run_dir or f"runs/{self.job.name}")

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {
            sec.name: {
                key_of(f): getattr(getattr(self, sec.name), f.name)
                for f in dataclasses.fields(getattr(self, sec.name))
            }
            for sec in dataclasses.fields(self)
        }

    def digest(self) -> str:
        """A short hash of the effective config (nodes compare it; manifests record it)."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


@functools.cache
def section_types() -> dict[str, type]:
    """``{"job": JobConfig, ...}`` in the order of the file."""
    hints = get_type_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config)}


def recheck(section: Any) -> None:
    """Run a section's own ``__post_init__`` again: the checks it got when it was made."""
    section.__post_init__()


def validate(cfg: Config) -> Config:
    """Check the whole tree again: each section is of its type and passes its own
    ``__post_init__``. ``init()`` and the launcher run it (through ``validate_for_world``),
    so attributes set after construction (``cfg.data.micro_batch = 0``) are caught too."""
    for name, section_type in section_types().items():
        section = getattr(cfg, name)
        if not isinstance(section, section_type):
            raise ConfigError(
                f"config section {name!r} is a {type(section).__name__}, not a "
                f"{section_type.__name__}; pass {name}={section_type.__name__}(...)"
            )
        recheck(section)
    check_across_sections(cfg)
    return cfg


def check_across_sections(cfg: Config) -> None:
    """Keys that are only wrong together. Checked on the whole tree (not per section) so that
    a TOML file's value may be fixed by a later override before anything runs."""
    if cfg.optim.warmup_steps > cfg.optim.steps:
        # A warning, not an error: short runs of a longer config (smoke tests, the demo's
        # --steps, scale-test) keep their schedule; the run says so instead of staying silent.
        warnings.warn(
            f"optim.warmup_steps = {cfg.optim.warmup_steps} exceeds optim.steps = "
            f"{cfg.optim.steps}: the run ends inside its warmup and never reaches optim.lr; "
            f"set optim.warmup_steps <= {cfg.optim.steps} or raise optim.steps",
            ConfigWarning,
            stacklevel=2,
        )
    p = cfg.parallel
    if p.ddp_comm_hook != "none" and p.zero >= 2:
        raise ConfigError(
            f"parallel.ddp_comm_hook = {p.ddp_comm_hook!r} compresses DDP's all-reduce, but "
            f"parallel.zero = {p.zero} runs FSDP2, which has no comm hook (its reduce-scatter "
            "dtype is parallel.reduce_dtype); set parallel.ddp_comm_hook='none' (and "
            f"parallel.reduce_dtype='{'bfloat16' if p.ddp_comm_hook == 'bf16' else 'float16'}' "
            "to compress) or parallel.zero <= 1"
        )
