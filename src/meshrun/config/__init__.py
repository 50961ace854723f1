"""Configuration: a tree of small dataclasses, read from TOML, overridden by ``--section.key=value``.

The launcher resolves the config once (file + overrides), validates it before any process is
spawned, and writes it to one file whose path reaches the workers as ``MESHRUN_CONFIG``: one
channel, not a spray of environment variables.

Every error names the key, the value, what is allowed and how to fix it, and every source of a
value goes through the same checks: each section's ``__post_init__`` (``sections.py``), which
``load.py`` runs again after it sets keys from a file, an override or a ``meshrun launch``
flag. What needs the world size is in ``world.py``; ``fields.py`` holds the value checks.
"""

from meshrun.config.fields import CONFIG_ENV, ConfigError, ConfigWarning, check_section
from meshrun.config.launch_values import nnodes_range, parse_endpoint, parse_rdzv_conf
from meshrun.config.load import (
    apply_mapping,
    apply_overrides,
    apply_pairs,
    load_config,
    load_toml,
    set_value,
    split_overrides,
    to_toml,
    write_config,
)
from meshrun.config.reference import reference_markdown
from meshrun.config.sections import (
    CheckpointConfig,
    Config,
    DataConfig,
    JobConfig,
    LaunchConfig,
    MetricsConfig,
    MonitorConfig,
    OptimConfig,
    ParallelConfig,
    validate,
)
from meshrun.config.world import (
    check_expert_parallel,
    check_layout,
    check_pipeline,
    dp_size_for_world,
    effective_global_batch,
    grad_accumulation,
    resolve_global_batch,
    resolve_mesh_dims,
    validate_for_world,
)

__all__ = [
    "CONFIG_ENV",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "ConfigWarning",
    "DataConfig",
    "JobConfig",
    "LaunchConfig",
    "MetricsConfig",
    "MonitorConfig",
    "OptimConfig",
    "ParallelConfig",
    "apply_mapping",
    "apply_overrides",
    "apply_pairs",
    "check_expert_parallel",
    "check_layout",
    "check_pipeline",
    "check_section",
    "dp_size_for_world",
    "effective_global_batch",
    "grad_accumulation",
    "load_config",
    "load_toml",
    "nnodes_range",
    "parse_endpoint",
    "parse_rdzv_conf",
    "reference_markdown",
    "resolve_global_batch",
    "resolve_mesh_dims",
    "set_value",
    "split_overrides",
    "to_toml",
    "validate",
    "validate_for_world",
    "write_config",
]
