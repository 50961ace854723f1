"""A tensor-parallel plan checked against the user's own forward, before step 1.

A column-wise split leaves each rank ``n_heads / tp`` heads: attention written as
``q.view(bsz, seq, self.n_heads, self.head_dim)`` (pytorch/examples' FSDP2 model, nanoGPT,
most hand-written models) then fails inside the user's forward at step 1 with a bare
``shape '[8, 16, 4, 16]' is invalid for input of size 4096``. No static reading of the plan
sees that: only running the forward does.

:func:`check_tp_forward` runs it, at no cost in memory and without touching the model: a copy
whose tensors are on the meta device (shapes only, no storage, no arithmetic) is split by the
same plan on the same tp mesh (``parallelize_module`` and DTensor on meta tensors send
nothing) and runs a forward and a backward, each rank alike. If that fails, a whole copy runs
too: a failure only under the split is refused, naming the module, the line of the user's
code and the fix; one the whole model has too (an input that does not fit) skips the check. The real model, its RNG streams (CPU and device) and DTensor's RNG
tracker are left as they were.

The input is the user's (``ModelSpec(example_input=...)``) or derived: token ids for a model
whose first layer is an ``nn.Embedding``. Where none can be had (or the copy cannot be made),
:func:`note_first_forward` adds the same explanation to the error at the first real forward
instead, as a note under the traceback.

What shapes cannot show is not caught here: a reshape that puts ``-1`` on the sequence dim and
keeps the full head count (``.view(b, -1, n_heads, head_dim)``) runs on half a sequence
without an error; ``meshrun compare`` shows that one.
"""

from __future__ import annotations

import copy
import linecache
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.utils.hooks import RemovableHandle

from meshrun.config import ConfigError

log = logging.getLogger("meshrun")

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_RESHAPE = re.compile(r"shape '\[.*\]' is invalid for input of size|view size is not compatible")

Apply = Callable[[nn.Module], object]  # splits a module in place by the plan (tp.apply_tp)


@dataclass(frozen=True)
class Where:
    """Where an error was raised in the user's code: the innermost module of the model on
    the stack (its FQN and class) and the innermost line outside torch."""

    module: str
    module_class: str
    location: str  # "path/model.py:42"
    source: str  # that line, stripped


@dataclass(frozen=True)
class Checked:
    """What :func:`check_tp_forward` did: ``ran`` (the split forward and backward ran on
    meta tensors) and, for the start-up log, how long it took or why it did not run."""

    ran: bool
    detail: str


def apply_checked_tp(
    model: nn.Module,
    plan: Mapping[str, ParallelStyle],
    tp: int,
    apply: Apply,
    example_input: Any = None,
    check: bool = True,
    note: bool = True,
) -> Checked:
    """:func:`check_tp_forward` (when ``check``), then ``apply(model)``; where the check could
    not run, :func:`note_first_forward` (when ``note``) explains an error at the first real
    forward."""
    checked = check_tp_forward(model, plan, tp, apply, example_input) if check else None
    apply(model)
    if note and (checked is None or not checked.ran):
        note_first_forward(model, plan, tp)
    return checked or Checked(False, "not checked before step 1 (context parallel)")


def check_tp_forward(
    model: nn.Module,
    plan: Mapping[str, ParallelStyle],
    tp: int,
    apply: Apply,
    example_input: Any = None,
) -> Checked:
    """Refuse (ConfigError) a plan under which ``model``'s forward or backward fails while the
    whole model's runs; ``apply(copy)`` splits a copy by ``plan``."""
    start = time.perf_counter()
    args = derive_input(model, tp) if example_input is None else _to_meta(example_input)
    if args is None:
        return Checked(
            False, "not checked before step 1 (no example input: pass ModelSpec(example_input=...))"
        )
    shadow = meta_copy(model)
    if shadow is None:
        return Checked(False, "not checked before step 1 (the model cannot be copied to meta)")
    with isolated_rng():
        apply(shadow)
        split = run_forward_backward(shadow, args)
        # Only a failure costs a second run: the whole model's, on a fresh copy, to tell a
        # plan that breaks the forward from an input that does not fit the model at all.
        whole = None if split is None else run_forward_backward(meta_copy(model), args)
    if split is not None and whole is None:
        raise ConfigError(explain(split, shadow, plan, tp)) from None
    if whole is not None:
        why = f"{type(whole).__name__} in the whole model's forward on meta tensors"
        return Checked(False, f"not checked before step 1 ({why})")
    took = time.perf_counter() - start
    return Checked(True, f"checked: a forward and backward on meta tensors ({took:.2f} s)")


