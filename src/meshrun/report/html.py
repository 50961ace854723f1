"""``meshrun report RUN_DIR [RUN_DIR ...] [-o OUT]``: one self-contained HTML page + PNGs.

The page embeds every figure as a base64 PNG (it opens anywhere, offline: no script, style
or font is fetched) and the same figures are written next to it as files. A few lines of
inline script only mark, on the ``<body>``, how many images decoded (``data-images-ok``),
how far the page runs past the window's right edge (``data-overflow-px``) and any script
error (``data-errors``), so a test in a headless browser can check the page.
"""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshrun.report import figures
from meshrun.report.analysis import (
    PARTS,
    ReportError,
    RunFigures,
    Scaling,
    analyse,
    load_run,
    scaling,
)

__all__ = ["Report", "summary_lines", "write_report"]

REPORT_HTML = "report.html"

# Fits a laptop screen (checked at 1300 px in headless Chromium: tests/e2e/test_scale_report.py):
# tables shrink by wrapping their cells (a run name wraps anywhere) and, past that, scroll in
# their own box, never the page.
_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 72em; color: #222;
       padding: 0 1em; }
h1 { font-size: 1.5em; } h2 { font-size: 1.25em; margin-top: 2em; } h3 { font-size: 1.05em; }
.table { max-width: 100%; overflow-x: auto; margin: 0.5em 0; }
table { border-collapse: collapse; font-size: 0.9em; }
td, th { border: 1px solid #ccc; padding: 0.2em 0.45em; text-align: right; }
th { background: #f3f3f3; font-weight: 600; } td:first-child, th:first-child { text-align: left; }
td:first-child { overflow-wrap: anywhere; min-width: 6em; max-width: 16em; }
img { max-width: 100%; height: auto; display: block; margin: 0.5em 0; }
figure { margin: 1em 0; }
.note { color: #666; font-size: 0.9em; }
"""

# Marks the page for automated checks: images decoded, script errors seen (none expected).
_SCRIPT = """
var errors = [];
window.addEventListener('error', function (e) {
  errors.push(e.message || ('failed to load ' + (e.target && e.target.tagName)));
  document.body.setAttribute('data-errors', errors.join(' | '));
}, true);
window.addEventListener('load', function () {
  var imgs = Array.prototype.slice.call(document.images);
  var ok = imgs.filter(function (i) { return i.complete && i.naturalWidth > 0; }).length;
  document.body.setAttribute('data-images-total', String(imgs.length));
  document.body.setAttribute('data-images-ok', String(ok));
  // How far the page runs past the window's right edge (0: it fits).
  var root = document.documentElement;
  document.body.setAttribute('data-overflow-px', String(root.scrollWidth - root.clientWidth));
  document.body.setAttribute('data-errors', errors.join(' | '));
});
"""


@dataclass
class Report:
    html_path: Path
    pngs: list[Path] = field(default_factory=list)
    runs: list[RunFigures] = field(default_factory=list)
    scaling: Scaling | None = None


class _Page:
    """Accumulates HTML parts and the PNG files they show."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.parts: list[str] = []
        self.pngs: list[Path] = []

    def add(self, text: str) -> None:
        self.parts.append(text)

    def figure(self, name: str, png: bytes | None, caption: str, missing: str) -> None:
        if png is None:
            self.add(f'<p class="note">{html.escape(missing)}</p>')
            return
        path = self.out / f"{name}.png"
        path.write_bytes(png)
        self.pngs.append(path)
        data = base64.b64encode(png).decode("ascii")
        self.add(
            f'<figure><img src="data:image/png;base64,{data}" alt="{html.escape(caption)}">'
            f"<figcaption class=note>{html.escape(caption)} ({path.name})</figcaption></figure>"
        )

    def table(self, header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
        head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows
        )
        self.add(f'<div class="table"><table><tr>{head}</tr>{body}</table></div>')


def write_report(run_dirs: Sequence[str | Path], out: str | Path | None = None) -> Report:
    """Analyse ``run_dirs`` and write ``OUT/report.html`` and its PNGs (default OUT: the run's
    ``report/`` folder, or ``report/`` next to several runs)."""
    if not run_dirs:
        raise ReportError("meshrun report needs at least one run directory")
    runs = [analyse(load_run(p)) for p in run_dirs]  # wrong directories are named first
    figures.require_matplotlib()
    out_dir = Path(out) if out is not None else _default_out(run_dirs)
    out_dir.mkdir(parents=True, exist_ok=True)
    page = _Page(out_dir)
    result = scaling(runs)
    _write_overview(page, runs, result)
    for i, run in enumerate(runs):
        _write_run(page, run, prefix=f"run{i}_" if len(runs) > 1 else "")
    html_path = out_dir / REPORT_HTML
    html_path.write_text(_document(page.parts, runs), encoding="utf-8")
    return Report(html_path, page.pngs, runs, result)


def _default_out(run_dirs: Sequence[str | Path]) -> Path:
    if len(run_dirs) == 1:
        return Path(run_dirs[0]) / "report"
    parents = {Path(p).resolve().parent for p in run_dirs}
    return (parents.pop() if len(parents) == 1 else Path.cwd()) / "report"


def _document(parts: Sequence[str], runs: Sequence[RunFigures]) -> str:
    names = ", ".join(r.data.name for r in runs)
    return (
        "<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8>"
        f"<title>meshrun report: {html.escape(names)}</title>"
        f"<style>{_STYLE}</style><script>{_SCRIPT}</script></head>\n<body>\n"
        f"<h1>meshrun report: {html.escape(names)}</h1>\n" + "\n".join(parts) + "\n</body></html>\n"
    )


# --- overview ------------------------------------------------------------------------------


def _write_overview(page: _Page, runs: Sequence[RunFigures], result: Scaling | None) -> None:
    page.add("<h2>Summary</h2>")
    page.table(_SUMMARY_HEADER, [_summary_row(r) for r in runs])
    if result is not None:
        _write_scaling(page, result)
    page.figure("loss", figures.loss_png(runs), "loss per optimizer step", "no loss logged")
    page.figure(
        "throughput", figures.throughput_png(runs), "tokens/s per step", "no throughput logged"
    )


_SUMMARY_HEADER = [
    "run",
    "processes",
    "global batch",
    "steps",
    "median step",
    "samples/s",
    "tokens/s",
    "tokens/s per process",
    "MFU",
    "goodput",
    "restarts",
    "stragglers",
    "non-finite skips",
    "stalls",
]


def _summary_row(r: RunFigures) -> list[str]:
    return [
        r.data.name,
        str(r.world_size),
        str(r.global_batch),
        str(r.steps_done),
        f"{r.median_step_s * 1e3:.1f} ms",
        f"{r.samples_per_s:,.1f}",
        f"{r.tokens_per_s:,.0f}",
        f"{r.tokens_per_s / r.world_size:,.0f}",
        _pct(r.mfu),
        _pct(r.goodput.share),
        str(r.restarts),
        _straggler_cell(r),
        str(len(r.nonfinite)),
        str(len(r.stalls)),
    ]


def _chronic_ranks(r: RunFigures) -> list[int]:
    return sorted({int(s["rank"]) for s in r.stragglers if s.get("kind") == "chronic"})


def _chronic_note(r: RunFigures) -> str:
    """The chronic ranks among the flags (docs/monitor.md, Stragglers)."""
    chronic = _chronic_ranks(r)
    return f" (chronic: rank {', '.join(map(str, chronic))})" if chronic else ""


def _straggler_cell(r: RunFigures) -> str:
    return f"{len(r.stragglers)}{_chronic_note(r)}"


def _write_scaling(page: _Page, result: Scaling) -> None:
    page.add("<h2>Scaling</h2>")
    page.add(f"<p>{html.escape(result.explanation)}</p>")
    page.table(
        ["processes", "samples/s", "speedup", "efficiency"],
        [
            [str(r.world_size), f"{r.samples_per_s:,.1f}", f"{r.speedup:.2f}x", _pct(r.efficiency)]
            for r in result.rows
        ],
    )
    page.figure(
        "scaling", figures.scaling_png(result), f"{result.kind} scaling", "no scaling figure"
    )


# --- one run -------------------------------------------------------------------------------


def _write_run(page: _Page, run: RunFigures, prefix: str) -> None:
    d = run.data
    page.add(f"<h2>Run {html.escape(d.name)}</h2>")
    page.add(
        f"<p class=note>{html.escape(str(d.path))}: {run.world_size} process(es), data-parallel "
        f"{run.dp}, global batch {run.global_batch} ({run.per_rank_batch:g} per data-parallel "
        f"rank), {run.steps_done} steps, {len(d.sessions)} process start(s).</p>"
    )
    for note in run.notes + _skipped_note(run):
        page.add(f"<p class=note>{html.escape(note)}</p>")
    _write_goodput(page, run, prefix)
    _write_breakdown(page, run, prefix)
    page.figure(
        prefix + "ranks",
        figures.ranks_png(run),
        "per-rank own time and data wait at each straggler check (x: flagged straggler)",
        "no per-rank records: one process, or fewer steps than monitor.straggler_every",
    )
    _write_events(page, run)
    _write_ft(page, run)
    page.figure(prefix + "memory", figures.memory_png(run), "memory on rank 0", "no memory figures")


def _skipped_note(run: RunFigures) -> list[str]:
    n = run.data.skipped_lines
    if not n:
        return []
    return [f"{n} unreadable line(s) in metrics.jsonl were skipped (cut short by a crash?)"]


def _write_goodput(page: _Page, run: RunFigures, prefix: str) -> None:
    g = run.goodput
    page.add(f"<h3>Goodput: {_pct(g.share)} of {g.wall_s:.1f} s wall time in useful steps</h3>")
    page.table(
        ["where the wall time went", "seconds", "share"],
        [
            [k, f"{v:.2f}", _pct(v / g.wall_s if g.wall_s else math.nan)]
            for k, v in g.parts().items()
        ],
    )
    page.figure(prefix + "goodput", figures.goodput_png(run), "wall time by use", "no wall time")


def _write_breakdown(page: _Page, run: RunFigures, prefix: str) -> None:
    page.add("<h3>Step-time breakdown (rank 0, mean per step after warm-up)</h3>")
    b = run.breakdown
    if b:
        total = sum(b.values())
        page.table(
            ["part", "ms/step", "share"],
            [[k.removesuffix("_s"), f"{v * 1e3:.2f}", _pct(v / total)] for k, v in b.items()],
        )
    page.figure(
        prefix + "breakdown",
        figures.breakdown_png(run),
        "stacked per-step breakdown: " + ", ".join(p.removesuffix("_s") for p in PARTS) + ", other",
        "no step breakdown recorded",
    )


def _write_events(page: _Page, run: RunFigures) -> None:
    page.add("<h3>Stragglers, non-finite skips, stalls, checkpoints</h3>")
    sections: list[tuple[str, list[str], list[list[str]]]] = [
        (
            "stragglers",
            ["step", "rank", "host", "component", "value", "median", "slower by", "kind"],
            [
                [
                    str(s["step"]),
                    str(s["rank"]),
                    str(s["host"]),
                    str(s["component"]),
                    f"{s['value_s'] * 1e3:.1f} ms",
                    f"{s['median_s'] * 1e3:.1f} ms",
                    f"{s['slower_by']:.2f}x",
                    _kind(s),
                ]
                for s in run.stragglers
            ],
        ),
        (
            "slowest ranks (moving average at the last straggler check)",
            ["rank", "host", "data wait", "own", "compute", "exposed comm", "optimizer", "kind"],
            [_slowest_row(a) for a in run.slowest],
        ),
        (
            "non-finite skips",
            ["step", "ranks", "action"],
            [
                [str(e["step"]), ", ".join(map(str, e["ranks"])), str(e["action"])]
                for e in run.nonfinite
            ],
        ),
        (
            "stalls",
            ["step", "step time", "median", "cause"],
            [
                [str(s.step), f"{s.step_time_s:.3f} s", f"{s.median_s:.3f} s", s.cause or "unknown"]
                for s in run.stalls
            ],
        ),
        (
            "checkpoint saves",
            ["after step", "training blocked"],
            [[str(e["after_step"]), f"{e['blocked_s']:.3f} s"] for e in run.checkpoints],
        ),
    ]
    for title, header, rows in sections:
        if rows:
            page.add(f"<p><b>{len(rows)} {title}</b></p>")
            page.table(header, rows)
        else:
            page.add(f"<p class=note>no {title}</p>")


def _kind(s: dict[str, Any]) -> str:
    if "kind" not in s:  # written before stragglers were classified
        return "-"
    return f"{s['kind']} ({s['flagged']} of {s['windows']})"


def _slowest_row(a: dict[str, Any]) -> list[str]:
    keys = ("data_wait_s", "own_s", "compute_s", "comm_exposed_s", "optimizer_s")
    ms = [f"{float(a[k]) * 1e3:.1f} ms" if k in a else "-" for k in keys]
    return [str(a["rank"]), str(a["host"]), *ms, str(a.get("kind") or "-")]


def _write_ft(page: _Page, run: RunFigures) -> None:
    """Replica-group events (docs/fault_tolerance.md); no section for a run without them."""
    if not run.ft_events:
        return
    page.add("<h3>Fault-tolerance events (replica groups)</h3>")
    page.table(["step", "what", "from", "bytes", "seconds"], [_ft_row(e) for e in run.ft_events])


def _ft_row(e: dict[str, Any]) -> list[str]:
    kind, live = e["event"], e.get("live_groups", "?")
    if kind == "ft_heal":
        return [
            str(e["step"]),
            f"healed ({live} groups live)",
            str(e.get("source", "")),
            f"{int(e['bytes']):,}",
            f"{float(e['seconds']):.3f}",
        ]
    if kind == "ft_uncommitted":
        what = f"step not committed ({live} groups live): {e.get('error', '')}"
    else:  # ft_groups
        what = f"a group {e.get('change', 'changed')} ({live} groups live)"
    return [str(e["step"]), what, "", "", ""]


def _pct(x: float) -> str:
    return "-" if math.isnan(x) else f"{100 * x:.1f}%"


# --- what `meshrun report` prints --------------------------------------------------------------------------


def summary_lines(report: Report) -> list[str]:
    """What the command prints: one line per run, the scaling rows, the files."""
    lines = [
        f"{r.data.name}: {r.world_size} proc, {r.steps_done} steps, median step "
        f"{r.median_step_s * 1e3:.1f} ms, {r.samples_per_s:,.1f} samples/s, MFU "
        f"{_pct(r.mfu)}, goodput {_pct(r.goodput.share)}, {len(r.stragglers)} straggler flag(s)"
        f"{_chronic_note(r)}, "
        f"{len(r.nonfinite)} "
        f"non-finite skip(s), {len(r.stalls)} stall(s), {r.restarts} restart(s)"
        for r in report.runs
    ]
    if report.scaling is not None:
        lines.append(report.scaling.explanation)
        lines += [
            f"  {r.world_size} proc: {r.samples_per_s:,.1f} samples/s, speedup {r.speedup:.2f}x, "
            f"efficiency {_pct(r.efficiency)}"
            for r in report.scaling.rows
        ]
    lines.append(f"wrote {report.html_path} and {len(report.pngs)} PNG figure(s)")
    return lines
