"""Configuration: a tree of small dataclasses, read from TOML, overridden by ``--section.key=value``.

The launcher resolves the config once (file + overrides), validates it before any process is
spawned, and writes it to one file whose path reaches the workers as ``MESHRUN_CONFIG``: one
channel, not a spray of environment variables.

Every error names the key, the value, what is allowed and how to fix it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import sys
import types
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

CONFIG_ENV = "MESHRUN_CONFIG"


class ConfigError(ValueError):
    """A bad config key or value; the message names the key, the value and what is allowed."""


def _f(default: Any, doc: str, **checks: Any) -> Any:
    """A dataclass field carrying its documentation and range checks (``min``, ``max``)."""
    return field(default=default, metadata={"doc": doc, **checks})


@dataclass
class JobConfig:
    """What this run is and where it writes."""

    def __post_init__(self) -> None:
        check_section(self)

    name: str = _f("meshrun", "Run name, used in the default run directory.")
    run_dir: str = _f("", "Run directory (metrics, logs, checkpoints). Empty = runs/<name>.")
    seed: int = _f(1234, "Seed: model init uses it on every rank; data augmentation adds the rank.")
    device: Literal["auto", "cpu", "cuda"] = _f("auto", "auto = cuda if available, else cpu.")
    backend: Literal["auto", "gloo", "nccl"] = _f("auto", "auto = nccl on cuda, gloo on cpu.")
    timeout_s: float = _f(
        600.0, "Process-group timeout in seconds (Gloo's default is 30 min).", min=1
    )
    log_level: Literal["debug", "info", "warning", "error"] = _f("info", "Console log level.")
    cpu_mmap_threshold_kib: int = _f(
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
    """The parallel layout: one named DeviceMesh (pp, dp_replicate, dp_shard, tp)."""

    def __post_init__(self) -> None:
        check_section(self)

    dp_replicate: int = _f(1, "Replicated data-parallel degree (HSDP outer dim).", min=1)
    dp_shard: int = _f(-1, "Sharded data-parallel degree; -1 = what is left of the world.", min=-1)
    tp: int = _f(1, "Tensor-parallel degree.", min=1)
    pp: int = _f(1, "Pipeline-parallel degree.", min=1)
    zero: int = _f(
        0,
        "ZeRO stage: 0 = DDP, 1 = + sharded optimizer state (ZeroRedundancyOptimizer), "
        "2 = + sharded gradients (FSDP2, no reshard after forward), 3 = + sharded parameters.",
        min=0,
        max=3,
    )
    bucket_cap_mb: float = _f(25.0, "DDP gradient bucket size in MiB.", min=0.001)
    gradient_as_bucket_view: bool = _f(
        True, "DDP: gradients are views into the buckets (saves memory)."
    )
    static_graph: bool = _f(False, "DDP: the graph is the same every step (enables optimisations).")
    find_unused_parameters: bool = _f(
        False, "DDP: search for parameters without gradients (slower)."
    )
    cpu_offload: bool = _f(
        False, "FSDP2 (zero 2/3): keep sharded parameters, gradients and optimizer step on CPU."
    )
    activation_checkpoint: int = _f(
        0, "Recompute every k-th block's activations in backward; 0 = off, 1 = every block.", min=0
    )
    param_dtype: Literal["float32", "bfloat16", "float16"] = _f(
        "float32",
        "Compute dtype: FSDP2 (zero 2/3) all-gathers parameters in it, DDP runs the forward "
        "under autocast; float16 adds a loss scaler (run.grad_scaler). Master weights stay fp32.",
    )
    reduce_dtype: Literal["float32", "bfloat16", "float16"] = _f(
        "float32", "FSDP2 (zero 2/3): dtype of the gradient reduce-scatter."
    )
    ddp_comm_hook: Literal["none", "fp16", "bf16", "powersgd"] = _f(
        "none", "DDP (zero 0/1): compress the gradient all-reduce."
    )
    powersgd_rank: int = _f(1, "Rank of PowerSGD's low-rank gradient approximation.", min=1)
    sequence_parallel: bool = _f(
        False, "With tp > 1: norms and residual adds inside each block split along the sequence."
    )
    pp_schedule: Literal["gpipe", "1f1b", "interleaved"] = _f(
        "1f1b", "Pipeline schedule (pp > 1); interleaved = interleaved 1F1B."
    )
    pp_microbatches: int = _f(
        2, "Chunks each micro-batch is split into for the pipeline; >= pp.", min=1
    )
    pp_virtual_stages: int = _f(
        2, "Stages per rank for the interleaved schedule (pp x this <= blocks).", min=1
    )
    fsdp_prefetch: int = _f(
        0,
        "FSDP2: all-gather the next N blocks ahead in forward and backward; 0 = FSDP2's own "
        "one-block implicit prefetch.",
        min=0,
    )
    fsdp_blocks_per_unit: int = _f(
        1,
        "FSDP2: consecutive blocks sharded as one unit (one all-gather and one reduce-scatter "
        "per group): fewer, larger collectives for more unsharded memory at a time.",
        min=1,
    )
    compile: bool = _f(
        False, "torch.compile each block (after TP and AC, before FSDP/DDP); needs a C++ compiler."
    )
    sync_batchnorm: bool = _f(
        False,
        "Convert BatchNorm layers to torch's SyncBatchNorm (statistics over the whole data-"
        "parallel batch) under any data-parallel layout; off: statistics are per rank.",
    )
    loss_parallel: bool = _f(
        False,
        "With tp > 1: the output head split over the vocabulary and cross-entropy on the "
        "sharded logits; compute the loss inside run.loss_parallel() (under pp > 1 "
        "run.pipeline_step does it on the last stage; docs/parallel.md).",
    )


@dataclass
class DataConfig:
    """Batch sizes and the loader. global_batch = micro_batch x accumulation x data-parallel size."""

    def __post_init__(self) -> None:
        check_section(self)

    global_batch: int = _f(
        0,
        "Samples per optimizer step over all ranks; kept when the world changes. "
        "0 = micro_batch x data-parallel size, derived and printed (meshrun launch derives it "
        "for the world it starts, one number for all worlds of --nnodes MIN:MAX, and writes "
        "it into the resolved config; without a launcher init() derives it); a run that "
        "resumes a checkpoint takes the checkpoint's.",
        min=0,
    )
    micro_batch: int = _f(8, "Samples per forward/backward on one rank.", min=1)
    num_workers: int = _f(0, "DataLoader worker processes per rank.", min=0)
    shuffle: bool = _f(True, "Shuffle the order (a function of seed and epoch only).")


@dataclass
class OptimConfig:
    """Learning rate, its scaling rule and its schedule."""

    def __post_init__(self) -> None:
        check_section(self)

    lr: float = _f(3e-4, "Base learning rate (at ref_batch when a scaling rule is set).", min=0)
    lr_scaling: Literal["none", "linear", "sqrt"] = _f(
        "none", "Scale lr by global_batch/ref_batch."
    )
    ref_batch: int = _f(0, "Reference global batch of `lr`; 0 = global_batch (no scaling).", min=0)
    warmup_steps: int = _f(0, "Linear warmup steps from 0 to the peak lr.", min=0)
    decay: Literal["cosine", "linear", "constant"] = _f("cosine", "Decay after warmup.")
    min_lr_ratio: float = _f(0.1, "Final lr as a fraction of the peak lr.", min=0, max=1)
    steps: int = _f(100, "Total optimizer steps of the run (the schedule's length).", min=1)
    weight_decay: float = _f(0.0, "Weight decay (for helpers that build the optimizer).", min=0)
    grad_clip: float = _f(0.0, "Clip the global gradient norm to this value; 0 = off.", min=0)


@dataclass
class CheckpointConfig:
    """Where and when checkpoints are written, and what is resumed (docs/checkpoint.md)."""

    def __post_init__(self) -> None:
        check_section(self)

    dir: str = _f("", "Checkpoint directory. Empty = <run_dir>/checkpoints.")
    interval: int = _f(0, "Save every N optimizer steps; 0 = only at the end when asked.", min=0)
    async_: bool = _f(
        False, "Interval saves: stage to CPU memory, write in the background, commit later."
    )
    keep_last: int = _f(3, "Keep the newest N checkpoints.", min=1)
    keep_every: int = _f(0, "Also keep every M-th step's checkpoint; 0 = none.", min=0)
    resume: str = _f("auto", "auto = newest valid checkpoint, never, or a path.")
    allow_new_global_batch: bool = _f(
        False,
        "Resume a checkpoint trained with another data.global_batch: the LR is rescaled by "
        "optim.lr_scaling (logged); false = such a resume is an error.",
    )
    on_error: Literal["stop", "warn"] = _f(
        "stop",
        "A failed save (e.g. disk full): stop = raise on every rank, warn = log and train on.",
    )
    on_signal: bool = _f(
        True, "On SIGTERM/SIGUSR1 (preemption) save at the next step boundary and exit 0."
    )


@dataclass
class MetricsConfig:
    """What is measured and where it goes."""

    def __post_init__(self) -> None:
        check_section(self)

    log_every: int = _f(1, "Write metrics every N optimizer steps.", min=1)
    progress: bool = _f(True, "Progress bar on a terminal (plain lines otherwise).")
    jsonl: bool = _f(True, "Write <run_dir>/metrics.jsonl.")
    tensorboard: bool = _f(
        False, "Also write the step metrics as TensorBoard scalars (pip install tensorboard)."
    )
    tokens_per_sample: int = _f(
        0,
        "Tokens in one sample, for tokens/s and per-token MFU when meshrun cannot count them "
        "(integer-id inputs are counted); 0 = unknown: samples/s only.",
        min=0,
    )
    flops_per_sample: float = _f(
        0.0,
        "Training FLOPs (forward + backward) for one sample, for MFU on any workload; "
        "0 = from the model (causal LMs) or no MFU.",
        min=0,
    )
    peak_flops: float = _f(
        0.0,
        "Peak FLOP/s of one device, for MFU; 0 = the planner's datasheet figure on a known GPU "
        "(none on CPU).",
        min=0,
    )


@dataclass
class MonitorConfig:
    """Run health: numerics guard, stragglers, hang watchdog (see docs/monitor.md)."""

    def __post_init__(self) -> None:
        check_section(self)

    nonfinite: Literal["skip", "stop"] = _f(
        "skip", "NaN/Inf loss on any rank: every rank skips the step (zero grads), or all stop."
    )
    straggler_every: int = _f(
        20, "Compare ranks' step components every N optimizer steps; 0 = off.", min=0
    )
    straggler_factor: float = _f(
        1.5, "Flag a rank whose component is this many times the others' median.", min=1.0
    )
    straggler_min_s: float = _f(
        0.005, "...and exceeds that median by at least this many seconds per step.", min=0
    )
    step_timeout_s: float = _f(
        300.0, "Hang watchdog: a step taking longer dumps all stacks and exits; 0 = off.", min=0
    )
    phase_timeout_s: float = _f(
        1800.0, "Watchdog limit inside run.phase(...), checkpoint saves and the first step.", min=0
    )
    comm_timing: bool = _f(
        True, "Time DDP's gradient all-reduce (comm hook) to split exposed from hidden comm."
    )
    comm_sample_every: int = _f(
        200,
        "FSDP2/TP/PP (no DDP hook): profile every N-th step for its exposed comm; 0 = off.",
        min=0,
    )


@dataclass
class LaunchConfig:
    """How `meshrun launch` starts the workers (through the torchrun elastic agent)."""

    def __post_init__(self) -> None:
        check_section(self)

    nproc_per_node: int = _f(0, "Processes per node; 0 = number of GPUs, else 2 on CPU.", min=0)
    nnodes: str = _f("1", "Number of nodes, or MIN:MAX for elastic jobs.")
    max_restarts: int = _f(0, "Restarts of the worker group after a failure.", min=0)
    omp_num_threads: int = _f(0, "OMP_NUM_THREADS per worker; 0 = cores / processes.", min=0)
    rdzv_endpoint: str = _f(
        "", "Multi-node: HOST:PORT of the rendezvous store, on one of the nodes (docs/launch.md)."
    )
    rdzv_id: str = _f("meshrun", "Multi-node: job id, the same on every node of one job.")
    node_rank: int = _f(
        0, "Multi-node: this node's rank in [0, nnodes); elastic jobs ignore it.", min=0
    )
    interface: str = _f(
        "", "Multi-node: network interface to use; empty = the one routing to the endpoint."
    )
    join_timeout_s: float = _f(
        300.0, "Multi-node: give up when the nodes have not all joined after this long.", min=1
    )
    rdzv_conf: str = _f(
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

    def __post_init__(self) -> None:
        validate(self)

    def resolved_run_dir(self) -> Path:
        return Path(self.job.run_dir or f"runs/{self.job.name}")

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {
            sec.name: {
                _key(f): getattr(getattr(self, sec.name), f.name)
                for f in _fields(getattr(self, sec.name))
            }
            for sec in dataclasses.fields(self)
        }

    def digest(self) -> str:
        """A short hash of the effective config (nodes compare it; manifests record it)."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


