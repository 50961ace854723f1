"""The Hugging Face files a checkpoint keeps beside its manifest: ``config.json`` (and
``generation_config.json``) of a transformers model, so that ``meshrun ckpt export --hf``
writes a directory ``from_pretrained`` loads without the user saving the config by hand.

The model is found by walking the modules of what is saved (a DDP, FSDP2, torch.compile or
activation-checkpointing wrapper holds the user's model as a submodule): the first one that is
a transformers ``PreTrainedModel``; under pipeline parallelism, the class and configs the split
kept. transformers is never imported here: a model built with it
has already imported it.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from torch import nn

__all__ = ["CONFIG", "GENERATION_CONFIG", "HF_FILES", "hf_files"]

HF_FILES = "__hf_files__"  # the key of these files in a save's plain state (commit.py writes them)
CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"


def hf_files(model: nn.Module) -> dict[str, str]:
    """``{file name: text}`` for a model holding a transformers model; ``{}`` otherwise."""
    hf = _find_pretrained(model)
    if hf is not None:
        cls, hf_config = _user_class(hf), hf.config
        generation = getattr(hf, "generation_config", None)
    else:
        source = _pipeline_source(model)
        if source is None:
            return {}
        cls, hf_config, generation = source.model_class, source.config, source.generation_config
    config = json.loads(hf_config.to_json_string())
    # What save_pretrained records: the class from_pretrained rebuilds (and that export
    # rebuilds on the meta device to find tied weights).
    config["architectures"] = [cls.__name__]
    files = {CONFIG: json.dumps(config, indent=2, sort_keys=True) + "\n"}
    if generation is not None and hasattr(generation, "to_json_string"):
        files[GENERATION_CONFIG] = generation.to_json_string()
    return files


def _user_class(module: nn.Module) -> type:
    """The model's class, under the subclass FSDP2's ``fully_shard`` swaps in
    (``FSDPLlamaForCausalLM``, which from_pretrained cannot rebuild)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: no FSDP2 module exists
    if fsdp is None:
        return type(module)
    return next(c for c in type(module).__mro__ if not issubclass(c, fsdp.FSDPModule))


def _pipeline_source(model: nn.Module) -> Any:
    """A pipeline's stages hold no transformers model, only parts of one: the split kept the
    model's class and configs (parallel/pp/pipeline.py ``HFSource``), which the checkpoint's view of the
    stages carries (checkpoint/pipeline.py)."""
    modeling = sys.modules.get("transformers.modeling_utils")
    source = getattr(model, "meshrun_hf_source", None)
    if modeling is None or source is None:
        return None
    return source if issubclass(source.model_class, modeling.PreTrainedModel) else None


def _find_pretrained(model: nn.Module) -> Any:
    # transformers loads its modeling code lazily: without it no model class was ever built.
    modeling = sys.modules.get("transformers.modeling_utils")
    if modeling is None:
        return None
    for module in model.modules():
        if isinstance(module, modeling.PreTrainedModel):
            return module
    return None
