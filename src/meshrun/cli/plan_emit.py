"""``meshrun plan --emit-config FILE``: the best layout written as a meshrun config."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from meshrun.plan.cost import Estimate, Training


def emit_config(e: Estimate, t: Training, path: str) -> list[str]:
    """Write the meshrun config of a layout; return the layout's settings that meshrun's
    config has no key for (the caller says them aloud)."""
    from meshrun.config import Config, to_toml

    cfg = Config()
    lay = e.layout
    for key in ("dp_replicate", "dp_shard", "tp", "pp", "zero"):
        setattr(cfg.parallel, key, getattr(lay, key))
    cfg.data.micro_batch, cfg.data.global_batch = lay.micro_batch, t.global_batch
    wanted = _config_settings(e, t)
    fields = {f.name for f in dataclasses.fields(cfg.parallel)}
    missing = [f"{k} = {v}" for k, v in wanted.items() if k.split(".")[-1] not in fields]
    for key, value in wanted.items():
        section, name = key.split(".")
        if name in fields or section == "data":
            setattr(getattr(cfg, section), name, value)
    Path(path).write_text(to_toml(cfg))
    return missing


def _config_settings(e: Estimate, t: Training) -> dict[str, Any]:
    """The layout's settings beyond the mesh, as meshrun config keys. Selective recomputation
    has no key (meshrun recomputes whole blocks), so it is returned as its own name."""
    lay = e.layout
    out: dict[str, Any] = {}
    if lay.activation_checkpointing == "full":
        out["parallel.activation_checkpoint"] = 1  # every block
    elif lay.activation_checkpointing == "selective":
        out["parallel.selective_recomputation"] = "attention"
    out.update({f"parallel.{k}": getattr(lay, k) for k in ("ep", "cp") if getattr(lay, k) > 1})
    if lay.tp > 1:
        out["parallel.sequence_parallel"] = True  # the activation model assumes it
    if lay.zero >= 2 and t.precision == "bf16":
        out["parallel.param_dtype"] = "bfloat16"
    if lay.pp > 1:
        # meshrun's pipeline splits each micro-batch into pp_microbatches chunks: one
        # micro-batch of (chunk x chunks) per step replaces the accumulation.
        out["parallel.pp_schedule"] = lay.schedule
        out["parallel.pp_virtual_stages"] = lay.vpp
        out["parallel.pp_microbatches"] = e.microbatches
        out["data.micro_batch"] = lay.micro_batch * e.microbatches
    return out
