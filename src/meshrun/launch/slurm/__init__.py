"""SLURM: inside an allocation, the topology ``srun`` gives applied to the launch (``job``);
``meshrun slurm submit``, the batch script rendered and handed to ``sbatch`` (``submit``).
See docs/slurm.md."""

from typing import TYPE_CHECKING

from meshrun._lazy import lazy_exports

if TYPE_CHECKING:
    from meshrun.launch.slurm.job import in_allocation
    from meshrun.launch.slurm.submit import render_sbatch

__getattr__ = lazy_exports(
    globals(),
    {
        "in_allocation": "meshrun.launch.slurm.job",
        "render_sbatch": "meshrun.launch.slurm.submit",
    },
)

__all__ = ["in_allocation", "render_sbatch"]
