"""What a live replica group sends a restarted one, and how the restarted one takes it.

The state is everything a step depends on: the model weights, the optimizer's state, the LR
schedulers, the fp16 scaler, the counters and the data position (the sampler's ``consumed``:
the healed group continues the data stream where its peers are, neither replaying nor
skipping). torchft moves it over HTTP between the groups' ranks of the same index, so each
rank sends and receives its own shard under FSDP2, and its own partition of the optimizer
state under ZeRO-1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves, tree_map

from meshrun.parallel.kinds import is_zero_redundancy
from meshrun.runtime.state import TrainState

if TYPE_CHECKING:
    from torch.distributed.optim import ZeroRedundancyOptimizer

__all__ = ["HealState", "Loaded", "StateCodec"]


@dataclass(frozen=True)
class Loaded:
    """One heal, as the metrics report it."""

    source: str  # the group the state came from
    nbytes: int  # tensor bytes received
    step: int


class HealState:
    """Whether the current quorum healed this group (set by the Manager's load callback)."""

    def __init__(self) -> None:
        self.loaded: Loaded | None = None

    def begin(self) -> None:
        self.loaded = None


class StateCodec:
    """``save()`` on the group that sends, ``load()`` on the group that heals."""

    def __init__(self, state: TrainState, group_index: int) -> None:
        self.state = state
        self.group_index = group_index
        self._pending_optimizer: dict[str, Any] | None = None

    def save(self) -> dict[str, Any]:
        s = self.state
        return {
            "source": f"group {self.group_index}",
            "step": s.step,
            "models": [_local(m.state_dict()) for m in s.models],
            # A group that healed itself and has not stepped yet holds its peer's optimizer
            # state as pending: that is its state, and the one to pass on.
            "optimizer": self._pending_optimizer
            if s.optimizer is None
            else _local(_optimizer_state(s.optimizer)),
            "schedulers": [sch.state_dict() for sch in s.schedulers],
            "scaler": None if s.scaler is None else s.scaler.state_dict(),
            "sampler": None if s.sampler is None else s.sampler.state_dict(),
            "iterable": None if s.iterable is None else s.iterable.state_dict(),
        }

    def load(self, blob: dict[str, Any]) -> Loaded:
        s = self.state
        if len(blob["models"]) != len(s.models):
            raise RuntimeError(
                f"healing: the peer trains {len(blob['models'])} models, this group "
                f"{len(s.models)}; every replica group must run the same script and layout"
            )
        if blob["optimizer"] is None and int(blob["step"]) > 0:
            # Weights of step N without the optimizer state that made them: training on
            # would mix this group's stale moments with the peer's weights.
            raise RuntimeError(
                f"healing: {blob['source']} is at step {blob['step']} but sent no optimizer "
                "state (its optimizer was not known when it sent: register it with "
                "run.resume(model, optimizer, loader) before run.steps)"
            )
        for model, sd in zip(s.models, blob["models"], strict=True):
            _copy_into(model, sd)
        for sch, sd in zip(s.schedulers, blob["schedulers"], strict=True):
            sch.load_state_dict(sd)
        if s.scaler is not None and blob["scaler"] is not None:
            s.scaler.load_state_dict(blob["scaler"])
        if s.sampler is not None and blob["sampler"] is not None:
            s.sampler.load_state_dict(blob["sampler"])
        if s.iterable is not None and blob["iterable"] is not None:
            s.iterable.load_state_dict(blob["iterable"])
        self._pending_optimizer = blob["optimizer"]
        if s.optimizer is not None:
            self.apply_pending_optimizer(s.optimizer)
        s.set_position(int(blob["step"]))
        nbytes = sum(
            t.numel() * t.element_size() for t in tree_leaves(blob) if isinstance(t, torch.Tensor)
        )
        return Loaded(str(blob["source"]), nbytes, int(blob["step"]))

    def apply_pending_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if self._pending_optimizer is not None:
            sd = _as_params(optimizer, self._pending_optimizer)
            if is_zero_redundancy(optimizer):
                _check_partition(optimizer, sd)
            elif sd.get("zero1_partition"):
                raise RuntimeError(
                    "healing: the peer's optimizer is a ZeroRedundancyOptimizer (ZeRO-1), this "
                    f"group's a {type(optimizer).__name__}: every group must run the same layout"
                )
            optimizer.load_state_dict({k: v for k, v in sd.items() if k != "zero1_partition"})
            self._pending_optimizer = None


def _optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's ``state_dict()``; under ZeRO-1 this rank's partition only.

    ``ZeroRedundancyOptimizer.state_dict()`` needs ``consolidate_state_dict()`` first (a
    collective of the group, here inside torchft's quorum) and then holds the whole state on
    one rank only. Rank r of every group owns the same partition (the same parameters over
    the same group size), so rank r sends the state its inner optimizer holds, keyed by the
    indices ``state_dict()`` would use, with the outer param groups (their hyperparameters:
    an LR scheduler sets those, and ZeRO copies them into its inner optimizer at each step).
    ``ZeroRedundancyOptimizer.load_state_dict`` on the peer loads the entries it owns."""
    if not is_zero_redundancy(optimizer):
        return optimizer.state_dict()
    params = _params(optimizer)
    index = {id(p): i for i, p in enumerate(params)}
    groups = [
        {
            **{k: v for k, v in g.items() if k != "params"},
            "params": [index[id(p)] for p in g["params"]],
        }
        for g in optimizer.param_groups
    ]
    state = {index[id(p)]: dict(v) for p, v in optimizer.optim.state.items()}
    return {"state": state, "param_groups": groups, "zero1_partition": True}


def _check_partition(optimizer: ZeroRedundancyOptimizer, sd: dict[str, Any]) -> None:
    """The received ZeRO-1 partition is the one this rank owns: ZeRO's load would silently
    drop the entries of parameters another rank owns, leaving theirs unset."""
    if not sd.get("zero1_partition"):
        raise RuntimeError(
            "healing: this group's optimizer is a ZeroRedundancyOptimizer (ZeRO-1) but the "
            "peer sent a whole optimizer state: every group must run the same layout"
        )
    params = _params(optimizer)
    owned = {id(p) for group in optimizer.optim.param_groups for p in group["params"]}
    mine = {i for i, p in enumerate(params) if id(p) in owned}
    if not set(sd["state"]) <= mine:
        raise RuntimeError(
            f"healing: the peer's ZeRO-1 partition holds parameters {sorted(sd['state'])[:8]}, "
            f"this rank owns {sorted(mine)[:8]}: every group must run the same layout on the "
            "same number of ranks"
        )


def _local(tree: Any) -> Any:
    """DTensors as their local shards: rank r of the peer group holds the shard rank r here
    needs (the groups run the same layout), and a plain tensor travels without its mesh."""
    return tree_map(lambda t: t.to_local() if isinstance(t, DTensor) else t, tree)


@torch.no_grad()
def _copy_into(model: torch.nn.Module, received: dict[str, Any]) -> None:
    """Copy the peer's tensors into this model's own (its shards under FSDP2) in place."""
    own = model.state_dict()
    if set(own) != set(received):
        raise RuntimeError(
            f"healing: the peer's model has keys {sorted(set(received) ^ set(own))[:5]} that "
            "this group's has not (or the other way): every group must run the same model"
        )
    for key, dst in own.items():
        (dst.to_local() if isinstance(dst, DTensor) else dst).copy_(received[key])


def _as_params(optimizer: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
    """The received optimizer state with each per-parameter shard made a DTensor again where
    the parameter is one (an optimizer mixing them would fail at its next step)."""
    params = _params(optimizer)
    for index, entry in sd["state"].items():
        p = params[int(index)]
        if not isinstance(p, DTensor):
            continue
        for name, value in entry.items():
            if isinstance(value, torch.Tensor) and value.shape == p.to_local().shape:
                entry[name] = DTensor.from_local(
                    value,
                    p.device_mesh,
                    p.placements,
                    run_check=False,
                    shape=p.shape,
                    stride=p.stride(),
                )
    return sd


def _params(optimizer: torch.optim.Optimizer) -> list[Any]:
    """The optimizer's parameters in ``state_dict()``'s numbering (param group by group)."""
    return [p for group in optimizer.param_groups for p in group["params"]]