def derive_input(model: nn.Module, tp: int) -> tuple[Tensor, ...] | None:
    """Token ids (batch 2, sequence 2 x tp) when the model's first layer with parameters is an
    ``nn.Embedding``; else None. On meta: only the shape matters."""
    first = next((m for m in model.modules() if next(m.parameters(False), None) is not None), None)
    if not isinstance(first, nn.Embedding):
        return None
    return (torch.zeros(2, 2 * tp, dtype=torch.long, device="meta"),)


def _to_meta(value: Any) -> tuple[Any, ...]:
    args = value if isinstance(value, tuple) else (value,)
    return tuple(a.to("meta") if isinstance(a, Tensor) else a for a in args)


def meta_copy(model: nn.Module) -> nn.Module | None:
    """A deep copy of ``model`` whose parameters, buffers and tensor attributes are new meta
    tensors of the same shapes (tied ones stay one tensor); nothing is allocated or read.
    None where the model cannot be copied (a process group or a lock held in a module)."""
    if any(isinstance(p, DTensor) for p in model.parameters()):
        return None  # already split (expert parallel): a copy would hold real shards
    memo: dict[int, Any] = {}
    for module in model.modules():
        tensors = [*module._parameters.values(), *module._buffers.values(), *vars(module).values()]
        for t in tensors:
            if isinstance(t, Tensor) and id(t) not in memo and not isinstance(t, DTensor):
                memo[id(t)] = _meta_like(t)
    try:
        return copy.deepcopy(model, memo)
    except Exception:  # whatever a user's module holds: the check is skipped, not the run
        return None


def _meta_like(t: Tensor) -> Tensor:
    empty = torch.empty_like(t, device="meta")
    if isinstance(t, nn.Parameter):
        return nn.Parameter(empty, requires_grad=t.requires_grad)
    return empty


@contextmanager
def isolated_rng() -> Iterator[None]:
    """The RNG streams (CPU, and the current accelerator's) and DTensor's RNG tracker as they
    were before: the check draws nothing the run would have drawn."""
    from torch.distributed.tensor import _random

    tracker = _random._rng_tracker
    devices = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        _random._rng_tracker = tracker


def run_forward_backward(model: nn.Module | None, args: tuple[Any, ...]) -> BaseException | None:
    """``model(*args)``, then the gradients of the sum of its floating outputs (taken with
    ``autograd.grad``: no ``.grad`` is set); the exception raised, or None."""
    if model is None:
        return RuntimeError("the model cannot be copied")
    try:
        outputs = [_local(t) for t in _tensors(model(*args)) if t.is_floating_point()]
        total = sum((t.sum() for t in outputs if t.requires_grad), torch.zeros((), device="meta"))
        params = [p for p in model.parameters() if p.requires_grad]
        if isinstance(total, Tensor) and total.requires_grad and params:
            torch.autograd.grad(total, params, allow_unused=True)
    except Exception as e:  # the user's code may raise anything; it is reported, not swallowed
        return e
    return None


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _tensors(value: Any) -> Iterator[Tensor]:
    """The tensors in a model's output: a tensor, tuples/lists/dicts of them (Hugging Face's
    ``ModelOutput`` is a dict)."""
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)


def where_raised(error: BaseException, model: nn.Module) -> Where | None:
    """The innermost user frame of ``error``'s traceback (outside torch and this file), and
    the innermost module of ``model`` running a user frame: None if neither is found."""
    names = {id(m): n for n, m in model.named_modules()}
    frames = [(f, line) for f, line in _frames(error.__traceback__) if _is_user(f.f_code)]
    if not frames:
        return None
    frame, line = frames[-1]
    fqn, cls = "", ""
    for f, _ in reversed(frames):
        owner = f.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in names:
            fqn, cls = names[id(owner)] or "model", type(owner).__name__
            break
    path = frame.f_code.co_filename
    source = linecache.getline(path, line).strip()
    return Where(fqn, cls, f"{path}:{line}", source)


