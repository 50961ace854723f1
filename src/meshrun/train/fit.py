"""Before step 1: refuse a layout whose traced peak does not fit the device's memory.

``run.parallelize`` calls :func:`check_fit` on a model built on the meta device (nothing is
allocated yet, so an OOM is still avoidable). The limit is ``parallel.memory_limit_gb``, else
the CUDA device's total; on CPU with no configured limit nothing is traced (no cost). The
trace (parallel/memory_trace.py) needs a fake process group as the default one, and the worker already
has its real one: it runs in a forked child, which inherits the meta model and throws its copy
of the real group away, and sends back its figures. Every rank traces the same layout, so
every rank refuses with the same message, before any collective of the step.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, replace
from typing import Any

import torch
from torch import nn

from meshrun.config import Config, ConfigError
from meshrun.parallel.memory_trace import TraceLayout

ALLOWANCE_CUDA = 1e9  # the CUDA context and NCCL's buffers, outside the caching allocator


def memory_limit(cfg: Config, device: torch.device) -> float | None:
    """Bytes per device to check against, or None: no check."""
    gb = cfg.parallel.memory_limit_gb
    if gb < 0:
        return None
    if gb > 0:
        return gb * 1e9
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return None


def layout_of(cfg: Config, mesh: Any, model: nn.Module, device: torch.device) -> TraceLayout:
    """What this rank runs, from the config and the mesh (sequence: the model's context
    length, as the plan reads it)."""
    from meshrun.parallel import data_parallel_stage
    from meshrun.plan.inspect_model import inspect_module
    from meshrun.runtime.mesh import ParallelDims

    dims = ParallelDims.from_mesh(mesh)
    p = cfg.parallel
    seq = inspect_module(model).shape.get("seq", 1024)
    precision = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[p.param_dtype]
    return TraceLayout(
        dp_replicate=dims.dp_replicate,
        dp_shard=dims.dp_shard,
        tp=dims.tp,
        zero=data_parallel_stage(p, dims),
        micro_batch=cfg.data.micro_batch,
        seq=seq,
        ac="full" if p.activation_checkpoint == 1 else "none",
        precision=precision,
        gpu=device.type == "cuda",
    )


def check_fit(model: nn.Module, mesh: Any, cfg: Config, device: torch.device) -> None:
    """Raise ConfigError, with the traced figures and the layouts that would fit, when the
    configured layout's traced peak is over the device's memory."""
    from meshrun.parallel.fsdp import has_meta_params

    limit = memory_limit(cfg, device)
    if limit is None or not has_meta_params(model) or cfg.parallel.pp > 1:
        return
    lay = layout_of(cfg, mesh, model, device)
    allowance = ALLOWANCE_CUDA if lay.gpu else 0.0
    need = _traced_in_child(model, [lay])[0] + allowance
    if need <= limit:
        return
    options = _alternatives(lay)
    fitting = [
        (o, n + allowance)
        for o, n in zip(options, _traced_in_child(model, options), strict=True)
        if n + allowance <= limit
    ]
    raise ConfigError(_refusal(lay, need, limit, fitting))


def _alternatives(lay: TraceLayout) -> list[TraceLayout]:
    """Layouts on the same ranks that need less: a higher ZeRO stage, checkpointing, a
    smaller micro-batch (each alone, then together)."""
    out: list[TraceLayout] = []
    if lay.dp_replicate * lay.dp_shard > 1:
        out += [replace(lay, zero=z) for z in (1, 2, 3) if z > lay.zero]
    if lay.ac != "full":
        out.append(replace(lay, ac="full"))
    if lay.micro_batch > 1:
        out.append(replace(lay, micro_batch=lay.micro_batch // 2))
    if len(out) > 1:
        smallest = replace(out[0], zero=max(o.zero for o in out), ac="full", micro_batch=1)
        out.append(smallest)
    return list(dict.fromkeys(out))


def _refusal(
    lay: TraceLayout, need: float, limit: float, fitting: list[tuple[TraceLayout, float]]
) -> str:
    where = "parallel.memory_limit_gb" if not lay.gpu else "the device's memory"
    said = "; ".join(f"{_describe(o)} ({n / 1e9:.3f} GB)" for o, n in fitting)
    advice = f"layouts that fit: {said}" if said else "no layout on these ranks fits: add ranks"
    return (
        f"the layout {_describe(lay)} needs {need / 1e9:.3f} GB per device by its trace "
        f"(train/fit.py: one step on fake tensors), over {where} = {limit / 1e9:.3f} GB; "
        f"{advice}"
    )


def _describe(lay: TraceLayout) -> str:
    parts = [f"dp_shard={lay.dp_shard}", f"zero={lay.zero}", f"micro_batch={lay.micro_batch}"]
    if lay.dp_replicate > 1:
        parts.insert(0, f"dp_replicate={lay.dp_replicate}")
    if lay.tp > 1:
        parts.append(f"tp={lay.tp}")
    parts.append(f"activation_checkpoint={1 if lay.ac == 'full' else 0}")
    return ",".join(parts)


# --- the trace in a forked child -----------------------------------------------------------


def _traced_in_child(model: nn.Module, layouts: list[TraceLayout]) -> list[float]:
    """Reserved peak bytes of each layout, traced in a forked child (see the module doc)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(read)
        _child(model, layouts, write)
    os.close(write)
    with os.fdopen(read) as f:
        text = f.read()
    _, status = os.waitpid(pid, 0)
    reply = json.loads(text) if text else {"error": f"the trace exited with status {status}"}
    if "error" in reply:
        raise ConfigError(
            f"parallel.memory_limit_gb: the memory check could not trace the model: "
            f"{reply['error']}; set parallel.memory_limit_gb = -1 to skip it"
        )
    return [float(x) for x in reply["reserved"]]


def _child(model: nn.Module, layouts: list[TraceLayout], fd: int) -> None:
    code = 0
    try:
        import logging

        logging.getLogger("meshrun").disabled = True  # the traced layouts are not the run's
        _forget_process_groups()
        from meshrun.parallel.memory_trace import trace

        reply: dict[str, Any] = {"reserved": [trace(model, lay).reserved for lay in layouts]}
    except BaseException as e:  # the child reports everything and exits
        reply = {"error": f"{type(e).__name__}: {e}", "layouts": [asdict(x) for x in layouts]}
        code = 1
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(reply))
    os._exit(code)


def _forget_process_groups() -> None:
    """The child's copy of the worker's real process group, dropped (never used or shut
    down: the parent owns it) so that the fake world can be the default group."""
    import torch.distributed.distributed_c10d as c10d

    c10d._world = c10d._World()
    torch._C._distributed_c10d._unregister_all_process_groups()


__all__ = ["check_fit", "layout_of", "memory_limit"]
