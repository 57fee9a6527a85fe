"""``fusepass.profile(model, *inputs)``: the compiled model's measured kernel time, given to each rewrite,
hotspot and matmul of its report, beside their roofline estimates.

The model is compiled with the ``annotate`` option (each op inside a profiler range naming its record,
report/attribution.py), run warm, then profiled for a few steps under ``torch.profiler``. Each range's
kernel time (on the CPU, where nothing runs on a device, its host time) is added to its record; records
alike (a repeated layer's) are one row, `× n` their calls per step. A kernel measured under 30 % of its
roofline time is flagged with what bounds it: the seeds' rule, a kernel far from its roofline is an
opportunity, not the hardware's limit.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.utils._pytree import tree_leaves

from fusepass.report import attribution
from fusepass.report.records import Hotspot, Rewrite
from fusepass.report.render import format_bytes, format_time
from fusepass.report.report import Report, reports
from fusepass.report.roofline import Ceilings, current_ceilings

FLAGGED_BELOW = 0.3  # of the roofline time: the seeds' "an opportunity, not a hardware limit"
# A step whose kernels take less than this share of its wall time waits on the host more than on the GPU.
HOST_BOUND_BELOW = 0.6


@dataclass
class ProfiledRow:
    """Records alike (kind, phase, source line, ops, bytes), their calls per step and times per step."""

    kind: str  # a rewrite's or hotspot's kind; "op" for an op no record names
    record: str  # "rewrite" | "hotspot" | "op"
    phase: str
    location: str
    what: str  # the ops, or the hotspot's reason
    calls: int  # per step
    measured_ms: float  # per step: device time on CUDA, host time on the CPU
    estimated_ms: float | None  # per step, at the roofline
    bytes: int  # per step
    flops: int
    layout: str = ""  # a row kernel's layout (`row_kernel.row_layout`): shown where the row is flagged

    @property
    def of_roofline(self) -> float | None:
        if self.estimated_ms is None or self.measured_ms <= 0:
            return None
        return self.estimated_ms / self.measured_ms

    def limit(self, ceilings: Ceilings) -> str:
        """The bound the roofline puts on this row and how far it is from it."""
        seconds = self.measured_ms * 1e-3
        if seconds <= 0:
            return ""
        if self.flops / ceilings.flops_per_s > self.bytes / ceilings.hbm_bytes_per_s:
            return f"compute-bound: {self.flops / seconds / 1e12:.3g} of {ceilings.flops_per_s / 1e12:.3g} TFLOP/s"
        return f"memory-bound: {self.bytes / seconds / 1e12:.3g} of {ceilings.hbm_bytes_per_s / 1e12:.3g} TB/s"


@dataclass
class Profile:
    rows: list[ProfiledRow]  # longest measured first
    steps: int  # profiled
    on_device: bool  # times are device times (CUDA); otherwise host times
    total_ms: float  # per step: every kernel's device time on CUDA; the steps' host time on the CPU
    reports: list[Report]
    ceilings: Ceilings
    wall_ms: float | None = None  # per step on the host's clock, the GPU waited for (CUDA only), outside the profiler

    @property
    def host_bound(self) -> bool:
        """Whether the GPU spends most of a step waiting on the host (Python, ATen's calls, launches)."""
        return self.on_device and bool(self.wall_ms) and self.total_ms < HOST_BOUND_BELOW * self.wall_ms

    @property
    def attributed_ms(self) -> float:
        return sum(r.measured_ms for r in self.rows)

    @property
    def flagged(self) -> list[ProfiledRow]:
        """Rows under `FLAGGED_BELOW` of their roofline time (on a device only: the estimates are its)."""
        return [r for r in self.rows if self.on_device and r.of_roofline is not None and r.of_roofline < FLAGGED_BELOW]

    def to_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "on_device": self.on_device, "total_ms": self.total_ms, "wall_ms": self.wall_ms,
                "attributed_ms": self.attributed_ms, "ceilings": self.ceilings.to_dict(),
                "rows": [{**asdict(r), "of_roofline": r.of_roofline, "limit": r.limit(self.ceilings)}
                         for r in self.rows]}

    def __str__(self) -> str:
        clock = "device" if self.on_device else "host (no CUDA device: the kernels ran on the CPU)"
        share = self.attributed_ms / self.total_ms if self.total_ms > 0 else 0.0
        lines = [f"fusepass profile: {self.steps} steps, {clock} time {self.total_ms:.3f} ms per step, "
                 f"{self.attributed_ms:.3f} ms ({share:.0%}) in the compiled graphs' ops",
                 "| what | phase | where | calls | estimated | measured | of roofline | bytes | bound |",
                 "|---|---|---|---|---|---|---|---|---|"]
        flagged = {id(r) for r in self.flagged}
        for r in self.rows:
            fraction = "" if r.of_roofline is None or not self.on_device else f"{r.of_roofline:.0%}"
            if id(r) in flagged:
                fraction += " ⚠"
            estimate = "" if r.estimated_ms is None else format_time(r.estimated_ms)
            bound = r.limit(self.ceilings) if self.on_device and r.record != "op" else ""
            if id(r) in flagged and r.layout:
                bound += f"; {r.layout}"
            what = f"{r.what}: in no record" if r.record == "op" else f"{r.kind} {r.record}: {r.what}"
            lines.append(f"| {what} | {r.phase} | {r.location} | {r.calls} | {estimate} | "
                         f"{format_time(r.measured_ms)} | {fraction} | {format_bytes(r.bytes)} | {bound} |")
        outside = self.total_ms - self.attributed_ms
        if self.on_device:
            lines.append(f"outside the compiled graphs' ops (eager code around the model, the loss if not compiled, "
                         f"the optimizer): {max(outside, 0.0):.3f} ms per step")
        if self.host_bound:
            lines.append(f"⚠ host-bound: kernels ran {self.total_ms:.3f} ms of a step's {self.wall_ms:.3f} ms (timed "
                         "without the profiler, with its ranges); the GPU waits on Python, ATen's calls and launches "
                         "for the rest. Whole-graph replays (fusepass.backend(graphs=True), the default, off while "
                         "profiling) remove most of it")
        if flagged:
            lines.append(f"⚠ {len(flagged)} row{'s' * (len(flagged) != 1)} under {FLAGGED_BELOW:.0%} of the roofline: "
                         "far from what their bytes and flops allow, not at a hardware limit")
        return "\n".join(lines)


