"""The roofline chart of a report, as inline SVG drawn by matplotlib (the optional extra ``html``).

Log-log: arithmetic intensity (FLOP per HBM byte) against attainable FLOP/s. The roof is the report's
ceilings: bandwidth × intensity up to the compute peak. Each rewrite is two points, its replaced ops
(hollow) and its fused kernel (filled), joined by an arrow and numbered as in the page's table; measured
times (FUSEPASS_PROFILE) add crosses.
"""
from __future__ import annotations

import io
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the report renders itself through this module: no import back at run time
    from fusepass.report.report import Report


BEFORE, AFTER, MEASURED, ROOF = "#c0392b", "#1f6fb2", "#333333", "#777777"


def roofline_svg(report: Report) -> str:
    """The chart as an ``<svg>`` element; raises ImportError without matplotlib."""
    from matplotlib.figure import Figure

    c = report.ceilings
    points = [(i, r) for i, r in enumerate(report.rewrites, 1)
              if r.flops and r.flops_fused and r.time_unfused_ms and r.time_fused_ms]
    intensities = [x for _, r in points for x in (r.intensity_unfused, r.intensity_fused)] + [c.ridge]
    low, high = min(intensities) / 4, max(max(intensities) * 4, c.ridge * 30)  # room for the compute label

    fig = Figure(figsize=(8, 5), dpi=100)
    ax = fig.subplots()
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.plot([low, c.ridge, high], [c.hbm_bytes_per_s * low, c.flops_per_s, c.flops_per_s], color=ROOF, lw=2)
    ax.annotate(f"HBM {c.hbm_bytes_per_s / 1e12:.2f} TB/s", (low * 1.3, c.hbm_bytes_per_s * low * 1.3),
                color=ROOF, rotation=0, fontsize=9)
    ax.annotate(f"compute {c.flops_per_s / 1e12:.0f} TFLOP/s", (c.ridge * 1.2, c.flops_per_s / 1.9),
                color=ROOF, fontsize=9)
    labels: dict[tuple[float, float], list[str]] = {}  # rewrites with the same numbers share a label
    for i, r in points:
        before = (r.intensity_unfused, r.flops / (r.time_unfused_ms * 1e-3))
        after = (r.intensity_fused, r.flops_fused / (r.time_fused_ms * 1e-3))
        ax.annotate("", after, before, arrowprops=dict(arrowstyle="->", color=ROOF, lw=0.8))
        ax.scatter(*before, s=40, facecolors="white", edgecolors=BEFORE, zorder=3)
        ax.scatter(*after, s=40, color=AFTER, zorder=3)
        labels.setdefault(after, []).append(str(i))
        if r.measured_fused_ms and r.measured_unfused_ms:
            ax.scatter([before[0], after[0]], [r.flops / (r.measured_unfused_ms * 1e-3),
                                               r.flops_fused / (r.measured_fused_ms * 1e-3)],
                       marker="x", color=MEASURED, zorder=3)
    for after, numbers in labels.items():
        ax.annotate(", ".join(numbers), after, textcoords="offset points", xytext=(6, -11), fontsize=9,
                    color=AFTER)
    ax.scatter([], [], s=40, facecolors="white", edgecolors=BEFORE, label="replaced ops (estimate)")
    ax.scatter([], [], s=40, color=AFTER, label="fused kernel (estimate)")
    if any(r.measured_speedup for _, r in points):
        ax.scatter([], [], marker="x", color=MEASURED, label="measured")
    ax.set_xlim(low, high)
    ax.set_ylim(top=c.flops_per_s * 3)
    ax.set_xlabel("arithmetic intensity (FLOP per HBM byte)")
    ax.set_ylabel("attainable FLOP/s")
    ax.set_title(f"Roofline: {c.name}", fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="lower right", fontsize=9)
    fig.tight_layout()
    buffer = io.StringIO()
    fig.savefig(buffer, format="svg", metadata={"Date": None, "Creator": None})
    svg = buffer.getvalue()
    return svg[svg.index("<svg"):]  # inline: no XML prolog or doctype
