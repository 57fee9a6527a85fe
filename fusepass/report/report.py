"""A compile's report: a view over the records the passes appended, and the list of reports so far."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from fusepass.report.records import Hotspot, Rewrite


@dataclass
class Report:
    graph: str  # which compiled graph, in compile order ("graph 0", "graph 1", ...)
    rewrites: list[Rewrite] = field(default_factory=list)
    hotspots: list[Hotspot] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)
    # The rewritten graphs by phase, for reading what fusepass produced (not part of the JSON).
    graphs: dict[str, Any] = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "graph": self.graph,
            "rewrites": [r.to_dict() for r in self.rewrites],
            "hotspots": [h.to_dict() for h in self.hotspots],
            "notices": list(self.notices),
        }

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        from fusepass.report.render import render_table

        return render_table(self)


_reports: list[Report] = []


def new_report() -> Report:
    report = Report(graph=f"graph {len(_reports)}")
    _reports.append(report)
    return report


def reports() -> list[Report]:
    """The reports recorded since the last ``reset()``, in compile order."""
    return list(_reports)


def last_report() -> Report | None:
    return _reports[-1] if _reports else None


def reset() -> None:
    _reports.clear()
