"""The pointwise table's arithmetic, comparisons and math functions: each ATen op's rule, its Triton expression
(the activations are `activations.py`'s; the table and what a rule gets, `rules.py`'s).

Both generators read it through the translator (`translate.py`): the elementwise pass emits a kernel body over a
flat index, the attention pass emits score functions over index tiles. A rule gets its operands converted to the
computation dtype PyTorch's type promotion gives the op (``torch._prims_common.elementwise_dtypes``): half and
bfloat16 values are held and computed in float32 and rounded only when stored or explicitly cast
(`operands.py`); integer division and remainder follow ATen's definitions.

To add an op: a function decorated with ``@rule(aten.op, operands=..., kind=...)`` that returns the expression
(`Ctx` says what it may ask about the op), and the op among those tests/codegen/test_pointwise_ops.py checks
against eager in every dtype it takes.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND as Kind

from fusepass.codegen.operands import held_dtype, round_to
from fusepass.codegen.rules import BINARY, clamp_expr, rule

aten = torch.ops.aten


@rule(aten.add, operands=BINARY)
def _add(c, self, other, alpha=1):
    if c.compute == torch.bool:
        return f"({self} | {other})"
    return f"({self} + {other})" if alpha == 1 else f"({self} + {other} * {c.lit(alpha)})"


@rule(aten.sub, operands=BINARY)
def _sub(c, self, other, alpha=1):
    return f"({self} - {other})" if alpha == 1 else f"({self} - {other} * {c.lit(alpha)})"


@rule(aten.rsub, operands=BINARY)
def _rsub(c, self, other, alpha=1):
    return f"({other} - {self})" if alpha == 1 else f"({other} - {self} * {c.lit(alpha)})"


@rule(aten.mul, operands=BINARY)
def _mul(c, self, other):
    return f"({self} & {other})" if c.compute == torch.bool else f"({self} * {other})"


def _div_kind(args: dict[str, Any]) -> Kind:
    return Kind.DEFAULT if args.get("rounding_mode") else Kind.INT_TO_FLOAT


def float32_reciprocal(divisor: Any) -> float | None:
    """The float32 reciprocal a division by the constant `divisor` multiplies by (see `_quotient`), or None
    where it divides."""
    if not isinstance(divisor, (int, float)) or isinstance(divisor, bool):
        return None
    reciprocal = float(torch.tensor(1.0, dtype=torch.float32) / float(divisor))
    return reciprocal if math.isfinite(reciprocal) and abs(reciprocal) >= torch.finfo(torch.float32).tiny else None


def _quotient(c, self, other) -> str:
    """self / other. By a constant, in float32, as a product with its reciprocal: Triton's float32 `/` is
    `div.full.f32`, a reciprocal on the special-function unit (the one exp2 needs in attention) and a
    multiply, no closer to the exact quotient (2 ulp) than the product (1 ulp; exact for powers of two)."""
    reciprocal = float32_reciprocal(c.raw.get("other"))
    if reciprocal is not None and held_dtype(c.compute) == torch.float32:
        return f"({self} * {c.lit(reciprocal)})"
    return f"({self} / {other})"


@rule(aten.div, operands=BINARY, kind=_div_kind)
def _div(c, self, other, rounding_mode=None):
    if rounding_mode is None:
        return _quotient(c, self, other)
    if rounding_mode == "trunc":
        # Eager truncates the quotient as rounded to the result dtype.
        return f"fm.trunc({round_to(f'({self} / {other})', c.result)})" if c.is_float else f"({self} // {other})"
    if rounding_mode == "floor":
        return _floor_divide(c, self, other)
    raise NotImplementedError(f"div rounding_mode={rounding_mode!r}")


@rule(aten.floor_divide, operands=BINARY)
def _floor_divide(c, self, other):
    return f"fm.float_floor_div({self}, {other})" if c.is_float else f"fm.int_floor_div({self}, {other})"


@rule(aten.true_divide, operands=BINARY, kind=Kind.INT_TO_FLOAT)
def _true_divide(c, self, other):
    return _quotient(c, self, other)


@rule(aten.fmod, operands=BINARY)
def _fmod(c, self, other):
    return f"fm.fmod({self}, {other})" if c.is_float else f"({self} % {other})"


@rule(aten.remainder, operands=BINARY)
def _remainder(c, self, other):
    return f"fm.remainder({self}, {other})" if c.is_float else f"fm.int_remainder({self}, {other})"


@rule(aten.neg)
def _neg(c, self):
    # Triton's `-x` is `0 - x`: +0.0 stays +0.0, where eager's negation gives -0.0.
    return f"fm.flip({self})" if c.is_float else f"(-{self})"


@rule(aten.reciprocal, kind=Kind.INT_TO_FLOAT)
def _reciprocal(c, self):
    return f"({c.lit(1)} / {self})"


@rule(aten.pow, operands=("self", "exponent"), kind=Kind.BOOL_TO_LONG)
def _pow(c, self, exponent):
    e = c.raw["exponent"]
    if isinstance(e, (int, float)) and not isinstance(e, bool):
        # Small constant exponents as products, as eager's kernels special-case them.
        if e == 1:
            return self
        if e == 2:
            return f"({self} * {self})"
        if e == 3:
            return f"({self} * {self} * {self})"
        if c.is_float and e == 0.5:
            return f"tl.sqrt({self})"
        if c.is_float and e == -0.5:
            return f"tl.rsqrt({self})"
        if c.is_float and e == -1:
            return f"({c.lit(1)} / {self})"
    base = c.raw["self"]
    if c.is_float and isinstance(base, (int, float)) and not isinstance(base, bool) and base > 0:
        # a constant base: one exp2 (exact for powers of two, as ALiBi's slopes are)
        return f"tl.exp2({exponent} * {c.lit(math.log2(base))})"
    self, exponent = _tensors(self, exponent)
    return f"fm.pow({self}, {exponent})" if c.is_float else f"fm.int_pow({self}, {exponent})"


def _is_literal(expr: str) -> bool:
    """Whether an operand's code is a constant (a literal), not a tensor."""
    try:
        float(expr)
        return True
    except ValueError:
        return expr.startswith(("float(", "tl.full([]", "True", "False"))


