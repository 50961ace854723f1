"""The pipeline stages build each block's attention mask with transformers' own masking
functions, whose signatures move: a renamed or retired argument stays in the signature for a
few releases behind ``deprecate_kwarg``, which warns (FutureWarning) whenever it is given, even
as None. meshrun's own calls must never set that warning off (it did, as the masking functions
moved on); checked here on the installed functions and on signatures shaped like the coming
ones, built with transformers' own decorator."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, masking_utils
from transformers.utils.deprecation import deprecate_kwarg

from meshrun.parallel.pp.stages import _mask_kwargs

H = torch.zeros(1, 4, 8)
POS = torch.arange(4).unsqueeze(0)


@deprecate_kwarg("past_key_values", "9.0.0", new_name="cache")
@deprecate_kwarg("cache_position", "9.0.0")
def renamed(
    config: Any,
    inputs_embeds: torch.Tensor,
    attention_mask: Any,
    cache: Any = None,
    position_ids: Any = None,
    past_key_values: Any = None,
    cache_position: Any = None,
) -> dict[str, Any]:
    return {"cache": cache, "position_ids": position_ids, "cache_position": cache_position}


def older(
    config: Any,
    inputs_embeds: torch.Tensor,
    attention_mask: Any,
    cache_position: torch.Tensor,
    past_key_values: Any,
    position_ids: Any = None,
) -> dict[str, Any]:
    return {"cache_position": cache_position, "position_ids": position_ids}


def test_a_retired_optional_argument_is_not_given() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        got = renamed(**_mask_kwargs(renamed, None, H, POS))
    # position_ids is optional: left out, as the model's own forward leaves it (the stage's
    # positions are arange, so transformers' packed-sequence check on them has nothing to find)
    assert got["position_ids"] is None and got["cache_position"] is None


def test_required_arguments_are_still_given() -> None:
    kw = _mask_kwargs(older, None, H, POS)
    assert kw["past_key_values"] is None and torch.equal(kw["cache_position"], POS[0])
    assert older(**kw)["position_ids"] is None


@pytest.mark.parametrize(
    "fn", [masking_utils.create_causal_mask, masking_utils.create_sliding_window_causal_mask]
)
def test_the_installed_masking_functions_give_no_future_warning(fn: Any) -> None:
    config = LlamaConfig(
        hidden_size=8, num_attention_heads=2, num_hidden_layers=1, sliding_window=2, vocab_size=16
    )
    config._attn_implementation = "sdpa"
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        fn(**_mask_kwargs(fn, config, H, POS))


@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2"])
def test_hf_stages_run_without_a_future_warning(name: str) -> None:
    """The whole stage path (masks, rotary embeddings, each block) on the installed
    transformers: any FutureWarning from meshrun's calls fails here, not in a user's log."""
    from test_pp_stages import MODELS, stages_of

    from meshrun.parallel.pp.stages import check_stages_reproduce

    model = MODELS[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        check_stages_reproduce(model, stages_of(model, 2))
