"""Resume: choose the checkpoint, load it into this run's layout (DCP re-shards), restore the
schedulers, the data position, the step, the per-rank objects and the RNG streams, and rescale
the LR when the global batch changed (``checkpoint.allow_new_global_batch``)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshrun.checkpoint import on_disk
from meshrun.checkpoint.checks import (
    CheckpointError,
    check_keys,
    ddp_replay_note,
    layout_text,
    pick,
    reseed,
)
from meshrun.checkpoint.commit import STATE_FILE, rank_file
from meshrun.checkpoint.facts import RunFacts
from meshrun.checkpoint.pipeline import PipelineView
from meshrun.checkpoint.state import decode_json, merge_state, restore_rng, split_state
from meshrun.checkpoint.targets import PER_RANK, Targets
from meshrun.checkpoint.zero1 import is_zero1, zero1_load, zero1_load_template
from meshrun.config import CheckpointConfig
from meshrun.parallel.ep import layout_of
from meshrun.parallel.ep_checkpoint import ep_loaded, ep_state_views
from meshrun.runtime.schedule import scale_lr

__all__ = ["Resume", "check_per_rank", "choose", "restore_per_rank", "restore_progress"]

log = logging.getLogger("meshrun")


def choose(root: Path, mode: str, rank: int) -> Path | None:
    """The checkpoint to resume from (rank 0 validates, all ranks get its answer)."""
    answer: list[Any] = [None, None]
    if rank == 0:
        try:
            answer[0] = pick(root, mode)
        except CheckpointError as e:
            answer[1] = str(e)
    if dist.is_initialized():
        dist.broadcast_object_list(answer, src=0)
    if answer[1] is not None:
        raise CheckpointError(answer[1])
    return None if answer[0] is None else Path(answer[0])


def check_per_rank(
    targets: Targets, saved: list[str], old: tuple[int, int], now: tuple[int, int], name: str
) -> None:
    """The per-rank objects this run registers must be those saved (``saved``: their names),
    on the ranks they were saved on (``old``, ``now``: world size and data-parallel size): a
    rank's state belongs to its share of the data, which another layout deals out anew.
    Checked before anything loads."""
    mine = sorted(targets.per_rank)
    if mine != sorted(saved):
        raise CheckpointError(
            f"{name} holds per-rank objects {sorted(saved)}, this run registers {mine} "
            "(run.resume(..., per_rank={...}); a StatefulDataLoader passed as the loader is "
            "one, named 'loader'): register the same ones"
        )
    if mine and old != now:
        raise CheckpointError(
            f"{name} was saved on {old[0]} ranks (dp {old[1]}), this run has {now[0]} (dp "
            f"{now[1]}): per-rank objects {mine} hold each rank's own state (e.g. a hidden "
            "state carried over that rank's data), and this layout deals the data out "
            f"differently, so no saved rank's state is this rank's; resume on {old[0]} ranks "
            f"with dp {old[1]}, or leave them out of run.resume(...) for this run to start "
            "them from their current state"
        )


def restore_per_rank(targets: Targets, states: dict[str, Any]) -> None:
    """Load each per-rank object's saved state (tensors onto the device its current state
    has them, as DCP loads into the current state)."""
    for key, obj in targets.per_rank.items():
        if key not in states:
            raise CheckpointError(f"no saved state of per-rank object {key!r} on this rank")
        obj.load_state_dict(_onto(decode_json(states[key]), obj.state_dict()))


def _onto(saved: Any, current: Any) -> Any:
    if isinstance(saved, torch.Tensor):
        return saved.to(current.device) if isinstance(current, torch.Tensor) else saved
    if isinstance(saved, dict):
        here = current if isinstance(current, dict) else {}
        return {k: _onto(v, here.get(k)) for k, v in saved.items()}
    if isinstance(saved, (list, tuple)):
        there = current if isinstance(current, (list, tuple)) else ()
        out = [_onto(v, there[i] if i < len(there) else None) for i, v in enumerate(saved)]
        return out if isinstance(saved, list) else tuple(out)
    return saved


def restore_progress(targets: Targets, saved: dict[str, Any], name: str) -> None:
    """The LR schedulers, the data position and the step of a saved state (``name``: where it
    came from, for the messages); the shared and the node-local tier restore them alike. A
    node-local shard (same world) also holds this rank's per-rank objects."""
    state = targets.state
    state.rng_restored = True  # each path restores this rank's RNG next (same world)
    if PER_RANK in saved["plain"]:
        restore_per_rank(targets, saved["plain"][PER_RANK])
    scheds = decode_json(saved["plain"]["schedulers"])
    if len(scheds) != len(state.schedulers):
        raise CheckpointError(
            f"{name} holds {len(scheds)} LR scheduler(s), this run has "
            f"{len(state.schedulers)}: create the same schedulers (run.lr_scheduler) before run.resume"
        )
    for sched, sd in zip(state.schedulers, scheds, strict=True):
        sched.load_state_dict(sd)
    sampler = targets.sampler
    if saved["sampler"] is not None and sampler is None:
        log.warning(
            "%s: the data position was not restored: pass the loader to run.resume(model, optimizer, loader)",
            name,
        )
    elif saved["sampler"] is not None and sampler is not None:
        sampler.load_state_dict(saved["sampler"])
    state.set_position(int(saved["step"]))