def _what(record: Rewrite | Hotspot | None, op: str) -> tuple[str, str, str]:
    """(kind, record, what) of a row."""
    if isinstance(record, Rewrite):
        features = f" [{', '.join(record.features)}]" if record.features else ""
        return record.kind, "rewrite", f"{len(record.ops)} ops{features}"
    if isinstance(record, Hotspot):
        return record.kind, "hotspot", record.reason.split("\n")[0][:90]
    return "op", "op", op


def _cost(record: Rewrite | Hotspot | None) -> tuple[float | None, int, int]:
    """(estimated ms, bytes, flops) of one call."""
    if isinstance(record, Rewrite):
        return record.time_fused_ms, record.bytes_fused, record.flops_fused
    if isinstance(record, Hotspot):
        return record.time_ms, record.bytes, record.flops
    return None, 0, 0


def _kernels_by_launch(events: Sequence[Any]) -> dict[int, float]:
    """Device µs of the kernels each launch (by its correlation id) ran, ranges' device-timeline entries aside."""
    found: dict[int, float] = {}
    for e in events:
        if e.device_type == DeviceType.CUDA and attribution.target_of(e.name) is None:
            found[e.id] = found.get(e.id, 0.0) + e.device_time_total
    return found


def _direct_launches(event: Any) -> list[Any]:
    """The launches `event` made outside any ATen op (a Triton kernel's): the profiler links their kernels to the
    outermost compiled region, not to the range, where an ATen op's kernels are linked to the op."""
    found = []
    for child in event.cpu_children:
        if child.name.startswith("aten::"):
            continue
        if child.name.startswith(("cu", "cuda")):
            found.append(child)
        else:
            found += _direct_launches(child)
    return found


def _device_us(event: Any, launched: dict[int, float]) -> float:
    """Device µs of the kernels a range ran: its ATen ops' (linked to them) and its direct launches'."""
    return event.device_time_total + sum(launched.get(launch.id, 0.0) for launch in _direct_launches(event))