def _unary_float(fn: str) -> Callable[..., str]:
    return lambda c, self: f"{fn}({self})"


for _packet, _fn in (
    (aten.exp, "tl.exp"), (aten.exp2, "tl.exp2"), (aten.log, "tl.log"), (aten.log2, "tl.log2"),
    (aten.sqrt, "tl.sqrt"), (aten.rsqrt, "tl.rsqrt"), (aten.sin, "tl.sin"), (aten.cos, "tl.cos"),
    (aten.sigmoid, "tl.sigmoid"), (aten.erf, "tl.erf"), (aten.log1p, "fm.log1p"),
    (aten.expm1, "fm.expm1"), (aten.atan, "fm.atan"), (aten.asin, "fm.asin"), (aten.acos, "fm.acos"),
    (aten.sinh, "fm.sinh"), (aten.cosh, "fm.cosh"), (aten.asinh, "fm.asinh"), (aten.acosh, "fm.acosh"),
    (aten.atanh, "fm.atanh"), (aten.lgamma, "fm.lgamma"), (aten.digamma, "fm.digamma"), (aten.erfc, "fm.erfc"),
    (aten.erfinv, "fm.erfinv"), (aten.sinc, "fm.sinc"),
):
    rule(_packet, kind=Kind.INT_TO_FLOAT)(_unary_float(_fn))


@rule(aten.tanh, kind=Kind.INT_TO_FLOAT)
def _tanh(c, self):
    # Where eager rounds tanh to bfloat16 (2^-9 of it) and the kernel keeps it unrounded, the GPU's one-instruction
    # form is nearer the exact value than eager's: a softcapped attention evaluates it on every score.
    within = c.within_rounding and c.result == torch.bfloat16
    return f"fm.tanh_within_bfloat16({self})" if within else f"fm.tanh({self})"


# Translations whose code holds many values per element (digamma's unrolled shift and its float64 reflection):
# their kernels take fewer elements a thread (`fusepass.elementwise.kernel.choose_blocks`).
REGISTER_HUNGRY = frozenset({aten.digamma})


def _tensors(self: str, other: str) -> tuple[str, str]:
    """Two operands for a math function, which takes tensors: a literal one broadcast against the other."""
    # A select, not a sum: -0.0 + 0.0 would lose the sign atan2 and pow read.
    if _is_literal(self):
        self = f"tl.where(tl.zeros_like({other}) == 0, {self}, {other})"
    elif _is_literal(other):
        other = f"tl.where(tl.zeros_like({self}) == 0, {other}, {self})"
    return self, other


def _binary_float(fn: str) -> Callable[..., str]:
    return lambda c, self, other: f"{fn}({', '.join(_tensors(self, other))})"