class Resume:
    """Loads the checkpoint ``checkpoint.resume`` names into the registered targets."""

    def __init__(self, cfg: CheckpointConfig, facts: RunFacts, targets: Targets) -> None:
        self.cfg = cfg
        self.facts = facts
        self.targets = targets

    def load(self) -> int | None:
        """Load the checkpoint chosen by ``checkpoint.resume``; return its step (None: none)."""
        f = self.facts
        path = choose(f.root, self.cfg.resume, f.rank)
        if path is None:
            if f.rank == 0 and self.cfg.resume == "auto":
                log.info("no valid checkpoint under %s: starting at step 0", f.root)
            if self.cfg.init_from:  # a fresh run: weights only (checkpoint/init_from.py)
                # Here: a run without init_from never loads it (nor meshrun.hf's reading).
                from meshrun.checkpoint.init_from import load_initial_weights

                load_initial_weights(
                    Path(self.cfg.init_from), self.targets.resolve()[0], f.device, f.rank
                )
            return None
        model, optimizer = self.targets.resolve()
        saved = json.loads((path / STATE_FILE).read_text())
        manifest = on_disk.read_manifest(path)
        lr_factor = self._check_batch(path, manifest)
        old = (int(manifest["world_size"]), int(manifest["dp_size"]))
        names = saved.get("per_rank", [])
        check_per_rank(self.targets, names, old, (f.world, f.dp), path.name)
        full = self._load_tensors(path, model, optimizer, saved["plain"])
        self.targets.load_user(full["user"])
        self._restore_rest(path, saved, manifest)
        if lr_factor != 1.0:
            self._rescale_lr(optimizer, lr_factor)
        return int(saved["step"])

    def _load_tensors(
        self,
        path: Path,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        plain: dict[str, Any],
    ) -> dict[str, Any]:
        """Load model, optimizer and user tensors from ``path`` into this run's layout (DCP
        re-shards); returns the merged state (for the user objects). DCP is imported here, at
        the first resume: a run that never loads or saves does not pay for its import."""
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_state_dict,
            set_model_state_dict,
            set_state_dict,
        )

        from meshrun.checkpoint import safe_metadata  # DCP's pickle read restricted

        user = self.targets.user_template(plain.get("user", {}))
        if not is_zero1(optimizer):
            msd, osd = get_state_dict(model, optimizer)
            views = ep_state_views(model, msd, osd)  # experts as one process names them
            tensors, _ = split_state({"model": views[0], "optim": views[1], "user": user})
            check_keys(path, tensors, known=self._other_stages_keys(model, tensors))
            safe_metadata.load(tensors, path)
            full = merge_state(tensors, plain)
            if views[0] is not msd:  # loaded in place through the views: this rank's names
                full["model"], full["optim"] = ep_loaded(msd, osd, full["optim"])
            set_state_dict(
                model, optimizer, model_state_dict=full["model"], optim_state_dict=full["optim"]
            )
            return full
        # ZeRO-1: each rank loads the optimizer state of the parameters it owns now.
        meta = safe_metadata.read_metadata(path)
        stage = isinstance(model, PipelineView)  # pp x ZeRO-1: this rank's stages only
        template, seen = zero1_load_template(model, optimizer, meta, partial=stage)
        tensors, _ = split_state({"model": get_model_state_dict(model), "user": user})
        check_keys(path, tensors, known=seen | self._other_stages_keys(model, tensors))
        safe_metadata.load({**tensors, "optim": {"state": template}}, path)
        full = merge_state(tensors, plain)
        set_model_state_dict(model, full["model"])
        zero1_load(model, optimizer, template, plain["optim"], partial=stage)
        return full

    def _other_stages_keys(self, model: nn.Module, tensors: dict[str, Any]) -> set[str]:
        """Under pipeline parallelism each rank holds only its stages, under expert parallel
        only its experts: the keys of the others (all-gathered) are known to this run, not
        extra."""
        split = isinstance(model, PipelineView) or layout_of(model) is not None
        if not split or not dist.is_initialized():
            return set()
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict

        every: list[Any] = [None] * self.facts.world
        dist.all_gather_object(every, sorted(flatten_state_dict(tensors)[0]))
        return {k for keys in every for k in keys}

    def _restore_rest(self, path: Path, saved: dict[str, Any], manifest: dict[str, Any]) -> None:
        f = self.facts
        restore_progress(self.targets, saved, path.name)
        # Each rank's RNG file is its own only where the ranks deal out the data as before
        # (another dp size on as many ranks is a new layout: the TP ranks of one data-parallel
        # coordinate would get different streams).
        same_world = manifest["world_size"] == f.world and manifest["dp_size"] == f.dp
        if same_world:
            mine = json.loads((path / rank_file(f.rank)).read_text())
            restore_per_rank(self.targets, mine.get("per_rank", {}))
            restore_rng(mine)
        else:  # torch's stream: per data-parallel coordinate when run.steps begins
            reseed(f.seed, int(saved["step"]), f.rank)
            self.targets.state.rng_restored = False
        if f.rank == 0:
            log.info("%s", self._plan_text(path, saved, manifest, same_world))

    def _plan_text(
        self, path: Path, saved: dict[str, Any], m: dict[str, Any], same_world: bool
    ) -> str:
        f = self.facts
        pos = f"{saved['sampler']['consumed']} samples" if saved["sampler"] else "not saved"
        head = f"resumed from {path} (step {saved['step']}, data position {pos})"
        note = ddp_replay_note(self.targets.model)
        head += f"; {note}" if note else ""
        if same_world:
            return head
        return (
            f"{head}; resharding: saved on {m['world_size']} ranks (dp {m['dp_size']}, accum "
            f"{m['accum']}, {m['layout']}) -> {f.world} ranks (dp {f.dp}, accum "
            f"{f.accum}, {layout_text(self.targets.model)}); global batch {m['global_batch']} "
            "kept; model/optimizer tensors re-sharded by DCP; RNG streams re-seeded from "
            "(seed, step, rank), torch's per data-parallel coordinate, since ranks changed"
        )

    def _check_batch(self, path: Path, m: dict[str, Any]) -> float:
        """The LR factor for this run's global batch vs the checkpoint's (1.0 if equal)."""
        old, new = int(m["global_batch"]), self.facts.global_batch
        if old == new:
            return 1.0
        rule = self.facts.lr_scaling
        if not self.cfg.allow_new_global_batch:
            raise CheckpointError(
                f"{path.name} was trained with data.global_batch = {old}, this run has {new}: "
                f"set --data.global_batch={old} to continue the same run (accumulation is "
                "re-derived for any number of ranks), or --checkpoint.allow_new_global_batch=true "
                f"to change it (the LR is then rescaled by optim.lr_scaling = {rule!r})"
            )
        factor = scale_lr(1.0, new, old, rule)
        if self.facts.rank == 0:
            log.warning(
                "%s: global batch %d -> %d (checkpoint.allow_new_global_batch): LR x %.4g "
                "(optim.lr_scaling = %s); the data position carries over in samples",
                *(path.name, old, new, factor, rule),
            )
        return factor

    def _rescale_lr(self, optimizer: torch.optim.Optimizer, factor: float) -> None:
        # The restored LR (and the schedulers' base LRs, which later steps derive from) belong
        # to the old global batch; scale both so the schedule continues at the new batch's LR.
        for group in optimizer.param_groups:
            for key in ("lr", "initial_lr"):
                if key in group:
                    group[key] = group[key] * factor
        for sched in self.targets.state.schedulers:
            sched.base_lrs = [lr * factor for lr in sched.base_lrs]
