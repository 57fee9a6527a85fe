"""An ATen pointwise op translated: its arguments bound, PyTorch's type promotion deciding the computation and result
dtypes (``torch._prims_common.elementwise_dtypes``), its rule in the table (`rules.RULES`) given operands
converted to the computation dtype, the result rounded where eager would have materialized it. Casts, copies and
constants take their dtype from the graph."""
from __future__ import annotations

from typing import Any

import torch
from torch._prims_common import elementwise_dtypes

from fusepass.codegen.operands import TRITON_DTYPE, Operand, convert, held_dtype, literal, round_to
from fusepass.codegen import activations, pointwise  # noqa: F401  (their rules fill the table)
from fusepass.codegen.rules import RULES, Ctx

aten = torch.ops.aten
prims = torch.ops.prims


# ----------------------------------------------------------------------------------------------------
# Casts, copies and constants: the result dtype comes from the graph, not from promotion.

# Arithmetic whose result moves continuously with its operands (a division without a rounding mode).
CONTINUOUS_ARITHMETIC = {aten.add, aten.sub, aten.rsub, aten.mul, aten.div}

CASTS = {aten._to_copy, aten.to, prims.convert_element_type, aten.clone, aten.alias, aten.copy,
         aten.lift_fresh_copy, aten.detach, aten.type_as}
# (from, to) of casts whose result holds exactly the values of their input, in a wider float (bf16 or fp16 read as
# fp32).
EXACT_WIDENING = {(torch.bfloat16, torch.float32), (torch.float16, torch.float32)}


def exact_widening(node: Any) -> bool:
    """Whether the fx node `node` is ``x.to(dtype)`` (``.float()``) of a tensor `x`, an exact widening
    (`EXACT_WIDENING`) that keeps its strides: reading ``x`` itself then reads the same values."""
    if node.op != "call_function" or packet_of(node.target) not in (aten.to, aten._to_copy) or not node.args or \
            not hasattr(node.args[0], "meta"):
        return False
    extra = {k: v for k, v in node.kwargs.items() if k != "dtype" and v not in (None, torch.preserve_format)}
    return not extra and len(node.args) <= 2 and \
        (node.args[0].meta["val"].dtype, node.meta["val"].dtype) in EXACT_WIDENING
CONSTANTS = {aten.full, aten.scalar_tensor, aten.zeros, aten.ones, aten.zeros_like, aten.ones_like,
             aten.full_like, aten.new_ones, aten.new_zeros, aten.new_full}


def cast(value: Operand | bool | int | float, dtype: torch.dtype) -> Operand:
    """An explicit cast: the value eager held (rounded to its dtype) converted, then rounded to ``dtype``."""
    if not isinstance(value, Operand) or value.dtype == dtype:
        return Operand(convert(value, dtype), dtype, rounded=isinstance(value, Operand) and value.rounded)
    source = value if value.rounded else Operand(round_to(value.expr, value.dtype), value.dtype)
    return Operand(round_to(convert(source, dtype), dtype), dtype, rounded=True)


