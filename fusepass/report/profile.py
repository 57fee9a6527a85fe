"""``FUSEPASS_PROFILE=1`` on CUDA: time each fused kernel and the unfused ops it replaced.

On a kernel's first call it hands ``measure`` two callables on that call's inputs: the kernel, and the ops
it replaced as a module (an elementwise group's own ops; an attention's matched subgraph, which the fused
op is then also given the inputs of). Each is timed with ``triton.testing.do_bench`` (median) and the
record keeps both times. An attention's backward is timed on its first backward call: the unfused ops'
forward and backward together, less their forward alone.
"""
from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import torch

from fusepass.report.records import Rewrite

ENV = "FUSEPASS_PROFILE"
Timer = Callable[[Callable[[], Any]], float]


def requested() -> bool:
    return os.environ.get(ENV) == "1"


def can_profile(device: torch.device) -> bool:
    return device.type == "cuda"


def notice(device: torch.device) -> str | None:
    """What the report says about profiling, when it was asked for."""
    if not requested():
        return None
    if not can_profile(device):
        return f"{ENV}=1: profiling needs CUDA; nothing was measured"
    return f"{ENV}=1: every fused kernel and the ops it replaced are timed on its first call"


def median_ms(fn: Callable[[], Any]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, return_mode="median"))


def measure(record: Rewrite, fused: Callable[[], Any], unfused: Callable[[], Any],
            timer: Timer | None = None) -> None:
    """Time both on the same inputs and keep the times in ``record``; a failure only warns."""
    timer = timer or median_ms
    try:
        record.measured_fused_ms = timer(fused)
        record.measured_unfused_ms = timer(unfused)
    except Exception as error:  # measuring must never break the model
        warnings.warn(f"fusepass: profiling {record.detail.get('kernel', record.kind)} failed "
                      f"({type(error).__name__}: {error})", RuntimeWarning, stacklevel=2)


def measure_backward(record: Rewrite, fused: Callable[[], Any], unfused_forward_backward: Callable[[], Any],
                     unfused_forward_ms: float, timer: Timer | None = None) -> None:
    """The backward's times: the fused backward alone; the unfused ops' forward and backward, less their
    forward (the unfused backward cannot run without its own forward)."""
    timer = timer or median_ms
    try:
        record.measured_fused_ms = timer(fused)
        record.measured_unfused_ms = max(timer(unfused_forward_backward) - unfused_forward_ms, 0.0)
    except Exception as error:  # measuring must never break the model
        warnings.warn(f"fusepass: profiling the {record.kind} backward failed ({type(error).__name__}: {error})",
                      RuntimeWarning, stacklevel=2)


def first_call_profiler(record: Rewrite, device: torch.device
                        ) -> Callable[[Callable[[], Any], Callable[[], Any]], None] | None:
    """What a launcher calls on its first call, or None when nothing is to be measured."""
    if not requested() or not can_profile(device):
        return None
    return lambda fused, unfused: measure(record, fused, unfused)
