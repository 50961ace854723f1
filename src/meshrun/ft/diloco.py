"""DiLoCo and streaming DiLoCo across replica groups, on torchft's ``DiLoCo``
(``fault_tolerance.diloco_sync_every = H > 0``; docs/fault_tolerance.md, "DiLoCo").

Each group steps the user's optimizer alone (the inner step: inside the group its layout
averages the gradients as without replica groups, but nothing crosses groups). Every H steps
torchft's ``DiLoCo`` averages the pseudo-gradient (the last synchronised weights minus the
group's weights) over the live groups, puts the weights back to the synchronised ones and
steps the outer optimizer (SGD, Nesterov by default) on that average. With
``diloco_fragments = N`` (streaming DiLoCo) the parameters are cut into N contiguous parts
and one part is synchronised every H / N steps, in turn.

meshrun drives torchft's loop, it does not reimplement it: ``run.optimizer_step`` calls the
hooks torchft would register on the optimizer (before and after each inner step), once per
*counted* step, so every group's window advances with the run's step counter even when the
numerics guard or the fp16 scaler skips an update (a hook on ``optimizer.step`` would not
fire there, and one group's window would slip behind the others'). torchft's quorum call
goes through ``ReplicaGroup.start_step`` (the quorum check, the first quorum's wait for every
group, the data share, healing and its metrics), and torchft's step counter counts outer
synchronisations, saved and restored with this state.

A group that restarts trains from its checkpoint (or step 0) until its first synchronisation,
where it heals from a live peer (weights, inner optimizer, the synchronised weights and the
outer optimizer, the data position) and syncs with it: torchft's design (the healed group's
pseudo-gradient is its peer's, counted twice in that average).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from meshrun.config.fault_tolerance import FaultToleranceConfig
from meshrun.ft.replica import ReplicaGroup, _one_line

__all__ = ["DiLoCoSync", "OuterOutcome", "split_fragments"]


@dataclass(frozen=True)
class OuterOutcome:
    """What the step's outer synchronisation did (None from :meth:`DiLoCoSync.after_step`
    on the steps in between)."""

    committed: bool
    fragment: int
    live_groups: int


class DiLoCoSync:
    """torchft's ``DiLoCo`` for one group's rank: :meth:`attach` once the optimizer is known,
    then :meth:`before_update` and :meth:`after_step` around every counted step."""

    def __init__(self, cfg: FaultToleranceConfig, replicas: ReplicaGroup) -> None:
        self.cfg, self.replicas = cfg, replicas
        # torchft's step counter counts DiLoCo's synchronisations (restored with this state),
        # not the run's steps: the quorum must not set it from them.
        replicas.outer_steps = True
        replicas.live_groups = cfg.replica_groups  # until the first quorum says otherwise
        self._manager = _QuorumThroughGroup(replicas)
        self._diloco: Any = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._fragments: list[_Fragment] = []
        self._outer: list[torch.optim.SGD] = []
        # False until the synchronised weights are this run's: a fresh run takes them at its
        # first step (after run.resume's init_from or anything else the script loaded).
        self._synced = False

    def attach(self, models: Sequence[nn.Module], optimizer: torch.optim.Optimizer) -> None:
        """Build torchft's DiLoCo over ``models``' parameters with ``optimizer`` as the inner
        one (once; the run must keep stepping that optimizer)."""
        if self._optimizer is optimizer:
            return
        if self._optimizer is not None:
            raise RuntimeError(
                "DiLoCo (fault_tolerance.diloco_sync_every > 0) steps one inner optimizer, "
                f"but run.optimizer_step got a second one ({type(optimizer).__name__}); step "
                "one optimizer over all the parameters"
            )
        from torchft.local_sgd import DiLoCo

        cfg = self.cfg
        self._fragments = split_fragments(models, cfg.diloco_fragments)
        nesterov = cfg.diloco_nesterov and cfg.diloco_outer_momentum > 0
        self._outer = [
            torch.optim.SGD(
                list(f.parameters()),
                lr=cfg.diloco_outer_lr,
                momentum=cfg.diloco_outer_momentum,
                nesterov=nesterov,
            )
            for f in self._fragments
        ]
        # One outer optimizer per fragment: one over every parameter would also move the other
        # fragments at a fragment's outer step (torchft takes a list for that reason).
        self._diloco = DiLoCo(
            self._manager,
            list(self._fragments),
            optimizer,
            list(self._outer),
            sync_every=cfg.diloco_sync_every,
            should_quantize=False,  # refused in the config (no Triton on Gloo)
            fragment_sync_delay=cfg.diloco_fragment_sync_delay,
            fragment_update_alpha=cfg.diloco_fragment_update_alpha,
        )
        self._optimizer = optimizer
        self._zero_momentum()

    def _zero_momentum(self) -> None:
        """Momentum buffers of zeros from the start: SGD's first step makes the buffer the
        gradient either way (0 * m + g = g, bit for bit), and a checkpoint then always holds
        them, so a resume loads into buffers of the right shapes."""
        if self.cfg.diloco_outer_momentum == 0:
            return
        for outer in self._outer:
            for group in outer.param_groups:
                for p in group["params"]:
                    outer.state[p].setdefault("momentum_buffer", torch.zeros_like(p))

    def before_update(self) -> None:
        """Before the inner step: a fresh run's synchronised weights are its current ones; a
        heal must not read the weights while the optimizer writes them (torchft's pre-hook)."""
        if not self._synced:
            self._diloco._save_parameters()
            self._synced = True
        self._diloco._step_pre_hook(self._optimizer, (), {})

    def after_step(self) -> OuterOutcome | None:
        """After the inner step (counted, even if skipped): torchft's post-hook, which every
        H / fragments steps takes the quorum and syncs a fragment."""
        self._manager.committed = None
        self._diloco._step_post_hook(self._optimizer, (), {})
        committed = self._manager.committed
        if committed is None:
            return None
        fragment = self._manager.synced_step % len(self._fragments)
        if not committed:
            self.replicas.metrics.log_event(
                "ft_uncommitted",
                step=self.replicas.state.step,
                live_groups=self.replicas.live_groups,
                error=_one_line(self.replicas.manager.errored()),
                outer_fragment=fragment,
            )
        return OuterOutcome(committed, fragment, self.replicas.live_groups)

    def samples(self, global_batch: int) -> int:
        """The positions a step covers: the live groups' shares as of the last quorum."""
        groups = self.cfg.replica_groups
        return global_batch * (self.replicas.live_groups or groups) // groups

    # --- checkpoints: the synchronised weights, the outer optimizer, where in the window --

    def state_dict(self) -> dict[str, Any]:
        """Tensors laid out like the parameters (a DTensor's shard as a DTensor, so DCP saves
        each shard once), and the counters."""
        if self._diloco is None:
            raise RuntimeError(
                "DiLoCo's state is known once its optimizer is: call run.resume(model, "
                "optimizer, loader) or run.optimizer_step before saving a checkpoint"
            )
        self._check_nothing_in_flight()
        manager = self.replicas.manager
        original: dict[str, Any] = {}
        momentum: dict[str, Any] = {}
        for frag, torchft_frag, outer in self._parts():
            for n, p in frag.named_parameters():
                original[n] = _like(p, torchft_frag.original_parameters[n])
                if self.cfg.diloco_outer_momentum:
                    momentum[n] = outer.state[p]["momentum_buffer"]
        return {
            # Keyed by parameter, not by fragment: the fragments are cut anew from the same
            # parameters on resume.
            "original": original,
            **({"momentum": momentum} if momentum else {}),
            "local_step": int(self._diloco._local_step),
            "outer_step": int(manager.current_step()),
            "batches_committed": int(manager.batches_committed()),
        }

    def _check_nothing_in_flight(self) -> None:
        """A fragment's all-reduce started ``diloco_fragment_sync_delay`` steps before its
        outer step is not in a checkpoint (a resume would reach that outer step without it):
        the config puts the periodic saves on window boundaries, and this refuses the rest."""
        if any(f._allreduce_work for f in self._diloco._fragments):
            window = self.cfg.diloco_sync_every // self.cfg.diloco_fragments
            raise RuntimeError(
                f"cannot save a checkpoint at step {self.replicas.state.step}: a DiLoCo "
                f"fragment's all-reduce is in flight (fault_tolerance.diloco_fragment_sync_delay "
                f"= {self.cfg.diloco_fragment_sync_delay}: the last steps before each outer "
                f"step, every {window} steps); save at a multiple of {window}, or set "
                "diloco_fragment_sync_delay = 0"
            )

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        with torch.no_grad():
            for frag, torchft_frag, outer in self._parts():
                for n, p in frag.named_parameters():
                    torchft_frag.original_parameters[n].copy_(_local(state["original"][n]))
                    if "momentum" in state:
                        outer.state[p]["momentum_buffer"].copy_(state["momentum"][n])
        self._diloco._local_step = int(state["local_step"])
        self.replicas.manager.load_state_dict(
            {"step": int(state["outer_step"]), "batches_committed": int(state["batches_committed"])}
        )
        self._synced = True

    def _parts(self) -> Iterator[tuple[_Fragment, Any, torch.optim.SGD]]:
        yield from zip(self._fragments, self._diloco._fragments, self._outer, strict=True)


class _QuorumThroughGroup:
    """torchft's Manager as its DiLoCo sees it: the quorum is the group's
    (``ReplicaGroup.start_step``, looked up at each call), the commit decision recorded."""

    def __init__(self, replicas: ReplicaGroup) -> None:
        self._replicas = replicas
        self.committed: bool | None = None
        self.synced_step = 0  # torchft's step of the last sync (after a heal: the peer's)

    def start_quorum(self, *args: Any, **kwargs: Any) -> None:
        self._replicas.start_step()

    def should_commit(self, *args: Any, **kwargs: Any) -> bool:
        self.synced_step = self._replicas.manager.current_step()
        self.committed = bool(self._replicas.manager.should_commit(*args, **kwargs))
        return self.committed

    def __getattr__(self, name: str) -> Any:
        return getattr(self._replicas.manager, name)


class _Fragment(nn.Module):
    """A contiguous run of the model's parameters, as torchft's DiLoCo takes a fragment (it
    reads ``named_parameters()``): the parameters themselves, not copies."""

    def __init__(self, params: list[tuple[str, nn.Parameter]]) -> None:
        super().__init__()
        self.listed = params

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        yield from self.listed

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        for _, p in self.listed:
            yield p


def split_fragments(models: Sequence[nn.Module], n: int) -> list[_Fragment]:
    """This rank's parameters of ``models`` (in order, shared ones once) cut into ``n``
    contiguous runs of about equal size: streaming DiLoCo's fragments, the same on every
    group (the same layout holds the same parameters)."""
    named: list[tuple[str, nn.Parameter]] = []
    seen: set[int] = set()
    for m, model in enumerate(models):
        for name, p in model.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                named.append((f"{m}.{name}" if len(models) > 1 else name, p))
    if len(named) < n:
        raise RuntimeError(
            f"fault_tolerance.diloco_fragments = {n}, but this rank holds {len(named)} "
            "parameter tensors: each fragment needs one at least; use fewer fragments"
        )
    # Whole sizes (a DTensor's numel is the whole tensor's): the same cuts on every rank.
    cum = list(itertools.accumulate(p.numel() for _, p in named))
    cuts = [0]
    for k in range(1, n):  # the cut nearest the k-th n-th, leaving a tensor for each rest
        lo, hi = cuts[-1] + 1, len(named) - (n - k)
        cuts.append(min(range(lo, hi + 1), key=lambda c: abs(cum[c - 1] * n - cum[-1] * k)))
    cuts.append(len(named))
    return [_Fragment(named[a:b]) for a, b in itertools.pairwise(cuts)]


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` (torchft keeps a DTensor parameter's shard) laid out as ``param``."""
    if isinstance(param, DTensor):
        return DTensor.from_local(
            local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
        )
    return local


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t
