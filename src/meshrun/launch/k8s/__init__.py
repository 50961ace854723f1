"""Kubernetes: a job's manifests rendered (PyTorchJob, JobSet, TrainJob; ``render``, ``job``,
``trainjob``) and written as YAML (``yamlout``). Pure rendering, no cluster access. See
docs/kubernetes.md."""

from typing import TYPE_CHECKING

from meshrun._lazy import lazy_exports

if TYPE_CHECKING:
    from meshrun.launch.k8s.render import write_manifests

__getattr__ = lazy_exports(globals(), {"write_manifests": "meshrun.launch.k8s.render"})

__all__ = ["write_manifests"]
