"""MFU's two halves: the model's training FLOPs and the devices' peak FLOP/s.

FLOPs (forward + backward), first found of:

- ``metrics.flops_per_sample``: per sample, for any workload (an image, a clip, a sequence);
- ``run.set_flops_per_token(f)``: per token, for the user's own formula;
- a mixture-of-experts model (a Hugging Face MoE causal LM, or the user's own model whose
  config declares ``num_experts`` and ``num_experts_per_tok``/``top_k`` and whose experts sit
  in modules named ``experts``): per token, 6 x the parameters a token uses (the routed
  experts at top_k / experts, shared experts and dense layers whole, the input embedding left
  out) plus the attention scores (``meshrun.plan.moe``, docs/plan.md "Mixture of experts");
- a Hugging Face causal LM (its class comes from ``transformers``): per token from its config,
  by the planner's formula (6 FLOPs per block weight per token plus the attention scores and the
  output layer: ``meshrun.plan.cost``, docs/plan.md) at the run's tokens per sample.

The peak: ``metrics.peak_flops`` when set, else, on CUDA, the datasheet table
(``meshrun.specs.gpus``) matched on the device's name. On CPU there is no datasheet: MFU needs
``metrics.peak_flops`` there (``meshrun bench compute`` measures a matmul peak).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

from meshrun.config import ConfigError
from meshrun.specs.gpus import get_gpu, gpu_key

if TYPE_CHECKING:
    from meshrun.config import Config

__all__ = [
    "ModelFlops",
    "constant_per_token",
    "gpu_key",
    "hf_causal_lm_flops",
    "model_flops",
    "moe_flops",
    "peak_flops",
    "start_mfu",
]


@dataclass(frozen=True)
class ModelFlops:
    """Training FLOPs of the model: ``per_sample``, or ``per_token(tokens_per_sample)`` (the
    attention's share grows with the sequence, so it is a function of the length)."""

    source: str
    per_sample: float = 0.0
    per_token: Callable[[int], float] | None = None

    def per_second(self, samples_per_s: float, tokens_per_s: float | None) -> float | None:
        """Model FLOP/s at these rates; None when per-token FLOPs meet unknown tokens."""
        if self.per_sample > 0:
            return self.per_sample * samples_per_s
        if self.per_token is None or tokens_per_s is None or not samples_per_s > 0:
            return None
        return self.per_token(round(tokens_per_s / samples_per_s)) * tokens_per_s


def constant_per_token(flops_per_token: float, source: str) -> ModelFlops:
    return ModelFlops(source, per_token=lambda _tokens: flops_per_token)


def model_flops(model: Any, flops_per_sample: float) -> ModelFlops | None:
    """The FLOPs MFU uses for ``model`` (before it is parallelized): ``metrics.flops_per_sample``,
    else a Hugging Face causal LM's from its config, else None (no MFU unless the user calls
    ``run.set_flops_per_token``)."""
    if flops_per_sample > 0:
        return ModelFlops(
            f"metrics.flops_per_sample = {flops_per_sample:.3g}", per_sample=flops_per_sample
        )
    return moe_flops(model) or hf_causal_lm_flops(model)


def moe_flops(model: Any) -> ModelFlops | None:
    """Per-token FLOPs of a model that declares experts, counting the active parameters only
    (``meshrun.plan.moe.module_flops``); None for a dense model."""
    from meshrun.plan.moe import module_flops

    found = module_flops(model, getattr(model, "config", None) if _is_hf(model) else None)
    return None if found is None else ModelFlops(found[1], per_token=found[0])


def _is_hf(model: Any) -> bool:
    return type(model).__module__.startswith("transformers.")


def _is_hf_causal_lm(model: Any) -> bool:
    # By the class's module, so transformers is never imported for a model that is not its own.
    name = type(model).__name__
    return type(model).__module__.startswith("transformers.") and (
        name.endswith("ForCausalLM") or name.endswith("LMHeadModel")
    )


def _hf_shape(config: Any) -> dict[str, int] | None:
    """The planner's shape fields from a Hugging Face config (GPT-2 names too), or None."""
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None)
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    vocab = getattr(config, "vocab_size", None)
    if not all(isinstance(v, int) and v > 0 for v in (hidden, layers, heads, vocab)):
        return None
    ffn = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None)
    kv = getattr(config, "num_key_value_heads", None)
    return {
        "hidden": int(hidden),  # type: ignore[arg-type]
        "layers": int(layers),  # type: ignore[arg-type]
        "heads": int(heads),  # type: ignore[arg-type]
        "vocab": int(vocab),  # type: ignore[arg-type]
        "ffn": ffn if isinstance(ffn, int) else 0,
        "kv_heads": kv if isinstance(kv, int) else 0,
    }


