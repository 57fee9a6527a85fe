"""``FUSEPASS_PROFILE=1`` on CUDA: time each fused elementwise kernel and the unfused ops it replaced.

On a kernel's first call its launcher hands ``measure`` two callables (the kernel, and the group's own
ops as a module) on that call's inputs; each is timed with ``triton.testing.do_bench`` (median) and the
record keeps both times. Attention rewrites are not measured: the fused op runs inside AOTAutograd's
graph and keeps no runnable copy of the ops it replaced.
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
    return f"{ENV}=1: elementwise kernels timed on their first call; attention rewrites are not measured"


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


def first_call_profiler(record: Rewrite, device: torch.device
                        ) -> Callable[[Callable[[], Any], Callable[[], Any]], None] | None:
    """What a launcher calls on its first call, or None when nothing is to be measured."""
    if not requested() or not can_profile(device):
        return None
    return lambda fused, unfused: measure(record, fused, unfused)
