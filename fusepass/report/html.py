"""The report as one self-contained HTML page: its tables and a roofline chart (no external resources).

The chart needs matplotlib (``pip install fusepass[html]``); without it the page says so and keeps the
tables. Numbers are formatted as in the text table.
"""
from __future__ import annotations

from html import escape
from typing import TYPE_CHECKING

from fusepass.report.render import format_bytes, format_count, format_intensity, format_time

if TYPE_CHECKING:  # the report renders itself through this module: no import back at run time
    from fusepass.report.report import Report

STYLE = """
body { font: 13px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; margin: 1em 0; }
th, td { border-bottom: 1px solid #ddd; padding: 3px 6px; text-align: right; white-space: nowrap; }
th { background: #f4f4f4; white-space: normal; vertical-align: bottom; }
td.text, th.text { text-align: left; white-space: normal; }
.note { color: #8a5a00; }
code { font-size: 13px; }
"""

REWRITE_COLUMNS = ("#", "rewrite", "location", "ops", "HBM unfused → fused", "saved", "ideal", "FLOP",
                   "FLOP/B unfused → fused", "est. unfused → fused", "measured unfused → fused",
                   "activation saved", "features")
HOTSPOT_COLUMNS = ("kind", "phase", "location", "reason", "HBM", "est.")
TEXT = {"rewrite", "kind", "phase", "location", "features", "reason"}


def _table(columns: tuple[str, ...], rows: list[list[str]]) -> str:
    head = "".join(f'<th class="{"text" if c in TEXT else ""}">{escape(c)}</th>' for c in columns)
    body = "".join("<tr>" + "".join(f'<td class="{"text" if c in TEXT else ""}">{escape(v)}</td>'
                                    for c, v in zip(columns, row)) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _chart(report: Report) -> str:
    try:
        from fusepass.report.chart import roofline_svg

        return roofline_svg(report)
    except ImportError:
        return '<p class="note">The roofline chart needs matplotlib: <code>pip install fusepass[html]</code>.</p>'


def render_html(report: Report) -> str:
    c = report.ceilings
    rewrites = [[str(i), f"{r.kind} {r.phase}", r.location, str(len(r.ops)),
                 f"{format_bytes(r.bytes_unfused)} → {format_bytes(r.bytes_fused)}", format_bytes(r.bytes_saved),
                 format_bytes(r.bytes_ideal), format_count(r.flops, "FLOP"),
                 f"{format_intensity(r.intensity_unfused)} → {format_intensity(r.intensity_fused)}",
                 f"{format_time(r.time_unfused_ms)} → {format_time(r.time_fused_ms)}",
                 f"{format_time(r.measured_unfused_ms)} → {format_time(r.measured_fused_ms)} "
                 f"({r.measured_speedup:.2f}×)" if r.measured_speedup else "-",
                 format_bytes(r.activation_bytes_saved), ", ".join(r.features)]
                for i, r in enumerate(report.rewrites, 1)]
    hotspots = [[h.kind, h.phase, h.location, h.reason, format_bytes(h.bytes), format_time(h.time_ms)]
                for h in report.ranked_hotspots]
    title = f"fusepass report - {report.graph} on {report.device}"
    notices = "".join(f'<p class="note">{escape(n)}</p>' for n in report.notices)
    return f"""<!DOCTYPE html>
<html lang="en">
<head><meta charset="utf-8"><title>{escape(title)}</title><style>{STYLE}</style></head>
<body>
<h1>{escape(title)}</h1>
<p>Roofline ceilings: {escape(c.name)}: {c.hbm_bytes_per_s / 1e12:.2f} TB/s HBM, {c.flops_per_s / 1e12:.0f} TFLOP/s
({escape(c.source)}). Estimates are max(FLOP / peak, bytes / bandwidth).</p>
{notices}
<h2>Rewrites</h2>
{_table(REWRITE_COLUMNS, rewrites) if rewrites else "<p>None.</p>"}
<h2>Roofline</h2>
{_chart(report) if rewrites else "<p>No rewrites to place.</p>"}
<h2>Hotspots, by estimated time</h2>
{_table(HOTSPOT_COLUMNS, hotspots) if hotspots else "<p>None.</p>"}
</body>
</html>
"""
