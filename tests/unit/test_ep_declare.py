"""Expert parallel without processes: where the experts are declared, and what is refused
before any process group is needed."""

from __future__ import annotations

import pytest
import torch

import moe_models
from meshrun.config import ConfigError, ParallelConfig
from meshrun.parallel import parallelize
from meshrun.parallel.ep import find_experts
from meshrun.parallel.ep_dispatch import imbalance
from meshrun.parallel.structure import ExpertsDecl, ModelSpec

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("kind", ["qwen2_moe", "mixtral"])
def test_hf_models_declare_their_experts_in_the_ep_plan(kind: str) -> None:
    decl, source = find_experts(moe_models.BUILDERS[kind](), None)
    assert decl == ExpertsDecl("model.layers.*.mlp.experts")
    assert source == "config.base_model_ep_plan"


def test_own_model_declares_its_experts_with_the_spec() -> None:
    model = moe_models.tiny_own()
    assert find_experts(model, None) == (None, "")
    decl, source = find_experts(model, ModelSpec(experts=moe_models.OWN_EXPERTS))
    assert (decl, source) == (ExpertsDecl(moe_models.OWN_EXPERTS), "ModelSpec.experts")
    custom = ExpertsDecl("layers.*.moe.experts", num_experts_attr="n")
    assert find_experts(model, ModelSpec(experts=custom))[0] == custom


def test_ep_without_a_process_group_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"parallel.ep = 2 .*runs alone \(no process group\)"):
        parallelize(moe_models.tiny_mixtral(), None, ParallelConfig(ep=2), torch.device("cpu"))


def test_imbalance_is_max_over_mean() -> None:
    assert imbalance([4, 4, 4, 4]) == 1.0
    assert imbalance([8, 0, 4, 4]) == 2.0
    assert imbalance([0, 0]) == 1.0
