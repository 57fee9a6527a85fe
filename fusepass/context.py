"""What a pass is told about the graph it rewrites, and where it records what it did."""
from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch._dynamo.exc
import torch.fx

from fusepass.options import Options
from fusepass.report.records import Hotspot, Rewrite
from fusepass.report.report import Report

# Dynamo's and AOTAutograd's own control flow (a restart of the analysis, a frame to skip), raised through a
# backend: never a failure to fall back from.
CONTROL_FLOW = (torch._dynamo.exc.RestartAnalysis, torch._dynamo.exc.SkipFrame, torch._dynamo.exc.ResetRequired)


@dataclass
class PassContext:
    report: Report
    options: Options
    phase: str  # "forward" | "backward"
    device: torch.device
    run_kernels: bool  # False: plan and report, but leave the graph's ops to run unfused
    # Where failures are recorded, if not in `report`: an attention planned at run time at a new size records its
    # rewrite in a report of its own, and its kernels' failures in the compile's (attention/dynamic.py).
    failures: Report | None = None
    sizes_vary: bool = False  # the graph is one size's plan of a graph of symbolic sizes

    def fallback(self, kind: str, location: str, reason: str, error: Exception,
                 ops: tuple[str, ...] = (), bytes: int = 0, phase: str | None = None,
                 withdrawn: Sequence[Rewrite] = ()) -> None:
        """A pass (or, at run time, a kernel of the given phase) failed on part of the graph: raise in strict
        mode, else warn and record it. The `withdrawn` rewrites no longer run: they leave the report's rewrites."""
        if self.options.strict or isinstance(error, CONTROL_FLOW):
            raise error
        said = f"{type(error).__name__}: {error}{_triton_hooks_note()}"
        warnings.warn(f"fusepass: {reason} at {location}: {said}; running it unfused", RuntimeWarning, stacklevel=3)
        report = self.failures or self.report
        report.hotspots.append(Hotspot(kind=kind, phase=phase or self.phase, location=location,
                                       reason=f"{reason}: {said}", ops=ops, bytes=bytes))
        self.report.rewrites[:] = [r for r in self.report.rewrites if not any(r is w for w in withdrawn)]


def _triton_hooks_note() -> str:
    """Where Triton's JIT cache hook is set, why it may be what failed: Triton hands it each new kernel's constexpr
    arguments serialized as JSON before the compile, and the attention kernels take their score functions (jit
    functions, which JSON cannot hold) as constexprs. (The post-compile hook fails the same way after the kernel was
    cached, and `runtime.launch` launches again.) Triton's compilation listener serializes nothing."""
    import triton

    if not getattr(triton.knobs.runtime, "jit_cache_hook", None):
        return ""
    return (" (triton.knobs.runtime.jit_cache_hook is set: Triton serializes a kernel's constexpr arguments for it, "
            "which fusepass's score functions are not; triton.knobs.compilation.listener sees every compile without)")


def graph_device(graph: torch.fx.Graph) -> torch.device:
    """The device the graph computes on: a CUDA device if any tensor lives there, else the CPU."""
    for node in graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.device.type == "cuda":
            return val.device
    return torch.device("cpu")


PLANNED = "fusepass_attention"  # a key of node.meta["custom"], which AOTAutograd carries to what it derives


def mark_planned(nodes: list[torch.fx.Node], name: str) -> None:
    """Mark the ops a planned (not applied) attention rewrite stands for, in the graphs AOTAutograd derives
    too, so that the elementwise pass neither fuses them nor counts their bytes a second time."""
    for node in nodes:
        node.meta["custom"] = {**(node.meta.get("custom") or {}), PLANNED: name}


def planned_attention(node: torch.fx.Node) -> str | None:
    """The planned attention rewrite ``node`` belongs to, if any."""
    return (node.meta.get("custom") or {}).get(PLANNED)
