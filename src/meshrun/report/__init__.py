"""``meshrun report``: a run's metrics files read back (``analysis``: steps, stalls, goodput,
scaling), drawn (``figures``) and written as one self-contained HTML page (``html``)."""

from typing import TYPE_CHECKING

from meshrun._lazy import lazy_exports

if TYPE_CHECKING:
    from meshrun.report.analysis import analyse, load_run
    from meshrun.report.html import summary_lines, write_report

__getattr__ = lazy_exports(
    globals(),
    {
        "analyse": "meshrun.report.analysis",
        "load_run": "meshrun.report.analysis",
        "summary_lines": "meshrun.report.html",
        "write_report": "meshrun.report.html",
    },
)

__all__ = ["analyse", "load_run", "summary_lines", "write_report"]
