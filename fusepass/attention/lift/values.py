"""The values of the lifted score chain: what each op's result is at the kernel's coordinates (`Code`: index code
no gradient flows through; `Diff`: a node of the differentiable graph E; `GradLeaf`: a tensor element E reads for a
gradient), and what is known of them (spans, affine forms, distances, masks). The lift's result is `Lifted`."""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx

from fusepass.attention.index import Idx
from fusepass.attention.known_contents import Band
from fusepass.attention.layout import Unsupported
from fusepass.attention.spans import Span, float_rounding, narrow, result_span, truncated
from fusepass.codegen.operands import TRITON_DTYPE
from fusepass.codegen.translate import CASTS, bind
from fusepass.flash.score_mod import DistanceTable
from fusepass.fx_util import packet, val

aten = torch.ops.aten


@dataclass(frozen=True)
class Canon:
    """The attention's coordinates: batch B, heads H, query and key lengths."""

    batch: int
    heads: int
    q_len: int
    kv_len: int


@dataclass(frozen=True)
class Separable:
    """A bool that is ``rows == cols`` (``!=`` where not `equal`), `rows` an integer expression of the query
    position alone and `cols` one of the key position alone (document ids), and `others` where given: index code
    that reads no tensors (a causal mask), of uses `others_uses`. The block map classifies a tile by each side's
    least and greatest values instead of evaluating every element, joined with the others' map, cached per
    shape (blockmap.launch_separable_kinds)."""

    equal: bool
    rows: str
    cols: str
    others: str | None = None
    others_uses: frozenset[str] = frozenset()
    # The negation of a conjunction: no keep, until negated again.
    inverted: bool = False

    def negated(self) -> Separable:
        if self.others is None:
            return replace(self, equal=not self.equal)
        return replace(self, inverted=not self.inverted)

    def joined(self, others: str, uses: frozenset[str]) -> Separable | None:
        """This and `others` (index code reading no tensors)."""
        if self.inverted:
            return None
        return replace(self, others=others if self.others is None else f"({self.others}) & ({others})",
                       others_uses=self.others_uses | uses)


@dataclass(frozen=True)
class Code:
    """A value computed by index code: no gradient flows through it."""

    expr: str
    dtype: torch.dtype
    uses: frozenset[str]  # of "b", "h", "q", "k": what it varies with
    zero_dim: bool = False
    mask: tuple[str, Any] | None = None  # for where(keep, 0, fill): (keep expression, fill)
    compares: int = 0  # comparisons of query against key positions it depends on (1: causal, 2: a band)
    span: Span | None = None  # the values it can take (see spans.py); an int64 one that fits in int32 is emitted so
    # An fp32 expression of the same integer, exact: converted per position vector before they broadcast
    # (int → float of a whole tile is a quarter-rate instruction per score).
    as_float: str | None = None
    # The integer a·q + c·k + d of the query and key positions, as (a, c, d), where it is that exactly.
    affine: tuple[int, int, int] | None = None
    # A function of the distance k - q alone (and of b, h and tensors read at them): see `_tabulated`.
    relative: bool = False
    # A bool comparing an integer of the query position alone with one of the key position alone: see Separable.
    separable: Separable | None = None
    # A float that is 1 where a bool expression holds and 0 elsewhere ((expr, True)), or 0 there and 1 elsewhere
    # ((expr, False)): a bool converted, and 1 minus that (`indicator_of`).
    indicator: tuple[str, bool] | None = None

    @property
    def narrow(self) -> bool:
        """An int64 value emitted as int32 (see spans.py)."""
        return narrow(self.dtype, self.span)


@dataclass(frozen=True)
class Diff:
    """A value of the differentiable graph E."""

    node: torch.fx.Node
    uses: frozenset[str] = frozenset(("b", "h", "q", "k"))


@dataclass
class GradLeaf:
    """A tensor element E reads whose gradient the backward accumulates: aux ``index`` at ``offset``; or, with a
    ``slot``, an element of a distance table: read from ``aux[slot]``, its gradient summed per distance into
    ``aux_grad[slot]`` and then into the tensor's (see `_gathered_by_distance`)."""

    aux: int
    offset: str
    mask: str | None
    uses: frozenset[str]
    slot: str | None = None


