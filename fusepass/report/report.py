"""A compile's report: a view over the records the passes appended, and the list of reports so far."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from fusepass.report.records import Hotspot, Rewrite
from fusepass.report.roofline import Ceilings, current_ceilings

SCHEMA_VERSION = 1  # of to_dict(): docs/report.schema.json


@dataclass
class Report:
    graph: str  # which compiled graph, in compile order ("graph 0", "graph 1", ...)
    rewrites: list[Rewrite] = field(default_factory=list)
    hotspots: list[Hotspot] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)
    device: str = "?"  # the device the graph computes on
    ceilings: Ceilings = field(default_factory=current_ceilings)  # of the roofline estimates
    complete: bool = False  # every graph compiled: the forward, and the backward if there is one
    # The rewritten graphs by phase, for reading what fusepass produced (not part of the JSON).
    graphs: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def ranked_hotspots(self) -> list[Hotspot]:
        """The hotspots by estimated time, longest first (record order among equals)."""
        return sorted(self.hotspots, key=lambda h: -(h.time_ms or 0.0))

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": SCHEMA_VERSION,
            "graph": self.graph,
            "device": self.device,
            "complete": self.complete,
            "ceilings": self.ceilings.to_dict(),
            "rewrites": [r.to_dict() for r in self.rewrites],
            "hotspots": [h.to_dict() for h in self.ranked_hotspots],
            "notices": list(self.notices),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Report":
        return cls(graph=data["graph"], device=data["device"], complete=data["complete"],
                   ceilings=Ceilings(**data["ceilings"]),
                   rewrites=[Rewrite.from_dict(r) for r in data["rewrites"]],
                   hotspots=[Hotspot.from_dict(h) for h in data["hotspots"]], notices=list(data["notices"]))

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def save_html(self, path: str) -> None:
        """A self-contained page: the tables and a roofline chart (the chart needs matplotlib)."""
        from fusepass.report.html import render_html

        with open(path, "w", encoding="utf-8") as f:
            f.write(render_html(self))

    def __str__(self) -> str:
        from fusepass.report.render import render_table

        return render_table(self)


_reports: list[Report] = []


def new_report() -> Report:
    report = Report(graph=f"graph {len(_reports)}")
    _reports.append(report)
    return report


def discard(report: Report) -> None:
    """Forget a report whose compile was abandoned (Dynamo restarts the frame's analysis)."""
    if report in _reports:
        _reports.remove(report)


def reports() -> list[Report]:
    """The reports recorded since the last ``reset()``, in compile order."""
    return list(_reports)


def last_report() -> Report | None:
    return _reports[-1] if _reports else None


def reset() -> None:
    _reports.clear()
