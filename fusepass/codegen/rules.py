"""The table every pointwise translation is a row of (`RULES`), and what a row's rule gets (`Ctx`).

A rule names the arguments that take part in type promotion ("operands", converted to the computation dtype
before the rule sees them) and the promotion kind; the other arguments arrive as Python values. A rule returns an
expression in the computation dtype (bool for ALWAYS_BOOL). The rows are `pointwise.py`'s (arithmetic,
comparisons, math functions) and `activations.py`'s (activations and their backward ops).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND as Kind

from fusepass.codegen.operands import literal, literal_value


@dataclass(frozen=True)
class Rule:
    emit: Callable[..., str]
    operands: tuple[str, ...]
    kind: Kind | Callable[[dict[str, Any]], Kind] | None
    # Why the rule does not translate an op with these (bound) arguments, or None where it does.
    declines: Callable[[dict[str, Any]], str | None] | None = None


RULES: dict[Any, Rule] = {}


def rule(*packets: Any, operands: tuple[str, ...] = ("self",), kind: Any = Kind.DEFAULT,
         declines: Callable[[dict[str, Any]], str | None] | None = None):
    def register(fn: Callable[..., str]) -> Callable[..., str]:
        for packet in packets:
            RULES[packet] = Rule(fn, operands, kind, declines)
        return fn

    return register


class Ctx:
    """What a rule may ask about the op it translates."""

    def __init__(self, compute: torch.dtype, result: torch.dtype, raw: dict[str, Any], within_rounding: bool = False):
        self.compute = compute
        self.result = result
        self.raw = raw  # operands as given: Operands, or Python numbers before they became literals
        # The result may be computed within the rounding eager gives it in `result`: it stays in float32 and reaches
        # its uses through continuous arithmetic alone (translate's round_halves=False and continuous_uses)
        self.within_rounding = within_rounding

    @property
    def is_float(self) -> bool:
        return self.compute.is_floating_point

    def lit(self, value: Any) -> str:
        return literal(value, self.compute)


BINARY = ("self", "other")


def clamp_expr(c, x: str, low: str | None, high: str | None) -> str:
    # Comparisons rather than minimum/maximum: NaN in x passes through as in eager, and so does a NaN bound.
    if low is not None:
        x = _clamped(x, low, "<")
    if high is not None:
        x = _clamped(x, high, ">")
    return x


def _clamped(x: str, bound: str, beyond: str) -> str:
    """x, or `bound` where x is `beyond` it or the bound is NaN (a tensor's, or a literal's)."""
    value = literal_value(bound)
    if value is None:
        return f"tl.where(({x} {beyond} {bound}) | ({bound} != {bound}), {bound}, {x})"
    if math.isnan(value):
        return f"({x} * 0.0 + {bound})"
    return f"tl.where({x} {beyond} {bound}, {bound}, {x})"