@dataclass
class Lifted:
    """The score chain as the kernel's functions' source, and the tensors those read."""

    source: str  # the jit functions, named in ``functions`` and ``tables``
    functions: dict[str, str]  # score, score_grad, keep, fill, fill_grad → function name
    aux: list[torch.fx.Node]
    sizes: tuple[int, ...]  # run-time sizes, after the aux tensors in the kernels' aux tuple (`sizes.Sizes`)
    aux_needs_grad: list[bool]
    fill_bound: float
    keep_uses: frozenset[str]
    keep_reads_aux: bool
    # Where the keep is separable: its two sides are the functions keep_rows and keep_cols, the masks it joins
    # (`others`, where given) the function keep_others.
    separable: Separable | None
    features: list[str]
    tables: list[DistanceTable]
    linear_scale: float | None  # see ScoreMod.linear_scale
    # The buffers read as the bands they hold (`known_contents`), not loaded: the op takes them for their guards.
    bands: list[tuple[torch.fx.Node, Band]]


def tensor_of(node: torch.fx.Node) -> torch.Tensor:
    """The value a node of the chain stands for, which must be a tensor: a number Dynamo made symbolic (an int
    that changed between calls) is not planned for."""
    value = val(node)
    if not isinstance(value, torch.Tensor):
        raise Unsupported(f"the score chain reads {node.name}, a number Dynamo made symbolic because it changed "
                          "between calls (torch.compile(..., dynamic=False) keeps it a constant)")
    return value


def of_distance(value: Code) -> bool:
    """Whether an index value is a function of the distance k - q alone (one not varying with q or k is)."""
    return value.relative or not {"q", "k"} & value.uses


def affine_of(idx: Idx) -> tuple[int, int, int] | None:
    """``idx`` as (a, c, d) of a·q + c·k + d, where it is a sum of whole positions."""
    coefs = {"q": 0, "k": 0}
    for t in idx.terms:
        if t.var not in coefs or t.div != 1 or t.mod is not None:
            return None
        coefs[t.var] += t.coef
    return coefs["q"], coefs["k"], idx.const


def affine_result(target: Any, args: tuple, kwargs: dict) -> tuple[int, int, int] | None:
    """The (a, c, d) of an integer op's result whose operands are affine in the positions: sums, differences,
    negations, products with a constant and casts (the result's span fits its dtype: no wrap-around)."""
    kind = getattr(target, "overloadpacket", None)

    def affine(a: Any) -> tuple[int, int, int] | None:
        if isinstance(a, Code):
            if a.affine is None and not a.uses and a.span is not None and a.span[0] == a.span[1]:
                return 0, 0, a.span[0]  # a constant
            return a.affine
        if isinstance(a, int) and not isinstance(a, bool):
            return 0, 0, a
        return None

    if kind in CASTS:
        return affine(args[1] if kind == aten.copy else args[0])
    forms = [affine(a) for a in args]
    if None in forms or kwargs.get("alpha", 1) != 1:
        return None
    if kind == aten.neg:
        return tuple(-x for x in forms[0])
    if kind in (aten.add, aten.sub) and len(forms) == 2:
        sign = 1 if kind == aten.add else -1
        return tuple(x + sign * y for x, y in zip(*forms))
    if kind == aten.mul and len(forms) == 2:
        for (a, c, d), other in ((forms[0], forms[1]), (forms[1], forms[0])):
            if a == c == 0:
                return tuple(d * x for x in other)
    return None


def span_of(value: Any) -> Span | None:
    if isinstance(value, Code):
        return (0, 1) if value.dtype == torch.bool else value.span
    if isinstance(value, (bool, int)):
        return int(value), int(value)
    if isinstance(value, float):
        return value, value
    return None


