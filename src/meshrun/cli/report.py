"""``meshrun report RUN_DIR [RUN_DIR ...] [-o OUT]``: the flags of report/html.py's
:func:`write_report`, and what it prints."""

from __future__ import annotations

import argparse

from meshrun.cli.args import Subparsers, add_command
from meshrun.report.analysis import ReportError
from meshrun.report.html import summary_lines, write_report
from meshrun.runtime.logs import say_error


def cmd_report(a: argparse.Namespace) -> int:
    try:
        report = write_report(a.run_dirs, a.out)
    except ReportError as e:
        say_error("report", e)
        return 2
    print("\n".join(summary_lines(report)))
    return 0


def add_report_parser(sub: Subparsers) -> None:
    p = add_command(
        sub,
        "report",
        cmd_report,
        help="HTML report with plots of one or more runs (scaling across world sizes)",
        description="Read RUN_DIR/metrics.jsonl of each run and write a self-contained HTML "
        "page with PNG figures: loss, throughput, step-time breakdown, per-rank heat map, "
        "memory, stragglers, non-finite skips, stalls, checkpoints and goodput; with runs at "
        "several world sizes, the scaling efficiency (strong or weak). Needs matplotlib "
        "(pip install 'meshrun[report]').",
    )
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (job.run_dir)")
    p.add_argument(
        "-o", "--out", help="output folder (default RUN_DIR/report, or report/ beside several runs)"
    )
