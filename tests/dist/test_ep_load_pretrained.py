"""``run.load_pretrained`` into an expert-parallel model reads each rank's experts only.

A tiny Qwen2-MoE (tests/moe_models.py, from a config, nothing downloaded) is saved twice with
``save_pretrained``: as transformers writes it by default, one tensor per expert
(``mlp.experts.<e>.gate_proj.weight``, ...), which the model's fused ``gate_up_proj`` /
``down_proj`` are read from; and with ``save_original_format=False``, the fused ``[E, ...]``
tensors themselves (the first also into the model in one process, without expert parallel; a Mixtral's files,
whose MoE block transformers also renames, are refused naming the missing tensors).
The model of our own (a ``ModuleList`` of experts) is saved with
``safetensors``. One 2-rank run (``ep = 2``, ZeRO-3) builds each model with other weights,
parallelizes it and loads the directory. Every parameter then equals the saved one bitwise
(the whole model gathered, and each rank's own expert tensors against the saved experts it
holds), and the reads (recorded around ``safe_open`` in each rank) cover every non-expert
tensor and the rank's own experts only: the other rank's expert tensors are never read, the
fused ones only in the rank's rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import meshrun
import meshrun.hf.reading
import moe_models
from _dist import run_distributed
from meshrun.hf import PretrainedError, load_pretrained
from meshrun.parallel.ep import full_state_dict
from meshrun.parallel.ep_dispatch import ep_containers
from meshrun.parallel.structure import ModelSpec

pytestmark = pytest.mark.slow

EXPERTS, EP = moe_models.EXPERTS, 2
MINE = EXPERTS // EP  # experts per rank


class Recorder:
    """``safe_open`` that records the data each rank reads: (name, region) per read."""

    def __init__(self, real: Any, log: list[tuple[str, Any]]) -> None:
        self.real, self.log = real, log

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _File(self.real(*args, **kwargs), self.log)


class _File:
    def __init__(self, f: Any, log: list[tuple[str, Any]]) -> None:
        self.f, self.log = f, log

    def __enter__(self) -> _File:
        self.f.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.f.__exit__(*exc)

    def keys(self) -> list[str]:
        return list(self.f.keys())

    def get_tensor(self, name: str) -> torch.Tensor:
        self.log.append((name, None))
        return self.f.get_tensor(name)

    def get_slice(self, name: str) -> Any:
        return _Slice(self.f.get_slice(name), name, self.log)


class _Slice:
    def __init__(self, s: Any, name: str, log: list[tuple[str, Any]]) -> None:
        self.s, self.name, self.log = s, name, log

    def get_shape(self) -> list[int]:
        return list(self.s.get_shape())

    def get_dtype(self) -> str:
        return str(self.s.get_dtype())

    def __getitem__(self, region: Any) -> torch.Tensor:
        value = self.s[region]
        self.log.append((self.name, region))
        return value


def load(rank: int, world_size: int, cfg: meshrun.Config, dirs: dict[str, str]) -> dict[str, Any]:
    run = meshrun.init(cfg, argv=[])
    log: list[tuple[str, Any]] = []
    meshrun.hf.reading.safe_open = Recorder(meshrun.hf.reading.safe_open, log)  # type: ignore[assignment]
    out = {}
    for label, directory in dirs.items():
        kind = "own" if label == "own" else "qwen2_moe"
        spec = ModelSpec(experts=moe_models.OWN_EXPERTS) if kind == "own" else None
        model = run.parallelize(moe_models.BUILDERS[kind](seed=1), spec=spec)
        log.clear()
        report = run.load_pretrained(model, directory)
        whole = full_state_dict(model)  # collective: every rank
        out[label] = {
            "reads": list(log),
            "bytes": report.bytes_read,
            "total": report.checkpoint_bytes,
            "whole": whole if rank == 0 else None,
            "local": own_experts(run.unwrap(model)),
        }
    run.close()
    return out


def own_experts(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's expert tensors under their local names (FSDP2's DTensors whole over the
    replicas: one rank here)."""
    containers = {id(m) for m, _ in ep_containers(model)}
    return {
        f"{name}.{rel}": (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()
        for name, m in model.named_modules()
        if id(m) in containers
        for rel, t in m.named_parameters()
    }


def global_name(local: str, first: int) -> str:
    """A ModuleList expert's local name (``...experts.experts.<i>.rest``) at its global index."""
    head, tail = local.rsplit(".experts.", 1)
    i, rest = tail.split(".", 1)
    return f"{head}.experts.{first + int(i)}.{rest}"


def expert_key(key: str) -> int | None:
    """The expert index of a per-expert checkpoint key (``...experts.<e>.`` / own model's
    ``...experts.experts.<e>.``), else None."""
    parts = key.split(".")
    for i, p in enumerate(parts[:-1]):
        if p == "experts" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


@pytest.mark.timeout(240)
def test_load_pretrained_reads_each_ranks_experts_only(tmp_path: Path) -> None:
    from safetensors import safe_open

    saved = moe_models.tiny_qwen2_moe(seed=0)
    saved.save_pretrained(tmp_path / "per_expert")
    saved.save_pretrained(tmp_path / "fused", save_original_format=False)
    own = moe_models.tiny_own(seed=0)
    (tmp_path / "own").mkdir()
    save_file(own.state_dict(), str(tmp_path / "own" / "model.safetensors"))
    dirs = {k: str(tmp_path / k) for k in ("per_expert", "fused", "own")}
    refs = {"per_expert": saved.state_dict(), "fused": saved.state_dict()}
    refs["own"] = own.state_dict()
    keys = {}
    for label, d in dirs.items():
        with safe_open(str(Path(d) / "model.safetensors"), framework="pt") as f:
            keys[label] = set(f.keys())
    # transformers writes one tensor per expert by default; the fused file holds [E, ...]
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in keys["per_expert"]
    assert "model.layers.0.mlp.experts.gate_up_proj" in keys["fused"]
    # Without expert parallel (one process) the per-expert files fill the fused tensors too.
    plain = moe_models.tiny_qwen2_moe(seed=1)
    load_pretrained(plain, dirs["per_expert"])
    assert all(torch.equal(v, refs["per_expert"][k]) for k, v in plain.state_dict().items())
    # Mixtral's files also rename its MoE block (block_sparse_moe.): not converted, refused
    # before anything is read, naming what is missing.
    moe_models.tiny_mixtral(seed=0).save_pretrained(tmp_path / "mixtral")
    with pytest.raises(PretrainedError, match=r"missing .*model\.layers\.0\.mlp\.gate\.weight"):
        load_pretrained(moe_models.tiny_mixtral(seed=1), tmp_path / "mixtral")

    cfg = meshrun.Config()
    cfg.job.run_dir, cfg.job.device, cfg.job.timeout_s = str(tmp_path / "run"), "cpu", 60.0
    cfg.metrics.progress = False
    cfg.parallel.ep, cfg.parallel.zero = EP, 3
    results = run_distributed(load, EP, cfg, dirs, timeout=200)

    for label, ref in refs.items():
        whole = results[0][label]["whole"]
        assert whole.keys() == ref.keys(), label
        assert all(torch.equal(whole[k], ref[k]) for k in ref), label
        expert_keys = {k for k in keys[label] if expert_key(k) is not None}
        for rank, r in enumerate(results):
            got = r[label]
            mine = range(rank * MINE, (rank + 1) * MINE)
            for name, t in got["local"].items():  # this rank's experts, bitwise
                if expert_key(name) is None:  # fused: the rank's rows
                    assert torch.equal(t, ref[name][mine.start : mine.stop]), (label, name)
                else:  # ModuleList: local index i is expert rank * MINE + i
                    assert torch.equal(t, ref[global_name(name, mine.start)]), (label, name)
            read = [name for name, _ in got["reads"]]
            assert len(read) == len(set(read)), label  # each tensor read once
            own = {k for k in expert_keys if expert_key(k) in mine}
            # its own experts' tensors and no other expert's (a dense tensor it holds no rows
            # of under ZeRO-3, such as the [1, H] shared_expert_gate on rank 1, is not read)
            assert set(read) & expert_keys == own, (label, sorted(set(read) ^ own)[:6])
            if label == "fused":  # the fused tensors: only this rank's rows
                rows = [
                    reg[0] for n, reg in got["reads"] if n.endswith(("gate_up_proj", "down_proj"))
                ]
                assert len(rows) == 2 * moe_models.LAYERS
                assert all((r.start, r.stop) == (mine.start, mine.stop) for r in rows)
            print(
                f"{label}: rank {rank} read {len(read)} of {len(keys[label])} tensors "
                f"({len(expert_keys & set(read))} of {len(expert_keys)} expert tensors), "
                f"{got['bytes']} of {got['total']} bytes"
            )
            assert got["bytes"] < got["total"]
        every = {name for r in results for name, _ in r[label]["reads"]}
        assert every == keys[label], label  # together the ranks read the whole checkpoint
