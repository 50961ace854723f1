"""``meshrun launch``'s front door: the command line builds one typed :class:`LaunchRequest`
(``request``) and calls :func:`run` (``command``), which does every step before the launch
in order: torchrun's flags and their ``PET_`` defaults read (``torchrun``), the target, the
job secret's file and the config checked, then the hostfile's hosts (launch/hostfile/plan.py)
or this node, with what a SLURM allocation fills in, through launch/prepare.py."""

from meshrun.launch.front.command import run
from meshrun.launch.front.request import LaunchRequest, TorchrunFlags

__all__ = ["LaunchRequest", "TorchrunFlags", "run"]
