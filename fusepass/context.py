"""What a pass is told about the graph it rewrites, and where it records what it did."""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.fx

from fusepass.options import Options
from fusepass.report.records import Hotspot
from fusepass.report.report import Report


@dataclass
class PassContext:
    report: Report
    options: Options
    phase: str  # "forward" | "backward"
    device: torch.device
    run_kernels: bool  # False: plan and report, but leave the graph's ops to run unfused

    def fallback(self, kind: str, location: str, reason: str, error: Exception,
                 ops: tuple[str, ...] = (), bytes: int = 0) -> None:
        """A pass failed on part of the graph: raise in strict mode, else warn and record it."""
        if self.options.strict:
            raise error
        warnings.warn(f"fusepass: {reason} at {location}: {type(error).__name__}: {error}; "
                      "running it unfused", RuntimeWarning, stacklevel=3)
        self.report.hotspots.append(Hotspot(kind=kind, phase=self.phase, location=location,
                                            reason=f"{reason}: {type(error).__name__}: {error}", ops=ops,
                                            bytes=bytes))


def graph_device(graph: torch.fx.Graph) -> torch.device:
    """The device the graph computes on: a CUDA device if any tensor lives there, else the CPU."""
    for node in graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.device.type == "cuda":
            return val.device
    return torch.device("cpu")
