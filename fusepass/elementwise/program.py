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
    kind: str  # "load" | "step" | "guard"
    index: int


@dataclass(frozen=True)
class Guard:
    """``lo <= c < hi`` for the root coordinate ``c`` along ``dim``: where a piece of a cat or slice_backward is
    (`pieces`). A bool value of the kernel."""

    dim: int
    lo: int
    hi: int


@dataclass(frozen=True)
class Load:
    dtype: torch.dtype
    zero_dim: bool
    by_value: bool  # a 0-d tensor on the host while the kernel runs on a device: passed as a scalar
    guards: tuple[int, ...] = ()  # the program's guards it is read under: masked where any fails


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
    guards: tuple[Guard, ...] = ()

    def op_names(self) -> list[str]:
        return [step.target.overloadpacket.__name__ for step in self.steps]
