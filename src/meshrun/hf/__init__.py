"""Hugging Face directories in: sharded loading of pretrained weights (docs/hf.md).

``load_pretrained(model, directory, device=...)`` fills an already parallelized model, each
rank reading only the slices it holds; :class:`PretrainedError` is what it raises when the
checkpoint does not fit the model.
"""

from typing import TYPE_CHECKING

from meshrun._lazy import lazy_exports

if TYPE_CHECKING:
    from meshrun.hf.load import LoadReport, load_pretrained
    from meshrun.hf.names import PretrainedError

__getattr__ = lazy_exports(
    globals(),
    {
        "load_pretrained": "meshrun.hf.load",
        "LoadReport": "meshrun.hf.load",
        "PretrainedError": "meshrun.hf.names",
    },
)
__all__ = ["LoadReport", "PretrainedError", "load_pretrained"]