# --- field introspection -------------------------------------------------------------------


def _key(f: dataclasses.Field[Any]) -> str:
    # `async` is a Python keyword: the field is `async_`, the TOML/CLI key is `async`.
    return f.name.rstrip("_")


def _fields(section_type: Any) -> list[dataclasses.Field[Any]]:
    return list(dataclasses.fields(section_type))


@functools.cache
def _section_types() -> dict[str, type]:
    hints = get_type_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config)}


@functools.cache
def _section_names() -> dict[type, str]:
    return {tp: name for name, tp in _section_types().items()}


# Cached: every section's __post_init__ reads it, and get_type_hints evaluates annotations.
@functools.cache
def _field_map(section_type: type) -> dict[str, tuple[dataclasses.Field[Any], Any]]:
    hints = get_type_hints(section_type)
    return {_key(f): (f, hints[f.name]) for f in dataclasses.fields(section_type)}


def _describe(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(
        tp, str(tp)
    )


# --- value coercion ------------------------------------------------------------------------


def _coerce(key: str, value: Any, tp: Any, from_text: bool) -> Any:
    """Convert ``value`` to ``tp`` or raise a ConfigError naming the key and what is allowed."""
    origin = get_origin(tp)
    if origin is Literal:
        allowed = get_args(tp)
        if value in allowed:
            return value
        raise ConfigError(f"{key} = {value!r} is not allowed: expected {_describe(tp)}")
    if origin in (Union, types.UnionType):  # Optional[X]
        inner = next(a for a in get_args(tp) if a is not type(None))
        if value is None or (from_text and str(value).lower() in ("none", "null", "")):
            return None
        return _coerce(key, value, inner, from_text)
    converted = _convert_text(value, tp) if from_text else _convert_native(value, tp)
    if converted is _BAD:
        raise ConfigError(
            f"{key} = {value!r} has the wrong type: expected {_describe(tp)} "
            f"(e.g. --{key}={_example(tp)})"
        )
    return converted


_BAD = object()


def _example(tp: Any) -> str:
    return {bool: "true", int: "4", float: "0.5", str: "text"}.get(tp, "...")


def _convert_native(value: Any, tp: Any) -> Any:
    if tp is bool:
        return value if isinstance(value, bool) else _BAD
    if tp is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else _BAD
    if tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return float(value) if ok else _BAD
    if tp is str:
        return value if isinstance(value, str) else _BAD
    return _BAD


def _convert_text(text: Any, tp: Any) -> Any:
    text = str(text)
    if tp is bool:
        lowered = text.lower()
        if lowered in ("true", "1", "yes", "on"):
            return True
        if lowered in ("false", "0", "no", "off"):
            return False
        return _BAD
    try:
        if tp is int:
            return int(text)
        if tp is float:
            return float(text)
    except ValueError:
        return _BAD
    return text if tp is str else _BAD


def _check_range(key: str, value: Any, f: dataclasses.Field[Any]) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key} = {value!r} is not allowed: expected a finite number")
    lo, hi = f.metadata.get("min"), f.metadata.get("max")
    if lo is not None and value < lo:
        raise ConfigError(f"{key} = {value!r} is out of range: must be >= {lo}")
    if hi is not None and value > hi:
        raise ConfigError(f"{key} = {value!r} is out of range: must be <= {hi}")