for _packet, _fn in ((aten.atan2, "fm.atan2"), (aten.hypot, "fm.hypot"), (aten.logaddexp, "fm.logaddexp"),
                     (aten.logaddexp2, "fm.logaddexp2"), (aten.xlogy, "fm.xlogy"), (aten.copysign, "fm.copysign")):
    rule(_packet, operands=BINARY, kind=Kind.INT_TO_FLOAT)(_binary_float(_fn))


@rule(aten.fmax, operands=BINARY)
def _fmax(c, self, other):
    return _binary_float("fm.fmax")(c, self, other) if c.is_float else f"tl.maximum({self}, {other})"


@rule(aten.fmin, operands=BINARY)
def _fmin(c, self, other):
    return _binary_float("fm.fmin")(c, self, other) if c.is_float else f"tl.minimum({self}, {other})"


@rule(aten.deg2rad, kind=Kind.INT_TO_FLOAT)
def _deg2rad(c, self):
    return f"({self} * {c.lit(math.pi / 180)})"


@rule(aten.rad2deg, kind=Kind.INT_TO_FLOAT)
def _rad2deg(c, self):
    return f"({self} * {c.lit(180 / math.pi)})"


@rule(aten.frac)
def _frac(c, self):
    return f"({self} - fm.trunc({self}))"


@rule(aten.log10, kind=Kind.INT_TO_FLOAT)
def _log10(c, self):
    return f"(tl.log2({self}) * {c.lit(0.30102999566398120)})"


@rule(aten.tan, kind=Kind.INT_TO_FLOAT)
def _tan(c, self):
    return f"(tl.sin({self}) / tl.cos({self}))"


@rule(aten.abs, kind=Kind.COMPLEX_TO_FLOAT)
def _abs(c, self):
    return f"tl.abs({self})" if c.compute != torch.bool else self


@rule(aten.sign, aten.sgn)  # sgn is sign on real numbers (abs's gradient takes it)
def _sign(c, self):
    return f"fm.sign({self})" if c.compute != torch.bool else self


def _rounding(fn: str) -> Callable[..., str]:
    return lambda c, self: f"{fn}({self})" if c.is_float else self


rule(aten.floor)(_rounding("tl.floor"))
rule(aten.ceil)(_rounding("tl.ceil"))
rule(aten.trunc)(_rounding("fm.trunc"))


@rule(aten.round)
def _round(c, self, decimals=0):
    if not c.is_float:
        return self
    if decimals == 0:
        return f"fm.round_half_even({self})"
    # As eager's CUDA kernel: the power of ten and the scaled value in the input's own dtype (a half input's
    # 10^5 is inf there, and 2.205 · 100 is 220.5, which rounds to 220), the final quotient or product in float;
    # its divisions rounded to nearest.
    scale = c.lit(torch.tensor(10.0 ** abs(decimals), dtype=c.result).item())
    if decimals > 0:
        return f"fm.div_rn(fm.round_half_even({round_to(f'({self} * {scale})', c.result)}), {scale})"
    return f"(fm.round_half_even({round_to(f'fm.div_rn({self}, {scale})', c.result)}) * {scale})"


@rule(aten.polygamma, kind=Kind.INT_TO_FLOAT, declines=lambda a: None if a["n"] == 1 else f"order {a['n']} (only 1)")
def _polygamma(c, n, self):
    return f"fm.trigamma({self})"




@rule(aten.clamp, operands=("self", "min", "max"))
def _clamp(c, self, min=None, max=None):
    return clamp_expr(c, self, min, max)


@rule(aten.clamp_min, operands=("self", "min"))
def _clamp_min(c, self, min):
    return clamp_expr(c, self, min, None)


@rule(aten.clamp_max, operands=("self", "max"))
def _clamp_max(c, self, max):
    return clamp_expr(c, self, None, max)


@rule(aten.hardtanh)
def _hardtanh(c, self, min_val=-1, max_val=1):
    return clamp_expr(c, self, c.lit(min_val), c.lit(max_val))


def _elementwise_only(args: dict[str, Any]) -> str | None:
    """min and max of two tensors (``min.other``) are minimum and maximum; their other overloads reduce."""
    return None if "other" in args else "a reduction"


@rule(aten.minimum, operands=BINARY)
@rule(aten.min, operands=BINARY, declines=_elementwise_only)
def _minimum(c, self, other):
    if c.is_float:
        return f"tl.minimum({self}, {other}, propagate_nan=tl.PropagateNan.ALL)"
    return f"tl.minimum({self}, {other})"


