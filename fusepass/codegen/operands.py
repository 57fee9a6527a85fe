"""What the translator passes around: an operand (a Triton expression and the dtype eager gives its value), the dtype
it is held in (half and bfloat16 in float32), literals, conversions and the roundings of a stored value."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch

TRITON_DTYPE = {
    torch.bool: "tl.int1",
    torch.uint8: "tl.uint8",
    torch.int8: "tl.int8",
    torch.int16: "tl.int16",
    torch.int32: "tl.int32",
    torch.int64: "tl.int64",
    torch.float16: "tl.float16",
    torch.bfloat16: "tl.bfloat16",
    torch.float32: "tl.float32",
    torch.float64: "tl.float64",
}

SUPPORTED_DTYPES = frozenset(TRITON_DTYPE)


def held_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a value of eager dtype ``dtype`` is held in inside a kernel."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


@dataclass(frozen=True)
class Operand:
    """A value inside a kernel: a Triton expression holding ``held_dtype(dtype)``."""

    expr: str
    dtype: torch.dtype  # what eager would give
    zero_dim: bool = False  # 0-d tensors rank below dimensioned ones in type promotion
    # held exactly in its half dtype (a load, a result rounded as eager materializes it): rounding it is nothing
    rounded: bool = False


class Emitter:
    """Collects the statements of a kernel body; every op result gets its own name."""

    def __init__(self, prefix: str = "t") -> None:
        self.lines: list[str] = []
        self.prefix = prefix  # names are the prefix and a number
        self._count = 0

    def let(self, expr: str) -> str:
        name = f"{self.prefix}{self._count}"
        self._count += 1
        self.lines.append(f"{name} = {expr}")
        return name


def literal_value(text: str) -> float | None:
    """The value of a number `literal` wrote, or None for any other expression."""
    found = re.fullmatch(r"tl\.full\(\[\], (.+), tl\.float64\)", text)
    text = found.group(1) if found else text
    special = re.fullmatch(r'float\("(nan|inf|-inf)"\)', text)
    try:
        return float(special.group(1) if special else text)
    except ValueError:
        return None


def literal(value: Any, dtype: torch.dtype) -> str:
    """A Python scalar as a Triton literal of ``dtype`` (held dtype)."""
    if dtype == torch.bool:
        return "True" if value else "False"
    if dtype.is_floating_point:
        value = float(value)
        if math.isnan(value):
            text = 'float("nan")'
        elif math.isinf(value):
            text = 'float("inf")' if value > 0 else 'float("-inf")'
        else:
            text = repr(value)
        # A bare literal is float32 in Triton; a float64 computation needs a float64 constant.
        return f"tl.full([], {text}, tl.float64)" if dtype == torch.float64 else text
    return repr(int(value))


def convert(value: Operand | bool | int | float, dtype: torch.dtype) -> str:
    """``value`` as an expression of held dtype ``held_dtype(dtype)``."""
    target = held_dtype(dtype)
    if not isinstance(value, Operand):
        return literal(value, target)
    if held_dtype(value.dtype) == target:
        return value.expr
    if target == torch.bool:
        return f"({value.expr} != 0)"
    return to_stored(value.expr, held_dtype(value.dtype), target)


def to_stored(expr: str, source: torch.dtype, dtype: torch.dtype) -> str:
    """An expression of Triton type ``source`` as ``dtype``, rounding float downcasts to nearest even."""
    if dtype == torch.bfloat16 and source != torch.bfloat16:
        return f"fm.to_bfloat16({expr})"
    return f"{expr}.to({TRITON_DTYPE[dtype]})"


def round_to(expr: str, dtype: torch.dtype) -> str:
    """Round a float32-held value to half/bfloat16 precision (an explicit cast in the user's code)."""
    if dtype in (torch.float16, torch.bfloat16):
        return f"{to_stored(expr, torch.float32, dtype)}.to(tl.float32)"
    return expr
