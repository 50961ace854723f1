"""``meshrun ckpt export``: a checkpoint's tensors streamed to one safetensors or torch file
(``dcp``), or to a Hugging Face directory that ``from_pretrained`` loads (``hf``)."""

from typing import TYPE_CHECKING

from meshrun._lazy import lazy_exports

if TYPE_CHECKING:
    from meshrun.checkpoint.export.dcp import export
    from meshrun.checkpoint.export.hf import export_hf

__getattr__ = lazy_exports(
    globals(),
    {"export": "meshrun.checkpoint.export.dcp", "export_hf": "meshrun.checkpoint.export.hf"},
)

__all__ = ["export", "export_hf"]
