"""Known GPUs: peak dense FLOP/s, memory, and per-GPU link bandwidths (pure data).

A leaf module: the planner (``meshrun.plan``) and the training metrics' MFU
(``meshrun.monitor.mfu``) both read this table, so neither imports the other.

Peak figures are the vendors' dense (no sparsity) tensor-core numbers from their datasheets;
bandwidths are nominal one-direction bandwidths per GPU: the NVLink/xGMI/PCIe share of one GPU
inside a node, and the network interface share of one GPU between nodes (one 200/400 Gb/s NIC
per GPU on DGX/HGX systems). Real collectives reach a fraction of them: the planner's
``--comm-efficiency`` (or a calibration file from ``meshrun bench``) says how much.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from meshrun.config import ConfigError

__all__ = ["GB_S", "GPU", "GPUS", "TERA", "get_gpu", "gpu_key"]

TERA = 1e12


@dataclass(frozen=True)
class GPU:
    """One accelerator type. FLOP/s are dense peaks; bandwidths in bytes/s per GPU, one way."""

    name: str
    memory_gb: float  # 1e9 bytes, as datasheets count
    bf16_flops: float  # 0 where the GPU has no bf16 tensor cores
    fp16_flops: float
    fp32_flops: float  # plain fp32 (no TF32): what torch uses unless TF32 is enabled
    intra_bw: float  # inside a node (NVLink / xGMI / PCIe)
    inter_bw: float  # between nodes (the GPU's share of the NICs)
    source: str
    mem_bw: float = 0.0  # device memory bandwidth, bytes/s (HBM/GDDR): the optimizer step
    # Latency per ring step of a collective (alpha): rough defaults of the order NCCL's
    # small-message all-reduce shows (a few microseconds per hop over NVLink/PCIe, more over
    # the network); `meshrun bench comm` measures the real one.
    intra_latency: float = 3e-6
    inter_latency: float = 8e-6

    def peak_flops(self, precision: str) -> float:
        """Peak dense FLOP/s at a training precision, or an error naming what the GPU lacks."""
        value = {"bf16": self.bf16_flops, "fp16": self.fp16_flops, "fp32": self.fp32_flops}[
            precision
        ]
        if value <= 0:
            raise ConfigError(
                f"--precision {precision} is not supported by --gpu {self.name} "
                "(no bf16 tensor cores); use --precision fp16 or fp32"
            )
        return value


GB_S = 1e9

GPUS: dict[str, GPU] = {
    g.name: g
    for g in (
        GPU(
            "v100",
            32,
            0,
            125 * TERA,
            15.7 * TERA,
            150 * GB_S,
            6.25 * GB_S,
            "NVIDIA V100 SXM2 datasheet; DGX-1: 4x100 Gb/s IB for 8 GPUs",
        ),
        GPU(
            "a100-40gb",
            40,
            312 * TERA,
            312 * TERA,
            19.5 * TERA,
            300 * GB_S,
            25 * GB_S,
            "NVIDIA A100 datasheet (SXM); DGX A100: 1x200 Gb/s HDR per GPU",
        ),
        GPU(
            "a100-80gb",
            80,
            312 * TERA,
            312 * TERA,
            19.5 * TERA,
            300 * GB_S,
            25 * GB_S,
            "NVIDIA A100 datasheet (SXM); DGX A100: 1x200 Gb/s HDR per GPU",
        ),
        GPU(
            "h100-sxm",
            80,
            989 * TERA,
            989 * TERA,
            67 * TERA,
            450 * GB_S,
            50 * GB_S,
            "NVIDIA H100 datasheet (SXM); DGX H100: 1x400 Gb/s NDR per GPU",
        ),
        GPU(
            "h100-pcie",
            80,
            756 * TERA,
            756 * TERA,
            51 * TERA,
            64 * GB_S,
            25 * GB_S,
            "NVIDIA H100 datasheet (PCIe Gen5, no NVLink bridge); one 400 Gb/s NIC per 2 GPUs",
        ),
        GPU(
            "h200",
            141,
            989 * TERA,
            989 * TERA,
            67 * TERA,
            450 * GB_S,
            50 * GB_S,
            "NVIDIA H200 datasheet (SXM); 1x400 Gb/s per GPU",
        ),
        GPU(
            "b200",
            180,
            2250 * TERA,
            2250 * TERA,
            75 * TERA,
            900 * GB_S,
            50 * GB_S,
            "NVIDIA HGX B200 datasheet (per GPU); 1x400 Gb/s per GPU",
        ),
        GPU(
            "l40s",
            48,
            362 * TERA,
            362 * TERA,
            91.6 * TERA,
            32 * GB_S,
            12.5 * GB_S,
            "NVIDIA L40S datasheet (PCIe Gen4, no NVLink); one 200 Gb/s NIC per 2 GPUs",
        ),
        GPU(
            "mi300x",
            192,
            1307 * TERA,
            1307 * TERA,
            163.4 * TERA,
            448 * GB_S,
            50 * GB_S,
            "AMD MI300X datasheet; 7 Infinity Fabric links x 64 GB/s; 1x400 Gb/s per GPU",
        ),
    )
}

# Datasheet memory bandwidths, TB/s.
_MEM_TB_S = {
    "v100": 0.9,
    "a100-40gb": 1.555,
    "a100-80gb": 2.039,
    "h100-sxm": 3.35,
    "h100-pcie": 2.0,
    "h200": 4.8,
    "b200": 8.0,
    "l40s": 0.864,
    "mi300x": 5.3,
}
GPUS = {name: replace(g, mem_bw=_MEM_TB_S[name] * TERA) for name, g in GPUS.items()}

ALIASES = {
    "a100": "a100-80gb",
    "h100": "h100-sxm",
    "h100-80gb": "h100-sxm",
    "a100-40": "a100-40gb",
    "a100-80": "a100-80gb",
}


def get_gpu(name: str) -> GPU:
    """The table entry for ``name`` (case-insensitive, a few aliases), or an error listing all."""
    key = name.lower().replace("_", "-").replace(" ", "-")
    key = ALIASES.get(key, key)
    if key not in GPUS:
        raise ConfigError(f"--gpu {name!r} is not known; known GPUs: {', '.join(GPUS)}")
    return GPUS[key]


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
    """The table name for a CUDA device name (e.g. "NVIDIA H100 80GB HBM3" -> "h100-sxm"), or
    None when the table does not hold it."""
    name = device_name.lower().replace(" ", "").replace("-", "")
    for family, variant, key in _NAME_KEYS:
        if family in name and variant in name:
            return key
    return None
