"""The denominator of MFU: the peak FLOP/s of one device at the training precision.

From ``metrics.peak_flops`` when set, else, on CUDA, the planner's datasheet table
(``meshrun.plan.hardware``) matched on the device's name. On CPU there is no datasheet:
MFU needs ``metrics.peak_flops`` there (``meshrun bench compute`` measures a matmul peak).
"""

from __future__ import annotations

__all__ = ["gpu_key", "peak_flops", "precision_of"]

# Table names by what torch.cuda.get_device_name() contains, most specific first.
_NAME_KEYS = (
    ("h100", "pcie", "h100-pcie"),
    ("h100", "", "h100-sxm"),
    ("h200", "", "h200"),
    ("b200", "", "b200"),
    ("a100", "40gb", "a100-40gb"),
    ("a100", "", "a100-80gb"),
    ("v100", "", "v100"),
    ("l40s", "", "l40s"),
    ("mi300x", "", "mi300x"),
)


def gpu_key(device_name: str) -> str | None:
    """The planner's table name for a CUDA device name (e.g. "NVIDIA H100 80GB HBM3" ->
    "h100-sxm"), or None when the table does not hold it."""
    name = device_name.lower().replace(" ", "").replace("-", "")
    for family, variant, key in _NAME_KEYS:
        if family in name and variant in name:
            return key
    return None


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
            f"GPU {device_name!r} is not in the planner's table (meshrun/plan/hardware.py): set "
            "metrics.peak_flops to its dense peak FLOP/s to get MFU in the metrics"
        )
    from meshrun.plan.errors import PlanError
    from meshrun.plan.hardware import get_gpu  # the planner's datasheet figures

    try:
        value = get_gpu(key).peak_flops(precision)
    except PlanError as e:  # e.g. bf16 on a V100
        return 0.0, f"{e}; set metrics.peak_flops to get MFU in the metrics"
    return value, f"{key} {precision} datasheet peak {value / 1e12:.0f} TFLOP/s"