def op_span(target: Any, args: tuple, kwargs: dict, dtype: torch.dtype) -> Span | None:
    """The span of an op's numeric result (None for bools, or where unknown); a float's widened for rounding,
    a float's conversion to an integer that of its truncated values (see spans.py)."""
    if dtype == torch.bool or not hasattr(target, "_schema"):
        return None
    kind = getattr(target, "overloadpacket", None)
    if kind in CASTS:
        source = args[1] if kind == aten.copy else args[0]
        span = span_of(source)
        if dtype.is_floating_point:
            return float_rounding(span)
        from_float = isinstance(source, float) or isinstance(source, Code) and source.dtype.is_floating_point
        return truncated(span) if from_float else span
    bound = bind(target, args, kwargs)
    span = result_span(target, {name: span_of(v) for name, v in bound.items() if v is not None})
    return float_rounding(span) if dtype.is_floating_point else span


def indicator_of(node: torch.fx.Node, args: tuple) -> tuple[str, bool] | None:
    """`Code.indicator` of ``node``'s value: a bool converted to a float, or 1 minus an indicator."""
    kind = packet(node)
    if kind in CASTS and isinstance(args[0], Code) and val(node).dtype.is_floating_point:
        x = args[0]
        return (x.expr, True) if x.dtype == torch.bool else x.indicator
    if kind == aten.rsub and len(args) == 2 and isinstance(args[0], Code) and args[0].indicator and args[1] == 1:
        expr, holds = args[0].indicator
        return expr, not holds
    if kind == aten.sub and len(args) == 2 and isinstance(args[1], Code) and args[1].indicator and is_one(args[0]):
        expr, holds = args[1].indicator
        return expr, not holds
    return None


def mask_of(node: torch.fx.Node, args: tuple) -> tuple[str, Any] | None:
    """``(keep, fill)`` when ``node`` is ``where(keep, 0, fill)``, ``masked_fill(zeros, ~keep, fill)`` or a
    constant times an indicator (Hugging Face's ``(1.0 - keep.to(dtype)) * torch.finfo(dtype).min``): a mask meant
    to be added to the scores."""
    kind = packet(node)
    if kind == aten.mul and len(args) == 2:
        for x, c in (args, args[::-1]):
            if isinstance(x, Code) and x.indicator and isinstance(c, (int, float)) and not isinstance(c, bool):
                expr, holds = x.indicator
                fill = torch.tensor(c, dtype=val(node).dtype).item()  # as eager stores it
                return (f"~({expr})", fill) if holds else (expr, fill)
        return None
    if kind == aten.where and isinstance(args[0], Code):
        a, b = args[1], args[2]
        if is_zero(a) and isinstance(b, (int, float)):
            return args[0].expr, b
        if is_zero(b) and isinstance(a, (int, float)):
            return f"~{args[0].expr}", a
    if kind == aten.masked_fill and isinstance(args[1], Code) and is_zero(args[0]) and \
            isinstance(args[2], (int, float)):
        return f"~{args[1].expr}", args[2]
    return None


def converted(expr: str, uses: frozenset[str], dtype: torch.dtype) -> str:
    """An index expression as a tensor of `dtype`. One that uses no index (a position along a dim of length 1, the
    constant 0) is made one (``tl.full``): Python's arithmetic on literals is not Triton's."""
    triton_dtype = TRITON_DTYPE[dtype]
    return f"({expr}).to({triton_dtype})" if uses else f"tl.full([], {expr}, {triton_dtype})"


def is_literal(expr: str) -> bool:
    """Whether an index expression is a Python literal (a constant's, as `literal` writes it)."""
    return re.fullmatch(r'True|False|-?\d+|-?[\d.]+(e[-+]?\d+)?|float\("-?(inf|nan)"\)', expr) is not None


def literal_value(expr: str) -> float | None:
    """The number a numeric literal (as `literal` writes it) stands for; None for another expression or a bool."""
    if not is_literal(expr) or expr in ("True", "False"):
        return None
    inner = re.fullmatch(r'float\("(.*)"\)', expr)
    return float(inner.group(1) if inner else expr)


def is_one(a: Any) -> bool:
    return isinstance(a, (int, float)) and not isinstance(a, bool) and a == 1


def is_zero(a: Any) -> bool:
    if isinstance(a, (int, float)):
        return a == 0
    return isinstance(a, Code) and a.expr in ("0", "0.0", "False")