def attribute(events: Sequence[Any], steps: int, on_device: bool) -> list[ProfiledRow]:
    """The profiled ranges' times per step, records alike in one row, longest first."""
    rows: OrderedDict[tuple, ProfiledRow] = OrderedDict()
    launched = _kernels_by_launch(events) if on_device else {}
    for event in events:
        target = attribution.target_of(event.name)
        if target is None or event.device_type != DeviceType.CPU:
            continue
        measured = (_device_us(event, launched) if on_device else event.cpu_time_total) / 1e3 / steps
        kind, record, what = _what(target.record, target.op)
        estimated, moved, flops = _cost(target.record)
        key = (kind, record, target.phase, target.location, what, moved, flops)
        row = rows.get(key)
        if row is None:
            layout = target.record.detail.get("row kernel", "") if isinstance(target.record, Rewrite) else ""
            row = rows[key] = ProfiledRow(kind, record, target.phase, target.location, what, 0, 0.0,
                                          None if estimated is None else 0.0, 0, 0, layout)
        row.calls += 1
        row.measured_ms += measured
        row.bytes += moved
        row.flops += flops
        if estimated is not None:
            row.estimated_ms += estimated
    for row in rows.values():  # the sums ran over every profiled step
        row.calls //= steps
        row.bytes //= steps
        row.flops //= steps
        if row.estimated_ms is not None:
            row.estimated_ms /= steps
    return sorted((r for r in rows.values() if r.record != "op" or r.measured_ms > 0),
                  key=lambda r: -r.measured_ms)


def _device_total_ms(events: Sequence[Any], steps: int) -> float:
    """Every kernel's device time per step (the ranges also show on the device's timeline: not kernels)."""
    return sum(e.device_time_total for e in events
               if e.device_type == DeviceType.CUDA and attribution.target_of(e.name) is None) / 1e3 / steps


_STEPS_RANGE = "fusepass.profile: steps"


def _host_total_ms(events: Sequence[Any], steps: int) -> float:
    """The profiled steps' host time per step, on the clock of the ranges inside them."""
    return next(e.cpu_time_total for e in events if e.name == _STEPS_RANGE) / 1e3 / steps


def profile(model: torch.nn.Module | Callable, *inputs: Any, loss: Callable[[Any], torch.Tensor] | None = None,
            steps: int = 3, **options: Any) -> Profile:
    """Compile `model` with fusepass (`options` as ``fusepass.backend`` takes them), run it warm, and profile
    `steps` calls: with `loss` (a function of the outputs returning a scalar) each is a training step, forward
    and backward; without, a forward under ``torch.no_grad()``. Launches are not replayed as CUDA graphs
    (`replay` and `graphs` are off): device times are the same, host times are not those of a replayed call. On a
    device the steps are also timed without the profiler, and a step whose kernels take under `HOST_BOUND_BELOW` of
    its time is called host-bound. The parameters' gradients are as they were before. The result prints as a table
    (``print(fusepass.profile(...))``) and converts to a dict."""
    from fusepass.options import Options
    from fusepass.pipeline import Backend

    if steps < 1:
        raise ValueError(f"fusepass.profile: steps must be at least 1, not {steps}")
    # Without replays: the kernels a CUDA graph replays are not linked to the range that replayed them.
    backend = Backend(Options.from_kwargs(**options).with_changes(annotate=True, replay=False, graphs=False))
    parameters = list(model.parameters()) if isinstance(model, torch.nn.Module) else []
    grads = [p.grad for p in parameters]  # set aside: a backward would add to them in place
    for p in parameters:
        p.grad = None
    on_device = any(isinstance(t, torch.Tensor) and t.is_cuda for t in tree_leaves(inputs))
    known = {id(r) for r in reports()}
    compiled = torch.compile(model, backend=backend)

    def step() -> None:
        if loss is None:
            with torch.no_grad():
                compiled(*inputs)
        else:
            loss(compiled(*inputs)).backward()

    def synchronize() -> None:
        if on_device:
            torch.cuda.synchronize()

    wall_ms = None
    try:
        for _ in range(2):  # the first call compiles, the second runs as every later one
            step()
        synchronize()
        if on_device:
            started = time.perf_counter()
            for _ in range(steps):
                step()
            synchronize()
            wall_ms = (time.perf_counter() - started) * 1e3 / steps
        activities = [torch.profiler.ProfilerActivity.CPU]
        if on_device:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as profiler:
            # Timed by the profiler's own clock, as the ranges in it are: a wall clock beside it drifts from
            # theirs, and the ranges' sum would exceed a step taken almost wholly by them.
            with torch.profiler.record_function(_STEPS_RANGE):
                for _ in range(steps):
                    step()
                synchronize()
    finally:
        for p, grad in zip(parameters, grads):
            p.grad = grad
    events = profiler.events()
    return Profile(attribute(events, steps, on_device), steps, on_device,
                   _device_total_ms(events, steps) if on_device else _host_total_ms(events, steps),
                   [r for r in reports() if id(r) not in known], current_ceilings(), wall_ms)
