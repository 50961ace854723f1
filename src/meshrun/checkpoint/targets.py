"""What a checkpoint holds, and its collection into tensors (for DCP) and plain values (JSON).

``run.resume(model, optimizer, loader, per_rank=..., **named)`` registers the targets; without
it, interval saves take them from the run's :class:`~meshrun.runtime.state.TrainState` (its one model or
pipeline stages, the optimizer ``run.optimizer_step`` steps, the loader position ``run.steps``
follows).

Objects registered by name are replicated: one copy is saved and every rank gets it back, so a
save checks that every rank holds the same state, and names the objects that differ: each rank
hashes them here (``Targets.digests``) and :func:`agree_replicated`'s all-gather of the digests
is the barrier the save runs anyway (``Commit.prepare``), so the check adds no collective (a
node-local snapshot, restored by each rank from its own shard, needs none). Per-rank objects
(``per_rank={name: obj}``: a hidden state carried over one rank's data, a ``StatefulDataLoader``)
are saved by every rank into its own JSON file, tensors included (small state; nothing is
pickled), and come back on the same rank.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
from torch import nn

from meshrun.checkpoint.checks import CheckpointError
from meshrun.checkpoint.facts import barrier
from meshrun.checkpoint.hf_files import HF_FILES, hf_files
from meshrun.checkpoint.pipeline import PipelineView, gather_optim_plain, maybe_pipeline_view
from meshrun.checkpoint.state import encode_tensors, split_state, state_digest
from meshrun.checkpoint.zero1 import is_zero1, zero1_state_dict
from meshrun.data.sampler import ResumableSampler
from meshrun.parallel.ep_checkpoint import ep_state_views
from meshrun.runtime.state import DataPosition, TrainState

__all__ = ["PER_RANK", "SAMPLER_AT_SAVE", "Stateful", "Targets", "agree_replicated"]

log = logging.getLogger("meshrun")
SAMPLER_AT_SAVE = "__sampler_at_save__"
PER_RANK = "__per_rank__"  # this rank's per-rank objects (rank file, not state.json)


class Stateful(Protocol):
    def state_dict(self) -> Mapping[str, Any]: ...
    def load_state_dict(self, state: Mapping[str, Any]) -> Any: ...


class Targets:
    """The model, optimizer, data position and user objects a checkpoint saves and restores."""

    def __init__(self, state: TrainState, rank: int) -> None:
        self.state = state
        self.rank = rank
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.sampler: DataPosition | None = None  # a ResumableSampler's, or the loop's
        self.named: dict[str, Stateful] = {}  # replicated: one copy saved, checked at save
        self.per_rank: dict[str, Stateful] = {}  # saved and restored by each rank
        # meshrun's own state laid out like the model (DiLoCo's synchronised weights and
        # outer optimizer): saved with the user objects through DCP, a DTensor by its shards,
        # so not checked for equality across ranks.
        self.internal: dict[str, Stateful] = {}
        # The replicated objects' digests as of the last collect(), for agree_replicated.
        self.digests: dict[str, int] = {}

    def register(
        self,
        model: Any,
        optimizer: torch.optim.Optimizer,
        loader: Any = None,
        named: Mapping[str, Stateful] | None = None,
        per_rank: Mapping[str, Stateful] | None = None,
    ) -> None:
        """``model``: the (parallelized) model, or the ``Pipeline`` from ``run.pipeline``."""
        self.model, self.optimizer = maybe_pipeline_view(model) or model, optimizer
        if self.state.optimizer is None:  # known before the first step: a replica group
            self.state.optimizer = optimizer  # healing a peer then sends its state (ft/heal.py)
        sampler = getattr(loader, "sampler", None)
        if isinstance(sampler, ResumableSampler):
            self.sampler = sampler
        elif loader is not None and hasattr(loader, "state_dict"):
            # e.g. torchdata's StatefulDataLoader: its position is this rank's share of data
            self.per_rank["loader"] = loader
        elif loader is not None:
            raise CheckpointError(
                f"run.resume(..., loader={type(loader).__name__}): its position cannot be saved; "
                "build it with run.dataloader(dataset) (a ResumableSampler) or pass an object "
                "with state_dict()/load_state_dict()"
            )
        for name, obj in (named or {}).items():
            self.named[name] = _stateful(f"run.resume(..., {name}=...)", obj)
        for name, obj in (per_rank or {}).items():
            self.per_rank[name] = _stateful(f"run.resume(..., per_rank={{{name!r}: ...}})", obj)
        both = sorted(self.named.keys() & self.per_rank.keys())
        if both:
            raise CheckpointError(
                f"run.resume: {both} registered both by name and in per_rank=; an object is "
                "either replicated (name=obj) or per rank (per_rank={name: obj}), not both"
            )

    def resolve(self) -> tuple[nn.Module, torch.optim.Optimizer]:
        """The model and optimizer to save; unregistered ones come from the train state."""
        st = self.state
        if self.model is None and st.pp_group is not None:  # run.pipeline's stages
            self.model = PipelineView(list(st.models))
        elif self.model is None and len(st.models) == 1:
            self.model = st.models[0]
        if self.optimizer is None:
            self.optimizer = st.optimizer
        if self.model is None or self.optimizer is None:
            raise CheckpointError(
                "nothing to checkpoint: call run.resume(model, optimizer, loader) before the "
                "loop (it registers what is saved), or run.parallelize(model) and "
                "run.optimizer_step(optimizer)"
            )
        if self.sampler is None and st.sampler is not None:  # set once run.steps() has begun
            self.sampler = st.sampler
        return self.model, self.optimizer

    def collect(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(tensors, plain)`` of everything saved, as of now."""
        # DCP's state-dict API (with DTensor: about a second of CPU) is imported at the first
        # save, so a run that never saves does not pay for it.
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        model, optimizer = self.resolve()
        self._warn_unregistered(optimizer)
        user = {name: obj.state_dict() for name, obj in self.named.items()}
        self.digests = {name: state_digest(user[name]) for name in sorted(user)}
        user |= {name: obj.state_dict() for name, obj in self.internal.items()}
        if is_zero1(optimizer):  # each rank gives the optimizer state it owns (zero1.py)
            ot, op = zero1_state_dict(model, optimizer)
            tensors, plain = split_state({"model": get_model_state_dict(model), "user": user})
            tensors.update({"optim": ot} if ot else {})
            plain["optim"] = op
        else:
            # Experts as one process names them (another ep size resumes from them).
            msd, osd = ep_state_views(model, *get_state_dict(model, optimizer))
            tensors, plain = split_state({"model": msd, "optim": osd, "user": user})
        if isinstance(model, PipelineView) and self.state.pp_group is not None:
            plain["optim"] = gather_optim_plain(plain["optim"], self.state.pp_group)
        # LambdaLR keeps its functions out of state_dict() (None here): nothing to pickle.
        tensors_only, sched_plain = split_state(
            {"s": [s.state_dict() for s in self.state.schedulers]}
        )
        if tensors_only:
            raise CheckpointError("an LR scheduler's state_dict() holds tensors: not supported")
        plain["schedulers"] = sched_plain["s"]
        # The data position of *this* step: an async save is committed steps later, when the
        # sampler has moved on (a JSON round trip makes it a copy).
        sampler = self.sampler.state_dict() if self.sampler is not None else None
        plain[SAMPLER_AT_SAVE] = json.loads(json.dumps(sampler))
        plain[HF_FILES] = hf_files(model)  # config.json of a transformers model, for export
        plain[PER_RANK] = {
            name: encode_tensors(obj.state_dict(), f"per_rank[{name!r}]")
            for name, obj in self.per_rank.items()
        }
        return tensors, plain

    def user_template(self, saved: Mapping[str, Any]) -> dict[str, Any]:
        """The user objects' states, and meshrun's own that the checkpoint holds (``saved``:
        its plain ``user`` part; e.g. DiLoCo switched on at this resume starts afresh), which
        a load fills in place."""
        return {name: obj.state_dict() for name, obj in self._user_objects(saved).items()}

    def load_user(self, user: Mapping[str, Any]) -> None:
        """Give each object by name (and meshrun's own, when saved) its loaded state."""
        for name, obj in self._user_objects(user).items():
            obj.load_state_dict(user[name])

    def _user_objects(self, saved: Mapping[str, Any]) -> dict[str, Stateful]:
        mine = {name: obj for name, obj in self.internal.items() if name in saved}
        return {**self.named, **mine}

    def _warn_unregistered(self, optimizer: torch.optim.Optimizer) -> None:
        driven = hasattr(optimizer.step, "_wrapped_by_lr_sched")
        registered = [*self.state.schedulers, *self.named.values(), *self.per_rank.values()]
        mine = any(getattr(s, "optimizer", None) is optimizer for s in registered)
        if driven and not mine and self.rank == 0:
            log.warning(
                "an LR scheduler steps this optimizer but is not saved: create it with "
                "run.lr_scheduler(optimizer) (or pass it to run.resume(..., sched=scheduler))"
            )


