"""Value ranges of index code: int64 positions computed in int32 where they provably fit.

Torch computes positions (``arange``, their differences, ALiBi distances) in int64. On the GPU int64
arithmetic takes two instructions and int64 → float32 conversion is slow, on every element of every tile.
So the lifter tracks, for int64 index values, the span of values they can take; one whose span fits in
int32 is emitted as int32, where every operation on it gives what int64 would. An op whose result could
leave int32 (or whose range is not tracked here) gets its operands widened back to int64 first.

Floats computed from positions have spans too (T5's log-scaled buckets: a log of a clamped distance, scaled,
converted back to int64), so that their conversion to an integer gets one. A float span holds the exact
results widened by `float_rounding` per op, for fp32's rounding; a conversion to an integer then takes every
integer the truncated values can reach.
"""
from __future__ import annotations

import math
from typing import Any

import torch

aten = torch.ops.aten

Span = tuple[float, float]  # inclusive: ints for integer values
INT32 = (-(2 ** 31 - 1), 2 ** 31 - 1)  # symmetric, so that negation and abs stay inside


def fits(span: Span | None) -> bool:
    return span is not None and INT32[0] <= span[0] and span[1] <= INT32[1]


def float_exact(span: Span | None) -> bool:
    """Whether every integer of the span is exact in fp32 (and so are sums and differences within it)."""
    return span is not None and -2 ** 24 <= span[0] and span[1] <= 2 ** 24


def narrow(dtype: torch.dtype, span: Span | None) -> bool:
    """Whether a value of this dtype and span is emitted as int32 though torch holds it in int64."""
    return dtype == torch.int64 and fits(span)


def float_rounding(span: Span | None) -> Span | None:
    """A float op's exact span widened for its fp32 rounding (and the error of fast special functions): far
    more than a few ulps, which is all a handful of ops can add. None where not finite."""
    if span is None or not all(math.isfinite(x) for x in span):
        return None
    return tuple(x + sign * (abs(x) * 2.0 ** -16 + 2.0 ** -16) for x, sign in zip(span, (-1, 1)))


def truncated(span: Span | None) -> Span | None:
    """The integers a float of this span converts to (truncation toward zero)."""
    if span is None or not all(math.isfinite(x) for x in span):
        return None
    return math.trunc(span[0]), math.trunc(span[1])


def _product(a: Span, b: Span) -> Span:
    ends = [x * y for x in a for y in b]
    return min(ends), max(ends)


def _clip(span: Span, low: Span | None, high: Span | None) -> Span:
    lo, hi = span
    if low is not None:
        lo, hi = max(lo, low[0]), max(hi, low[1])
    if high is not None:
        lo, hi = min(lo, high[0]), min(hi, high[1])
    return lo, hi


def result_span(target: Any, spans: dict[str, Span | None]) -> Span | None:
    """The span of an op's integer result from its arguments' (by schema name; an argument given as None is
    left out, one of unknown span is None), or None when unknown."""
    kind = getattr(target, "overloadpacket", target)
    a, b = spans.get("self"), spans.get("other")
    alpha = spans.get("alpha", (1, 1))
    if kind in (aten.add, aten.sub) and a is not None and b is not None and alpha is not None:
        b = _product(b, alpha)
        return (a[0] + b[0], a[1] + b[1]) if kind == aten.add else (a[0] - b[1], a[1] - b[0])
    if kind == aten.mul and a is not None and b is not None:
        return _product(a, b)
    if kind == aten.neg and a is not None:
        return -a[1], -a[0]
    if kind == aten.abs and a is not None:
        if a[0] >= 0:
            return a
        return (-a[1], -a[0]) if a[1] <= 0 else (0, max(-a[0], a[1]))
    if kind in (aten.minimum, aten.maximum) and a is not None and b is not None:
        pick = min if kind == aten.minimum else max
        return pick(a[0], b[0]), pick(a[1], b[1])
    if kind in (aten.clamp, aten.clamp_min, aten.clamp_max) and a is not None:
        if any(spans[name] is None for name in ("min", "max") if name in spans):
            return None
        return _clip(a, spans.get("min"), spans.get("max"))
    if kind == aten.where and a is not None and b is not None:
        return min(a[0], b[0]), max(a[1], b[1])
    if kind == aten.div and a is not None and b is not None and "rounding_mode" not in spans:  # true division
        if b[0] <= 0 <= b[1]:
            return None
        ends = [x / y for x in a for y in b]
        return min(ends), max(ends)
    if kind == aten.log and a is not None and a[0] > 0:
        return math.log(a[0]), math.log(a[1])
    return None
