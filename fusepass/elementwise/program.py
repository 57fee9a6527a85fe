"""What one fused group computes, as plain hashable data: the kernel cache key and the source's input.

Values are named by ``Ref``: the k-th load or the j-th step. Shapes and strides are absent on purpose:
the launcher resolves them at run time, so one program serves every size.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Ref:
    kind: str  # "load" | "step"
    index: int


@dataclass(frozen=True)
class Load:
    dtype: torch.dtype
    zero_dim: bool
    by_value: bool  # a 0-d tensor on the host while the kernel runs on a device: passed as a scalar


@dataclass(frozen=True)
class Step:
    target: Any  # an ATen op overload
    args: tuple[Any, ...]  # Refs and Python values
    kwargs: tuple[tuple[str, Any], ...]
    dtype: torch.dtype
    zero_dim: bool


@dataclass(frozen=True)
class Program:
    loads: tuple[Load, ...]
    steps: tuple[Step, ...]
    outputs: tuple[tuple[Ref, torch.dtype], ...]

    def op_names(self) -> list[str]:
        return [step.target.overloadpacket.__name__ for step in self.steps]