def _frames(tb: TracebackType | None) -> Iterator[tuple[Any, int]]:
    while tb is not None:
        yield tb.tb_frame, tb.tb_lineno
        tb = tb.tb_next


def _is_user(code: Any) -> bool:
    path = code.co_filename
    return not path.startswith(_TORCH_DIR) and path != __file__ and not path.startswith("<")


def explain(error: BaseException, model: nn.Module, plan: Mapping[str, Any], tp: int) -> str:
    """Why the split forward failed and the fix: the module, the user's line, the layers the
    plan splits inside that module, and for a reshape the head count to write."""
    where = where_raised(error, model)
    what = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    if where is None:
        return (
            f"tensor parallel over {tp} ranks breaks the model's forward ({what}), which runs "
            "whole on one process; fix the plan (run.parallelize(model, tp_plan={...})) or "
            "set parallel.tp=1"
        )
    split = _split_inside(plan, where.module)
    head = (
        f"tensor parallel over {tp} ranks breaks the forward of {where.module} "
        f"({where.module_class}, {where.location}: `{where.source}`): {what}"
    )
    return head + "; " + _fix(error, where, split, tp)


def _split_inside(plan: Mapping[str, Any], fqn: str) -> dict[str, list[str]]:
    """The layers the plan splits inside ``fqn`` (or, if none, anywhere), by style."""
    inside = {n: s for n, s in plan.items() if fqn == "model" or n.startswith(fqn + ".")}
    out: dict[str, list[str]] = {"column-wise": [], "row-wise": []}
    for name, style in (inside or plan).items():
        last = name.removeprefix(fqn + ".")
        if isinstance(style, ColwiseParallel):
            out["column-wise"].append(last)
        elif isinstance(style, RowwiseParallel):
            out["row-wise"].append(last)
    return out


def _fix(error: BaseException, where: Where, split: dict[str, list[str]], tp: int) -> str:
    cols = ", ".join(split["column-wise"][:4]) or "its projections"
    if _RESHAPE.search(str(error)):
        return (
            f"the plan splits {cols} column-wise, so each rank holds 1/{tp} of their output "
            "features (n_heads / tp heads) and a reshape that names the full head count fails; "
            "reshape by the local width: -1 in place of the head count (e.g. "
            "`.view(bsz, seq_len, -1, self.head_dim)`), or n_heads // tp; or leave this "
            "module out of tp_plan (split the MLP only), or set parallel.tp=1"
        )
    return (
        f"the plan splits {cols} column-wise (each rank holds 1/{tp} of their output features) "
        "and this line assumes the whole width; make it read the local width (x.size(-1), -1 "
        "in a reshape), or leave this module out of tp_plan, or set parallel.tp=1"
    )


def note_first_forward(model: nn.Module, plan: Mapping[str, Any], tp: int) -> list[RemovableHandle]:
    """Where the plan could not be checked before step 1: at the first real forward, an error
    raised inside a module the plan splits layers of gets :func:`explain`'s text as a note
    (under the traceback). Each hook removes itself after its module's first success."""
    handles: list[RemovableHandle] = []
    parents = {n.rpartition(".")[0] for n in plan if "." in n}
    for name in sorted(parents):
        handle_box: list[RemovableHandle] = []
        hook = _note_hook(model, plan, tp, handle_box)
        handle_box.append(model.get_submodule(name).register_forward_hook(hook, always_call=True))
        handles += handle_box
    return handles


def _note_hook(
    model: nn.Module, plan: Mapping[str, Any], tp: int, handle: list[RemovableHandle]
) -> Callable[[nn.Module, Any, Any], None]:
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        error = sys.exc_info()[1] if output is None else None  # torch passes None on error
        if error is None:  # a success: this module's forward fits the split
            handle[0].remove()
        elif not getattr(error, "_meshrun_noted", False):
            text = "meshrun: " + explain(error, model, plan, tp)
            add_note = getattr(error, "add_note", None)  # Python 3.11+; on 3.10 the log says it
            if add_note is not None:
                add_note(text)
            else:
                log.error("%s", text)
            error._meshrun_noted = True  # type: ignore[attr-defined]  # once, innermost module

    return hook