@rule(aten.maximum, operands=BINARY)
@rule(aten.max, operands=BINARY, declines=_elementwise_only)
def _maximum(c, self, other):
    if c.is_float:
        return f"tl.maximum({self}, {other}, propagate_nan=tl.PropagateNan.ALL)"
    return f"tl.maximum({self}, {other})"


@rule(aten.where, operands=("self", "other"), kind=Kind.NO_OPMATH)
def _where(c, condition, self, other):
    return f"tl.where({condition}, {self}, {other})"


@rule(aten.masked_fill, operands=("self", "value"), kind=None)  # the value is cast to self's dtype
def _masked_fill(c, self, mask, value):
    return f"tl.where({mask}, {value}, {self})"


def _infix(op: str) -> Callable[..., str]:
    return lambda c, self, other: f"({self} {op} {other})"


for _packet, _op in ((aten.eq, "=="), (aten.ne, "!="), (aten.lt, "<"), (aten.le, "<="), (aten.gt, ">"),
                     (aten.ge, ">=")):
    rule(_packet, operands=BINARY, kind=Kind.ALWAYS_BOOL)(_infix(_op))


def _as_bool(c, x: str) -> str:
    return x if c.compute == torch.bool else f"({x} != 0)"


@rule(aten.logical_and, operands=BINARY, kind=Kind.ALWAYS_BOOL)
def _logical_and(c, self, other):
    return f"({_as_bool(c, self)} & {_as_bool(c, other)})"


@rule(aten.logical_or, operands=BINARY, kind=Kind.ALWAYS_BOOL)
def _logical_or(c, self, other):
    return f"({_as_bool(c, self)} | {_as_bool(c, other)})"


@rule(aten.logical_xor, operands=BINARY, kind=Kind.ALWAYS_BOOL)
def _logical_xor(c, self, other):
    return f"({_as_bool(c, self)} ^ {_as_bool(c, other)})"


@rule(aten.logical_not, kind=Kind.ALWAYS_BOOL)
def _logical_not(c, self):
    return f"(~{_as_bool(c, self)})" if c.compute == torch.bool else f"({self} == 0)"


# The operator spellings (__and__, ...) reach graphs traced before autograd.
for _packets, _op in (((aten.bitwise_and, aten.__and__), "&"), ((aten.bitwise_or, aten.__or__), "|"),
                      ((aten.bitwise_xor, aten.__xor__), "^"), ((aten.bitwise_left_shift, aten.__lshift__), "<<"),
                      ((aten.bitwise_right_shift, aten.__rshift__), ">>")):
    rule(*_packets, operands=BINARY)(_infix(_op))


@rule(aten.bitwise_not)
def _bitwise_not(c, self):
    return f"(~{self})"


@rule(aten.isnan, kind=Kind.ALWAYS_BOOL)
def _isnan(c, self):
    return f"({self} != {self})"


@rule(aten.isinf, kind=Kind.ALWAYS_BOOL)
def _isinf(c, self):
    return f"(tl.abs({self}) == float(\"inf\"))" if c.is_float else f"({self} != {self})"


@rule(aten.isfinite, kind=Kind.ALWAYS_BOOL)
def _isfinite(c, self):
    return f"(tl.abs({self}) < float(\"inf\"))" if c.is_float else f"({self} == {self})"


@rule(aten.nan_to_num)
def _nan_to_num(c, self, nan=None, posinf=None, neginf=None):
    if not c.is_float:
        return self
    info = torch.finfo(c.result)
    nan = c.lit(0.0 if nan is None else nan)
    posinf = c.lit(info.max if posinf is None else posinf)
    neginf = c.lit(info.min if neginf is None else neginf)
    return (f"tl.where({self} != {self}, {nan}, tl.where({self} == float(\"inf\"), {posinf}, "
            f"tl.where({self} == float(\"-inf\"), {neginf}, {self})))")


@rule(aten.addcmul, operands=("self", "tensor1", "tensor2"))
def _addcmul(c, self, tensor1, tensor2, value=1):
    return f"({self} + {c.lit(value)} * {tensor1} * {tensor2})"


@rule(aten.addcdiv, operands=("self", "tensor1", "tensor2"))
def _addcdiv(c, self, tensor1, tensor2, value=1):
    return f"({self} + {c.lit(value)} * ({tensor1} / {tensor2}))"


@rule(aten.lerp, operands=("self", "end", "weight"))
def _lerp(c, self, end, weight):
    return f"({self} + {weight} * ({end} - {self}))"
