"""Pipeline stages of models meshrun did not write, in one process: the stages run in a row give
the model's own logits (Hugging Face decoder layers get their causal mask and rotary
embeddings on every stage), keep the model's names, follow the user's split points, and a split
that does not reproduce the model is refused before training."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from torch import Tensor, nn

from byo_models import NanoGPT, tiny_gpt2, tiny_llama, tiny_qwen2
from meshrun.config import ConfigError, ParallelConfig
from meshrun.demo.model import GPT, demo_config
from meshrun.parallel.pp.placement import rank_of_stage
from meshrun.parallel.pp.split import split_model
from meshrun.parallel.pp.stages import StageModule, StageParts, check_stages_reproduce, hf_context
from meshrun.parallel.pp.tied import plan_tied
from meshrun.parallel.structure import ModelSpec, find_structure, is_hf_model


def nanogpt() -> nn.Module:
    torch.manual_seed(0)
    return NanoGPT()


def demo() -> nn.Module:
    torch.manual_seed(0)
    return GPT(replace(demo_config("tiny"), n_layer=4))


MODELS: dict[str, Callable[[], nn.Module]] = {
    "llama": tiny_llama,
    "qwen2": tiny_qwen2,
    "gpt2": tiny_gpt2,
    "nanogpt": nanogpt,
    "demo": demo,
}


def stages_of(model: nn.Module, n: int, spec: ModelSpec | None = None) -> list[StageModule]:
    s = find_structure(model, spec)
    kwargs, shared = hf_context(model, s.block_names()) if is_hf_model(model) else (None, ())
    return [StageModule(model, p, kwargs) for p in split_model(model, s, n, shared).parts]


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("n", [2, 4])
def test_stages_in_a_row_are_the_model(name: str, n: int) -> None:
    model = MODELS[name]()
    stages = stages_of(model, n)
    check_stages_reproduce(model, stages)  # raises if not
    names = [k for st in stages for k in st.state_dict() if not k.endswith("inv_freq")]
    assert sorted(set(names)) == sorted(model.state_dict())  # the model's own FQNs
    assert stages[0].is_first and stages[-1].is_last and not stages[0].is_last


def test_hf_layers_without_the_causal_mask_are_refused() -> None:
    """Under eager attention a Llama layer given attention_mask=None attends to every
    position: the check sees the different model and refuses it."""
    model = tiny_llama()
    s = find_structure(model)
    kwargs, shared = hf_context(model, s.block_names())

    def no_mask(h: Tensor, stage: nn.Module, fqns: object) -> list[dict[str, object]]:
        return [{**kw, "attention_mask": None} for kw in kwargs(h, stage, fqns)]  # type: ignore[arg-type]

    parts = split_model(model, s, 2, shared).parts
    with pytest.raises(ConfigError, match="do not reproduce its forward"):
        check_stages_reproduce(model, [StageModule(model, p, no_mask) for p in parts])


class ScaledNanoGPT(NanoGPT):
    """A forward that does more than its modules (Gemma scales its embeddings)."""

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, None]:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) * 2 + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x)), None


def test_a_forward_the_stages_do_not_rebuild_is_refused() -> None:
    model = ScaledNanoGPT()
    with pytest.raises(ConfigError, match=r"parallel.pp: ScaledNanoGPT's pipeline stages"):
        check_stages_reproduce(model, stages_of(model, 2))


def test_user_split_points_by_fqn() -> None:
    model = nanogpt()
    spec = ModelSpec(split_points=("transformer.h.1",))
    stages = stages_of(model, 2, spec)
    assert stages[0].meshrun_parts.blocks == ("transformer.h.0",)
    assert stages[1].meshrun_parts.blocks == tuple(f"transformer.h.{i}" for i in (1, 2, 3))
    check_stages_reproduce(model, stages)
    with pytest.raises(ConfigError, match=r"ModelSpec.split_points = \['transformer.h.9'\]"):
        stages_of(model, 2, ModelSpec(split_points=("transformer.h.9",)))
    with pytest.raises(ConfigError, match="give 2 FQNs of blocks"):
        stages_of(model, 3, spec)


def test_tied_pairs_across_stages() -> None:
    model = nanogpt()
    s = find_structure(model)
    parts = split_model(model, s, 4).parts
    pairs = plan_tied(s.tied, parts, lambda stage: stage)  # pp = 4, one stage per rank
    assert [(p.fqns, p.stages, p.ranks) for p in pairs] == [
        (("transformer.wte.weight", "lm_head.weight"), (0, 3), (0, 3))
    ]
    # Interleaved with 2 stages per rank: stages 0 and 3 are on ranks 0 and 1, kept tied.
    looped = ParallelConfig(pp=2, pp_schedule="interleaved")
    assert len(plan_tied(s.tied, parts, lambda stage: rank_of_stage(stage, looped))) == 1
    # A pair on two stages of one rank is refused, with the reason: looped stages pp apart,
    # and under a V the first and the last stage (both on rank 0).
    odd = [StageParts(p.before, p.blocks, p.after) for p in parts]
    with pytest.raises(ConfigError, match="two stages of one rank"):
        pair = (("transformer.wte.weight", "transformer.h.2.mlp.c_fc.weight"),)
        plan_tied(pair, odd, lambda stage: rank_of_stage(stage, looped))
    v = ParallelConfig(pp=2, pp_schedule="zbv")
    with pytest.raises(ConfigError, match=r"lm_head.weight \(stage 3\) land on two stages of one"):
        plan_tied(s.tied, parts, lambda stage: rank_of_stage(stage, v))
