"""Launch: start a training script on many processes with torchrun's own elastic agent.

Entry point: :func:`launch_local` runs a :class:`LaunchSpec` (the script, processes per node,
the ``[launch]`` settings) through ``torch.distributed.run`` in this process, one node or many
(``meshrun launch``; docs/launch.md). Beside it, pure renderers for schedulers that start the
agent themselves: :class:`K8sJob` -> :func:`write_manifests` (Kubeflow PyTorchJob, JobSet;
docs/kubernetes.md), :class:`SubmitSpec` -> :func:`render_sbatch` (SLURM; docs/slurm.md), and
:func:`launch_hostfile` over ssh (docs/hostfile.md). Exports load on first use: the command
line does not import torch to parse its arguments.

Inside: ``front/`` (``meshrun launch``'s typed request and the one call that prepares and
runs it), ``spec`` (one launch, typed), ``prepare`` (the checks and values settled before any
process starts), ``target``, ``torchrun_flags``, ``rundir`` and ``replicas`` (replica groups);
``agent/`` (torchrun's agent and what watches it), ``trust/`` (the job secret, the signed
rendezvous), ``multinode/``, and one folder per scheduler: ``hostfile/``, ``k8s/``, ``ray/``,
``slurm/``.
"""

from typing import TYPE_CHECKING

from meshrun._lazy import lazy_exports

if TYPE_CHECKING:
    from meshrun.launch.agent.local import launch_local
    from meshrun.launch.hostfile.remote import launch_hostfile
    from meshrun.launch.k8s.render import K8sJob, write_manifests
    from meshrun.launch.slurm.submit import SubmitSpec, render_sbatch
    from meshrun.launch.spec import LaunchSpec

__getattr__ = lazy_exports(
    globals(),
    {
        "K8sJob": "meshrun.launch.k8s.render",
        "write_manifests": "meshrun.launch.k8s.render",
        "LaunchSpec": "meshrun.launch.spec",
        "launch_local": "meshrun.launch.agent.local",
        "launch_hostfile": "meshrun.launch.hostfile.remote",
        "SubmitSpec": "meshrun.launch.slurm.submit",
        "render_sbatch": "meshrun.launch.slurm.submit",
    },
)

__all__ = [
    "K8sJob",
    "LaunchSpec",
    "SubmitSpec",
    "launch_hostfile",
    "launch_local",
    "render_sbatch",
    "write_manifests",
]
