"""The report as a stable, readable table: no ids or addresses, fixed units, graph order, 100 columns,
plain ASCII (expecttest snapshots it).

Each rewrite takes two lines: its numbers (HBM bytes unfused, fused and saved; FLOP per byte and the
roofline time, unfused and fused), then where it is and what else is known (ops, flops, activation memory
kept for the backward, measured times, features). Hotspots follow, longest estimated time first.
"""
from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING

from fusepass.report.records import KERNEL, KNOWN_CONTENTS, SDPA, Hotspot, Rewrite

if TYPE_CHECKING:  # the report renders itself through this module: no import back at run time
    from fusepass.report.report import Report

WIDTH = 100
# Columns: kind and phase 22, HBM bytes 3 × 11, FLOP/B 9 + 8, est. time 2 × 10.
HEADER = [f"{'rewrites':<22}{'HBM bytes':^33}{'FLOP/B':^17}{'est. time':^20}",
          f"{'':<22}{'unfused':>11}{'fused':>11}{'saved':>11}{'unfused':>9}{'fused':>8}"
          f"{'unfused':>10}{'fused':>10}"]


def format_bytes(n: float) -> str:
    sign = "-" if n < 0 else ""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{sign}{abs(n) / size:.1f} {unit}"
    return f"{n:.0f} B"


def format_time(ms: float | None) -> str:
    if ms is None:
        return "-"
    for unit, scale in (("s", 1e3), ("ms", 1.0), ("us", 1e-3)):
        if ms >= scale:
            return f"{ms / scale:.3g} {unit}"
    return f"{ms * 1e6:.3g} ns"


def format_ops(n: int) -> str:
    return f"{n} op" if n == 1 else f"{n} ops"


def format_count(n: float, unit: str) -> str:
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {prefix}{unit}"
    return f"{n:.0f} {unit}"


def format_intensity(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.2f}" if x < 10 else f"{x:.1f}" if x < 1000 else f"{x:.0f}"


def _rewrite_lines(r: Rewrite) -> list[str]:
    numbers = (f"  {r.kind:<11} {r.phase:<8}{format_bytes(r.bytes_unfused):>11}{format_bytes(r.bytes_fused):>11}"
               f"{format_bytes(r.bytes_saved):>11}{format_intensity(r.intensity_unfused):>9}"
               f"{format_intensity(r.intensity_fused):>8}{format_time(r.time_unfused_ms):>10}"
               f"{format_time(r.time_fused_ms):>10}")
    about = [r.location, format_ops(len(r.ops)), format_count(r.flops, "FLOP")]
    if r.activation_bytes_saved:
        # Negative where the fused op keeps more (its output and row statistics outweigh small probabilities).
        fewer = r.activation_bytes_saved > 0
        about.append(f"{format_bytes(abs(r.activation_bytes_saved))} {'less' if fewer else 'more'} kept for backward")
    if r.measured_speedup is not None:
        about.append(f"measured {format_time(r.measured_unfused_ms)} -> {format_time(r.measured_fused_ms)} "
                     f"({r.measured_speedup:.2f}x)")
    if r.features:
        about.append(", ".join(r.features))
    for name, band in r.detail.get(KNOWN_CONTENTS, {}).items():
        about.append(f"{name} computed from the positions ({band}; its contents checked on each call)")
    for shape, ran in r.detail.get(SDPA, {}).items():
        about.append(f"at {shape}: {ran}")
    for shape, kernel in r.detail.get(KERNEL, {}).items():
        about.append(f"at {shape}: {kernel}")
    return [numbers] + _wrapped(" | ".join(about), "      ")


def _hotspot_lines(h: Hotspot) -> list[str]:
    head = f"  {h.kind:<12} {h.phase:<8}{format_bytes(h.bytes):>11}{format_time(h.time_ms):>10}  {h.location}"
    if len(head) + 2 + len(h.reason) <= WIDTH:
        return [f"{head}  {h.reason}"]
    return [head] + _wrapped(h.reason, "      ")


def _wrapped(text: str, indent: str) -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=indent, subsequent_indent=indent + "  ",
                         break_on_hyphens=False)


def render_table(report: Report) -> str:
    rewrites, hotspots = len(report.rewrites), len(report.hotspots)
    c = report.ceilings
    lines = [f"fusepass report - {report.graph} on {report.device}: {rewrites} rewrite{'s' * (rewrites != 1)}, "
             f"{hotspots} hotspot{'s' * (hotspots != 1)}",
             f"roofline: {c.name}, {c.hbm_bytes_per_s / 1e12:.2f} TB/s, {c.flops_per_s / 1e12:.0f} TFLOP/s "
             f"({c.source})"]
    for notice in report.notices:
        lines += _wrapped(f"note: {notice}", "")
    if report.rewrites:
        lines += [""] + HEADER
        for r in report.rewrites:
            lines += _rewrite_lines(r)
        unfused = sum(r.bytes_unfused for r in report.rewrites)
        fused = sum(r.bytes_fused for r in report.rewrites)
        before = sum(r.time_unfused_ms or 0.0 for r in report.rewrites)
        after = sum(r.time_fused_ms or 0.0 for r in report.rewrites)
        lines.append(f"  {'total':<20}{format_bytes(unfused):>11}{format_bytes(fused):>11}"
                     f"{format_bytes(unfused - fused):>11}{'':>17}{format_time(before):>10}"
                     f"{format_time(after):>10}")
    if report.hotspots:
        lines += ["", f"hotspots, by estimated time{'HBM':>17}{'est.':>10}"]
        for h in report.ranked_hotspots:
            lines += _hotspot_lines(h)
    return "\n".join(line.rstrip() for line in lines)
