"""``meshrun plan``: a memory, compute and communication cost model that recommends a layout.

Pure: imports no torch and no process-group code (``inspect_model`` imports torch lazily, only
for ``--model``). Entry points: :func:`search` ranks every layout, :func:`evaluate_one` checks
one, :func:`evaluate` is the cost model itself. Formulas and sources: docs/plan.md.
"""

from meshrun.plan.cost import Cluster, Estimate, Layout, Model, Training, evaluate, gpt_params
from meshrun.plan.search import Plan, PlanError, evaluate_one, search, what_would_fit
from meshrun.specs.gpus import GPUS, get_gpu

__all__ = [
    "GPUS",
    "Cluster",
    "Estimate",
    "Layout",
    "Model",
    "Plan",
    "PlanError",
    "Training",
    "evaluate",
    "evaluate_one",
    "get_gpu",
    "gpt_params",
    "search",
    "what_would_fit",
]