def constant_value(packet: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if packet in (aten.zeros, aten.zeros_like, aten.new_zeros):
        return 0
    if packet in (aten.ones, aten.ones_like, aten.new_ones):
        return 1
    if packet == aten.scalar_tensor:
        return args[0]
    if packet == aten.new_full:
        return args[2]  # new_full(self, size, value)
    return args[1]  # full(size, value), full_like(self, value)


# ----------------------------------------------------------------------------------------------------


def packet_of(target: Any) -> Any:
    return getattr(target, "overloadpacket", target)


def translation_gap(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """Why an op of `target` with these arguments has no translation, or None where it has one."""
    packet = packet_of(target)
    if packet in CASTS or packet in CONSTANTS:
        return None
    rule_ = RULES.get(packet)
    if rule_ is None:
        return f"no Triton translation for {target}"
    reason = rule_.declines(bind(target, args, kwargs)) if rule_.declines else None
    return None if reason is None else f"no Triton translation for {target}: {reason}"


def is_supported(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return translation_gap(target, args, kwargs) is None


_PROMOTION_PROBES: dict[tuple[torch.dtype, bool], torch.Tensor] = {}


def _probe(dtype: torch.dtype, zero_dim: bool) -> torch.Tensor:
    key = (dtype, zero_dim)
    if key not in _PROMOTION_PROBES:
        _PROMOTION_PROBES[key] = torch.empty(() if zero_dim else (1,), dtype=dtype, device="meta")
    return _PROMOTION_PROBES[key]


def bind(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Arguments by schema name, defaults filled in."""
    bound: dict[str, Any] = {}
    for i, argument in enumerate(target._schema.arguments):
        if i < len(args):
            bound[argument.name] = args[i]
        elif argument.name in kwargs:
            bound[argument.name] = kwargs[argument.name]
        elif argument.has_default_value():
            bound[argument.name] = argument.default_value
    return bound


def translate(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], result_dtype: torch.dtype,
              round_halves: bool = True, continuous_uses: bool = False) -> Operand:
    """One op as an operand. Tensor arguments are ``Operand``s, the rest Python values.

    ``result_dtype`` is what eager produces (the node's fake value), the authority on the output dtype.
    ``round_halves=False`` keeps half values in float32 where only the result's precision depends on their
    rounding: across casts between float dtypes and into arithmetic with float32 values (the attention
    kernel's scores, closer to the exact function than eager's; eager's own fused attention does not round
    them either). Comparisons and other discontinuous uses still see eager's rounded values. ``continuous_uses``
    says that none does see this result, which may then be computed within the rounding eager gives it.
    """
    packet = packet_of(target)
    if packet in CASTS:
        value = args[1] if packet == aten.copy else args[0]
        if not round_halves and isinstance(value, Operand) and value.dtype.is_floating_point and \
                held_dtype(result_dtype) == torch.float32:
            return Operand(convert(value, torch.float32), result_dtype)
        return cast(value, result_dtype)
    if packet in CONSTANTS:
        return Operand(literal(constant_value(packet, args, kwargs), held_dtype(result_dtype)), result_dtype)
    rule_ = RULES[packet]
    bound = bind(target, args, kwargs)
    operand_names = [name for name in rule_.operands if bound.get(name) is not None]
    if rule_.kind is None:
        compute = result_dtype
    else:
        kind = rule_.kind(bound) if callable(rule_.kind) else rule_.kind
        probes = [_probe(v.dtype, v.zero_dim) if isinstance(v, Operand) else v
                  for v in (bound[name] for name in operand_names)]
        compute, _ = elementwise_dtypes(*probes, type_promotion_kind=kind)
    raw = {name: bound[name] for name in operand_names}
    continuous = not round_halves and packet in CONTINUOUS_ARITHMETIC and not bound.get("rounding_mode")
    for name in operand_names:
        value = bound[name]
        if isinstance(value, Operand) and value.dtype != result_dtype and not continuous and not value.rounded:
            # Where a half value meets another dtype (a comparison, a promotion), eager had already
            # rounded it: do the same, so that results that depend on it discontinuously agree.
            value = Operand(round_to(value.expr, value.dtype), value.dtype, value.zero_dim)
        bound[name] = convert(value, compute)
    for name, value in bound.items():
        if isinstance(value, Operand):  # non-promoted tensor arguments (conditions, masks)
            bound[name] = value.expr
    expr = rule_.emit(Ctx(compute, result_dtype, raw, within_rounding=not round_halves and continuous_uses), **bound)
    if result_dtype != torch.bool and held_dtype(result_dtype) != held_dtype(compute):
        expr = f"{expr}.to({TRITON_DTYPE[held_dtype(result_dtype)]})"
    if round_halves:  # each op's half result as eager materializes it: a later comparison sees eager's values
        expr = round_to(expr, result_dtype)
    return Operand(expr, result_dtype, rounded=round_halves)
