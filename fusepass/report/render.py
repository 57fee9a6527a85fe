"""The report as a stable, readable table: no ids or addresses, fixed units, graph order."""
from __future__ import annotations

from fusepass.report.report import Report


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def render_table(report: Report) -> str:
    lines = [f"fusepass report — {report.graph}: {len(report.rewrites)} rewrites, "
             f"{len(report.hotspots)} hotspots"]
    for notice in report.notices:
        lines.append(f"  note: {notice}")
    if report.rewrites:
        lines.append("  rewrites:")
        for r in report.rewrites:
            features = f" [{', '.join(r.features)}]" if r.features else ""
            lines.append(
                f"    {r.kind:<11} {r.phase:<8} {len(r.ops):>3} ops  "
                f"{format_bytes(r.bytes_unfused):>10} -> {format_bytes(r.bytes_fused):>10}  "
                f"saved {format_bytes(r.bytes_saved):>10}  {r.location}{features}")
    if report.hotspots:
        lines.append("  hotspots:")
        for h in report.hotspots:
            lines.append(f"    {h.kind:<11} {h.phase:<8} {format_bytes(h.bytes):>10}  {h.location}  {h.reason}")
    return "\n".join(lines)