def _block_params(model: Any) -> int:
    """Exact weights of one repeated block (the longest ModuleList), 0 when none is found."""
    from torch import nn

    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        return 0
    return sum(p.numel() for p in max(lists, key=len)[0].parameters())


def hf_causal_lm_flops(model: Any) -> ModelFlops | None:
    """Per-token training FLOPs of a Hugging Face causal LM, by the planner's formula on its
    config's shape (the block's exact weight count, so gated MLPs and GQA count right)."""
    if not _is_hf_causal_lm(model):
        return None
    shape = _hf_shape(getattr(model, "config", None))
    if shape is None:
        return None
    # The planner's FLOPs formulas (pure functions). An import from the plan layer: the formulas
    # belong in a leaf module both read, as the GPU table now is (meshrun/specs/gpus.py).
    from meshrun.plan.cost import Model, model_flops_per_iteration

    base = Model(
        *(shape["layers"], shape["hidden"], shape["heads"], shape["vocab"]),
        kv_heads=shape["kv_heads"],
        ffn=shape["ffn"],
        layer_params=_block_params(model),
    )

    def per_token(tokens_per_sample: int) -> float:
        seq = max(tokens_per_sample, 1)
        return model_flops_per_iteration(replace(base, seq=seq), 1) / seq

    layers, hidden = shape["layers"], shape["hidden"]
    source = f"{type(model).__name__} config ({layers} layers x {hidden} hidden, planner formula)"
    return ModelFlops(source, per_token=per_token)


def precision_of(param_dtype: str) -> str:
    """The planner's precision name for ``parallel.param_dtype``."""
    return {"bfloat16": "bf16", "float16": "fp16"}.get(param_dtype, "fp32")


def peak_flops(
    configured: float, device_type: str, device_name: str, precision: str
) -> tuple[float, str]:
    """(peak FLOP/s per device, where it came from); 0 and the reason when unknown."""
    if configured > 0:
        return configured, f"metrics.peak_flops = {configured:.3g} FLOP/s per device"
    if device_type != "cuda":
        return 0.0, (
            "no peak FLOP/s is known for a CPU: set metrics.peak_flops (e.g. the matmul peak "
            "that `meshrun bench compute` measures) to get MFU in the metrics"
        )
    key = gpu_key(device_name)
    if key is None:
        return 0.0, (
            f"GPU {device_name!r} is not in meshrun's GPU table (meshrun/specs/gpus.py): set "
            "metrics.peak_flops to its dense peak FLOP/s to get MFU in the metrics"
        )
    try:
        value = get_gpu(key).peak_flops(precision)
    except ConfigError as e:  # e.g. bf16 on a V100
        return 0.0, f"{e}; set metrics.peak_flops to get MFU in the metrics"
    return value, f"{key} {precision} datasheet peak {value / 1e12:.0f} TFLOP/s"


class FlopsSink(Protocol):
    """What MFU needs of the metrics logger (a Protocol: the logger imports this module)."""

    def set_flops(self, flops: ModelFlops, peak_flops_per_rank: float) -> None: ...


def start_mfu(metrics: FlopsSink, flops: ModelFlops, config: Config, device: Any) -> str:
    """Give the metrics the model's FLOPs and the device's peak (``metrics.peak_flops`` or the
    datasheet table); return the line that says what MFU is measured against, or why not."""
    import torch

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    precision = precision_of(config.parallel.param_dtype)
    peak, why = peak_flops(config.metrics.peak_flops, device.type, name, precision)
    if peak <= 0:
        return f"MFU: not reported: {why}"
    metrics.set_flops(flops, peak)
    return f"MFU: FLOPs from {flops.source}, against {why}"
