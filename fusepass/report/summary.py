"""One summary over the reports of a compile (every graph, graph breaks included): identical rewrites of repeated
layers grouped (``× 12``), the hotspots by reason, longest estimated time first, one total line."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from fusepass.report.render import format_bytes, format_ops, format_time
from fusepass.report.report import Report


def summarize(reports: Sequence[Report]) -> str:
    groups: OrderedDict[tuple, list] = OrderedDict()
    for report in reports:
        for r in report.rewrites:
            key = (r.kind, r.phase, tuple(r.features), tuple(r.ops), r.bytes_unfused, r.bytes_fused)
            groups.setdefault(key, []).append(r)
    lines = [f"fusepass summary: {len(reports)} graph{'s' * (len(reports) != 1)}, "
             f"{sum(len(g) for g in groups.values())} rewrites, {sum(len(r.hotspots) for r in reports)} hotspots"]
    saved = 0
    for (kind, phase, features, ops, unfused, fused), records in groups.items():
        count = len(records)
        saved += count * (unfused - fused)
        where = records[0].location if count == 1 else f"{records[0].location} and {count - 1} more"
        label = f" [{', '.join(features)}]" if features else ""
        lines.append(f"  {kind} {phase}{label} × {count}: {format_ops(len(ops))}, {format_bytes(unfused)} → "
                     f"{format_bytes(fused)} each ({where})")
    reasons: OrderedDict[tuple[str, str], list] = OrderedDict()
    for report in reports:
        for h in report.hotspots:
            reasons.setdefault((h.kind, h.reason.split("\n")[0][:100]), []).append(h)
    ranked = sorted(reasons.items(), key=lambda item: -sum(h.time_ms or 0.0 for h in item[1]))  # stable
    for (kind, reason), found in ranked:
        time = sum(h.time_ms or 0.0 for h in found)
        lines.append(f"  hotspot {kind} × {len(found)}: {reason}" + (f" (est. {format_time(time)})" if time else ""))
    lines.append(f"  total: {format_bytes(saved)} of HBM traffic saved")
    return "\n".join(lines)