def agree_replicated(digests: Mapping[str, int], device: torch.device) -> None:
    """Every rank holds the same state of each replicated object (one copy is saved and every
    rank gets it back), else a :class:`CheckpointError` on every rank naming the objects that
    differ and the ranks. Collective, and a barrier: the save's own barrier is this all-gather
    of the digests (``Targets.digests``, the same names on every rank), a plain barrier when
    no object is registered."""
    if not digests or not dist.is_initialized() or dist.get_world_size() == 1:
        barrier()
        return
    names = sorted(digests)
    device = device if device.type == "cuda" else torch.device("cpu")
    mine = torch.tensor([digests[n] for n in names], device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    table = torch.stack(every).cpu()
    differ = {
        n: [r for r in range(len(every)) if table[r, i] != table[0, i]] for i, n in enumerate(names)
    }
    bad = {n: ranks for n, ranks in differ.items() if ranks}
    if bad:
        what = "; ".join(f"{n!r} differs between rank 0 and rank(s) {r}" for n, r in bad.items())
        raise CheckpointError(
            f"a replicated object is not the same on every rank ({what}): one copy would be "
            "saved and every rank would resume with it; register per-rank state with "
            "run.resume(..., per_rank={name: obj}) (see docs/checkpoint.md, Your own state)"
        )


def _stateful(where: str, obj: Any) -> Stateful:
    if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
        raise CheckpointError(
            f"{where}: a {type(obj).__name__} has no state_dict()/load_state_dict(); register "
            "only such objects (wrap a plain tensor or dict in a small class that has them)"
        )
    return cast(Stateful, obj)