# --- building a Config ---------------------------------------------------------------------


def _suggest(name: str, options: Iterable[str]) -> str:
    import difflib

    close = difflib.get_close_matches(name, list(options), n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


def _set(cfg: Config, dotted: str, value: Any, from_text: bool) -> None:
    sections = _section_types()
    parts = dotted.split(".")
    if len(parts) != 2:
        raise ConfigError(
            f"config key {dotted!r} must have the form section.key; sections: {', '.join(sections)}"
        )
    sec, key = parts
    if sec not in sections:
        raise ConfigError(
            f"unknown config section {sec!r} in {dotted!r}; allowed: {', '.join(sections)}."
            + _suggest(sec, sections)
        )
    fmap = _field_map(sections[sec])
    if key not in fmap:
        raise ConfigError(
            f"unknown config key {dotted!r}; keys of [{sec}]: {', '.join(fmap)}."
            + _suggest(key, fmap)
        )
    f, tp = fmap[key]
    setattr(getattr(cfg, sec), f.name, _checked(dotted, value, f, tp, from_text))


def _checked(dotted: str, value: Any, f: dataclasses.Field[Any], tp: Any, from_text: bool) -> Any:
    """The one check of a value, whatever made it (TOML, command line, launch flag, code)."""
    coerced = _coerce(dotted, value, tp, from_text)
    _check_range(dotted, coerced, f)
    return coerced


def set_value(cfg: Config, dotted: str, value: Any) -> None:
    """``cfg.<section>.<key> = value`` for a Python value, checked as a TOML value is."""
    _set(cfg, dotted, value, from_text=False)


def check_section(section: Any) -> None:
    """Check (and normalise: an int for a float key becomes a float) every field of one
    section against its type, its Literal choices and its min/max. Each section's
    ``__post_init__`` runs it, so ``DataConfig(micro_batch=0)`` fails where it is written,
    with the message a TOML file would get."""
    section_type: type = type(section)
    name = _section_names().get(section_type, section_type.__name__)
    errors = []  # every bad value of the section at once: ParallelConfig(zero=7, param_dtype=..)
    for key, (f, tp) in _field_map(section_type).items():
        value = getattr(section, f.name)
        try:
            coerced = _checked(f"{name}.{key}", value, f, tp, from_text=False)
        except ConfigError as e:
            errors.append(str(e))
            continue
        if coerced is not value:
            setattr(section, f.name, coerced)
    if errors:
        raise ConfigError("; ".join(errors))


def validate(cfg: Config) -> Config:
    """Check the whole tree again: each section is of its type and every value is allowed.
    ``init()`` and the launcher run it (through :func:`validate_for_world`), so attributes
    set after construction (``cfg.data.micro_batch = 0``) are caught too."""
    for name, section_type in _section_types().items():
        section = getattr(cfg, name)
        if not isinstance(section, section_type):
            raise ConfigError(
                f"config section {name!r} is a {type(section).__name__}, not a "
                f"{section_type.__name__}; pass {name}={section_type.__name__}(...)"
            )
        check_section(section)
    return cfg


def apply_mapping(cfg: Config, data: Mapping[str, Any], source: str = "config") -> Config:
    """Apply a ``{section: {key: value}}`` mapping (parsed TOML) to ``cfg`` in place."""
    for sec, body in data.items():
        if not isinstance(body, Mapping):
            raise ConfigError(
                f"{source}: top-level key {sec!r} must be a [section] table; "
                f"allowed sections: {', '.join(_section_types())}"
            )
        for key, value in body.items():
            try:
                _set(cfg, f"{sec}.{key}", value, from_text=False)
            except ConfigError as e:
                raise ConfigError(f"{source}: {e}") from None
    return cfg


def load_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(
            f"config file {str(p)!r} does not exist; create one with `meshrun config init`"
        )
    try:
        with p.open("rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}") from None


def split_overrides(argv: Sequence[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """Separate ``--section.key=value`` / ``--section.key value`` from the other arguments.

    Only dotted long options are taken, so a user script's own flags pass through untouched.
    """
    overrides: list[tuple[str, str]] = []
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name = arg[2:].split("=", 1)[0] if arg.startswith("--") else ""
        if "." not in name:
            rest.append(arg)
        elif "=" in arg:
            overrides.append((name, arg.split("=", 1)[1]))
        elif i + 1 < len(argv):
            overrides.append((name, argv[i + 1]))
            i += 1
        else:
            raise ConfigError(f"override --{name} has no value; write --{name}=VALUE")
        i += 1
    return overrides, rest


def load_config(
    path: str | Path | None = None, overrides: Sequence[tuple[str, str]] = ()
) -> Config:
    """Defaults, then the TOML file (if any), then ``--section.key=value`` overrides."""
    cfg = Config()
    if path:
        apply_mapping(cfg, load_toml(path), source=str(path))
    return apply_overrides(cfg, overrides)


def apply_overrides(cfg: Config, overrides: Sequence[tuple[str, str]]) -> Config:
    """Apply ``(section.key, text)`` pairs from the command line to ``cfg`` in place."""
    for dotted, text in overrides:
        try:
            _set(cfg, dotted, text, from_text=True)
        except ConfigError as e:
            raise ConfigError(f"command line: {e}") from None
    return cfg


# --- derived values and whole-config checks ------------------------------------------------


def resolve_mesh_dims(p: ParallelConfig, world_size: int) -> dict[str, int]:
    """Fill in ``dp_shard = -1`` and check that the mesh product equals the world size."""
    fixed = p.dp_replicate * p.tp * p.pp
    dp_shard = p.dp_shard
    if dp_shard == -1:
        if world_size % fixed:
            raise ConfigError(
                f"parallel: dp_replicate x tp x pp = {p.dp_replicate} x {p.tp} x {p.pp} = {fixed} "
                f"does not divide the world size {world_size}; choose degrees whose product divides it"
            )
        dp_shard = world_size // fixed
    elif dp_shard == 0:
        raise ConfigError("parallel.dp_shard = 0 is not allowed: use -1 (the rest) or >= 1")
    dims = {"pp": p.pp, "dp_replicate": p.dp_replicate, "dp_shard": dp_shard, "tp": p.tp}
    product = p.pp * p.dp_replicate * dp_shard * p.tp
    if product != world_size:
        shown = " x ".join(f"{k}={v}" for k, v in dims.items())
        raise ConfigError(
            f"parallel: mesh {shown} = {product} processes, but the world size is {world_size}; "
            f"set parallel.dp_shard=-1 or change the degrees so that the product is {world_size}"
        )
    return dims


def effective_global_batch(data: DataConfig, dp_size: int) -> int:
    """``data.global_batch``, or ``micro_batch x dp_size`` when it is unset (0)."""
    return data.global_batch or data.micro_batch * dp_size


def grad_accumulation(data: DataConfig, dp_size: int) -> int:
    """accumulation = global_batch / (micro_batch x dp_size); an error if it does not divide.
    An unset global batch (0) is micro_batch x dp_size: accumulation 1, nothing to divide."""
    if data.micro_batch < 1 or dp_size < 1:  # a mutated config must not divide by zero
        raise ConfigError(
            f"data.micro_batch = {data.micro_batch} with data-parallel size {dp_size}: both "
            "must be >= 1"
        )
    per_step = data.micro_batch * dp_size
    global_batch = effective_global_batch(data, dp_size)
    if global_batch % per_step:
        ok = [m for m in range(1, global_batch + 1) if global_batch % (m * dp_size) == 0]
        hint = (
            f"micro_batch in {ok[:8]}" if ok else f"a global_batch that is a multiple of {dp_size}"
        )
        raise ConfigError(
            f"data.global_batch = {global_batch} is not divisible by micro_batch x "
            f"data-parallel size = {data.micro_batch} x {dp_size} = {per_step}; use {hint}"
        )
    return global_batch // per_step


def dp_size_for_world(cfg: Config, world_size: int) -> int:
    """The data-parallel size (dp_replicate x dp_shard) of ``cfg``'s mesh on this world."""
    dims = resolve_mesh_dims(cfg.parallel, world_size)
    return dims["dp_replicate"] * dims["dp_shard"]


def resolve_global_batch(cfg: Config, world_sizes: Sequence[int]) -> str | None:
    """Fill in an unset ``data.global_batch`` (0) in place: micro_batch x the data-parallel
    size of the world, or of the least common multiple of several worlds' sizes, so that one
    number serves each of them (scale-test keeps it across sizes: strong scaling). Returns the
    line that says what was derived; None when the user set the value (it is kept as is)."""
    if cfg.data.global_batch or not world_sizes:
        return None
    sizes = [dp_size_for_world(cfg, w) for w in world_sizes]
    dp = math.lcm(*sizes)
    cfg.data.global_batch = cfg.data.micro_batch * dp
    distinct = sorted(set(sizes))
    why = "" if len(distinct) == 1 else f"; {dp} = lcm of the sizes {distinct}"
    return (
        f"data.global_batch unset: {cfg.data.micro_batch} x {dp} = {cfg.data.global_batch} "
        f"(micro_batch x data-parallel size{why}); set --data.global_batch=N to choose it"
    )


def check_pipeline(p: ParallelConfig, dims: Mapping[str, int], shown: str) -> None:
    """What pipeline parallel cannot compose with, and its micro-batch chunks. (TP, DDP and
    FSDP2 on the other dims compose: each stage module is parallelized on the sub-mesh.)"""
    # ZeRO-1 composes: its optimizer steps plain aliases of the replicated stage parameters
    # (Pipeline.local_parameters); loss parallel too: the last stage's schedule step runs in
    # loss_parallel() (parallel/pp.py).
    if p.pp_microbatches < p.pp:
        raise ConfigError(
            f"parallel.pp_microbatches = {p.pp_microbatches} is fewer than the pp = {p.pp} "
            f"stages (mesh {shown}): the pipeline would idle; set pp_microbatches >= {p.pp}"
        )


def validate_for_world(cfg: Config, world_size: int) -> dict[str, int]:
    """Every check of ``cfg`` (:func:`validate`, then those that need the world size); run by
    the launcher before spawning workers and by ``init()``. An unset global batch (0) is
    checked as micro_batch x data-parallel size; :func:`resolve_global_batch` fills it in."""
    validate(cfg)
    dims = resolve_mesh_dims(cfg.parallel, world_size)
    check_layout(cfg.parallel, dims)
    grad_accumulation(cfg.data, dims["dp_replicate"] * dims["dp_shard"])
    if cfg.parallel.pp > 1 and cfg.data.micro_batch % cfg.parallel.pp_microbatches:
        raise ConfigError(
            f"data.micro_batch = {cfg.data.micro_batch} does not split into parallel."
            f"pp_microbatches = {cfg.parallel.pp_microbatches} equal chunks (unequal chunks would "
            "weight samples unequally); choose a micro_batch that is a multiple of it"
        )
    return dims


def check_layout(p: ParallelConfig, dims: Mapping[str, int]) -> None:
    """Combinations of degrees and ZeRO stage that no PyTorch tool runs; each error names the
    dims. (Checks that need the model, such as tp dividing the heads, run in parallelize.)"""
    shown = " x ".join(f"{k}={v}" for k, v in dims.items())
    dp = dims["dp_replicate"] * dims["dp_shard"]
    if p.zero > 0 and dims["dp_shard"] == 1:
        raise ConfigError(
            f"parallel.zero = {p.zero} shards over the dp_shard dim, but the mesh {shown} has "
            "dp_shard=1: nothing to shard over; set parallel.zero=0, or parallel.dp_shard > 1 "
            "(e.g. dp_shard=-1 with fewer dp_replicate/tp/pp)"
        )
    # DDP and ZeroRedundancyOptimizer do not take tensor-parallel DTensor parameters: with tp,
    # data parallelism is FSDP2 (zero = 0 runs as ZeRO-3 with a warning, in parallelize).
    if p.tp > 1 and dp > 1 and (p.zero == 1 or dims["dp_shard"] == 1):
        raise ConfigError(
            f"parallel.tp = {p.tp} with data parallelism dp_replicate x dp_shard = {dp} needs "
            f"FSDP2 over a dp_shard dim > 1, but parallel.zero = {p.zero} (mesh {shown}); set "
            "parallel.zero=2 or 3 and parallel.dp_shard > 1"
        )
    if p.pp > 1:
        check_pipeline(p, dims, shown)
    if p.sequence_parallel and p.tp == 1:
        raise ConfigError(
            f"parallel.sequence_parallel = true splits along the sequence over the tp dim, but "
            f"the mesh {shown} has tp=1; set parallel.tp > 1 or parallel.sequence_parallel=false"
        )
    if p.loss_parallel and p.tp == 1:
        raise ConfigError(
            f"parallel.loss_parallel = true splits the logits over the tp dim, but the mesh "
            f"{shown} has tp=1; set parallel.tp > 1 or parallel.loss_parallel=false"
        )


# --- files ---------------------------------------------------------------------------------


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(str(v))  # a JSON string is a valid TOML basic string


def to_toml(cfg: Config, comments: bool = False) -> str:
    """Render the config as TOML; with comments, each key carries its documentation."""
    lines: list[str] = []
    for sec in dataclasses.fields(cfg):
        section_obj = getattr(cfg, sec.name)
        if comments:
            lines.append(f"# {(type(section_obj).__doc__ or '').strip()}")
        lines.append(f"[{sec.name}]")
        for f in dataclasses.fields(section_obj):
            entry = f"{_key(f)} = {_toml_value(getattr(section_obj, f.name))}"
            doc = f.metadata.get("doc", "")
            lines.append(f"{entry:<32} # {doc}" if comments and doc else entry)
        lines.append("")
    return "\n".join(lines)


def write_config(cfg: Config, path: str | Path) -> Path:
    """Write the resolved config atomically (workers read it while the launcher may rewrite).

    The temporary file's name is unique to this writer: on a multi-node job every node's
    launcher writes the same file in a shared run directory, and with one fixed temporary name
    one node's rename would take the file another node was about to rename."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.{uuid.uuid4().hex}.tmp")
    tmp.write_text(to_toml(cfg))
    tmp.replace(p)
    return p


def reference_markdown() -> str:
    """The config reference (docs/config.md is this text; a test keeps them equal)."""
    out = [
        "# Configuration reference",
        "",
        "<!-- generated by meshrun.config.reference_markdown(); tests/unit/test_docs.py checks it -->",
        "",
        "A TOML file of the sections below, then `--section.key=value` on the command line. "
        "`meshrun config init` writes a commented template; `meshrun config show` prints the "
        "effective values (`--world-size N`: with what is derived for N processes). Unknown "
        "keys, wrong types and out-of-range values are errors that name the key, the value "
        "and what is allowed, on every path: a file, `--section.key=value`, a `meshrun launch` "
        "flag, and a `Config(...)` or section built in code (checked in `__post_init__`, and "
        "again by `init()` and the launcher, so attributes set later are checked too).",
    ]
    for sec in dataclasses.fields(Config):
        section_type = get_type_hints(Config)[sec.name]
        out += ["", f"## [{sec.name}]", "", (section_type.__doc__ or "").strip(), ""]
        out += ["| key | default | allowed | meaning |", "|---|---|---|---|"]
        for key, (f, tp) in _field_map(section_type).items():
            default = _toml_value(f.default)
            allowed = _describe(tp)
            lo, hi = f.metadata.get("min"), f.metadata.get("max")
            if lo is not None:
                allowed += f", >= {lo}"
            if hi is not None:
                allowed += f", <= {hi}"
            out.append(f"| `{key}` | `{default}` | {allowed} | {f.metadata.get('doc', '')} |")
    return "\n".join(out) + "\n"
