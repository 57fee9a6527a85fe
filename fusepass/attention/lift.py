"""Lift the score chain — every op between ``q @ kᵀ`` and the softmax — into the kernel's score functions.

Each value the chain reads is evaluated at the coordinates the kernel is at: the flat batch-head index
``f = b·H + h``, the query position ``q`` and the key position ``k`` (``index.Idx``). What that value is
decides how the kernel gets it:

- derived from ``arange``, constants and shapes (causal, window, ALiBi distances, T5 buckets): emitted as
  index arithmetic, no tensor at all;
- a tensor (a padding mask, ALiBi slopes, a bias table, a dense bias): loaded at its strides, gathered
  when the index is computed (``embedding``), broadcast dims costing nothing;
- the scores and what depends on them, or on a tensor that needs a gradient: a small FX graph ``E`` of
  pointwise ops over those loaded and index values (its "leaves").

Pointwise ops go through the one translator, in both places. ``E``'s derivative comes from torch's own
autograd (``make_fx`` of its vjp), so the backward score functions need no second table of derivatives.
A mask at the top of the chain (``masked_fill``, ``where``, or adding ``where(keep, 0, fill)``) is split
off as ``keep`` so the kernel can skip empty tiles and skip mask arithmetic on full ones.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from fusepass.attention.index import Idx, merge
from fusepass.attention.layout import VIEW_OPS, Unsupported
from fusepass.attention.match import AttentionMatch
from fusepass.attention.spans import Span, float_exact, float_rounding, narrow, result_span, truncated
from fusepass.codegen.pointwise import (CASTS, CONSTANTS, TRITON_DTYPE, Emitter, Operand, bind, constant_value,
                                        float32_reciprocal, held_dtype, is_supported, literal, translate)
from fusepass.flash.score_mod import DistanceTable
from fusepass.fx_util import packet, val

aten = torch.ops.aten
LANES = 4  # the fake length of E's values: pointwise ops do not care
# Broadcasts a value to the scores' shape: -0.0, not 0.0, so that the addition is an identity the compiler
# removes (x + 0.0 is not: -0.0 + 0.0 = +0.0), instead of one more instruction per score.
SPLAT_OF_S = "tl.full(s.shape, -0.0, tl.float32)"
# Integer ops whose fp32 form (Code.as_float) is exact when every value is.
FLOAT_FORM_OPS = {aten.add, aten.sub, aten.neg, aten.abs, *CASTS}
# Casts whose first argument is the value cast.
VALUE_CASTS = CASTS - {aten.copy}
# A value of the distance k - q alone whose code is longer than this many statements is read from a table of
# its values per distance instead (one statement: the distance, an offset and a load, a coalesced read of a
# few hundred bytes per tile). T5's log-bucketed bias takes ~20 statements per score, ALiBi's slope × distance 4.
TABULATE_ABOVE = 8
# Where a distance table's slot in the aux tuple goes: known once every tensor the chain reads is.
TABLE_SLOT = "@table{}@"
TABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # held as fp32: the table stores them exactly


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


class Lifter:
    def __init__(self, m: AttentionMatch, canon: Canon, name: str) -> None:
        self.m = m
        self.canon = canon
        self.name = name
        self.code = Emitter(prefix="i")
        self.graph = torch.fx.Graph()
        self.fake = FakeTensorMode()
        self.leaves: dict[torch.fx.Node, Code | GradLeaf | None] = {}  # E placeholder → what binds it
        self.leaf_of_expr: dict[str, torch.fx.Node] = {}
        self.aux: list[torch.fx.Node] = []
        self.memo: dict[tuple[torch.fx.Node, tuple[Idx, ...]], Code | Diff] = {}
        self.chain = set(m.chain)
        self.features: set[str] = set()
        # The aux tensors read at key positions alone, and those read at query positions: a tensor read on the key
        # side only is a padding mask (document ids are read on both sides).
        self.key_side_reads: set[int] = set()
        self.query_side_reads: set[int] = set()
        self.mask_compares = 0  # the most query-against-key comparisons a mask condition depends on
        self.aux_loads_in_code: set[int] = set()
        self.tables: list[DistanceTable] = []
        self.table_sources: list[str] = []
        self.s_leaf = self._placeholder("s", val(m.qk).dtype, False)
        self.leaves[self.s_leaf] = None

    # ---------------------------------------------------------------------------------- coordinates

    def render(self, idx: Idx) -> tuple[str, frozenset[str]]:
        """Code for an index and what it uses; the common batch/head splits render as ``b`` and ``h``."""
        H, B = self.canon.heads, self.canon.batch
        parts, uses = [], set()
        for t in idx.terms:
            if t.var == "f":
                if t.div == H and (t.mod is None or t.mod == B):
                    parts.append(_coef("b", t.coef))
                    uses.add("b")
                    continue
                if t.div == 1 and t.mod == H:
                    parts.append(_coef("h", t.coef))
                    uses.add("h")
                    continue
                uses.update(("b", "h"))
            elif t.var in ("q", "k"):
                uses.add(t.var)
                size = self.canon.q_len if t.var == "q" else self.canon.kv_len
                if t.div == 1 and (t.mod is None or t.mod >= size):
                    parts.append(_coef("q_idx" if t.var == "q" else "kv_idx", t.coef))
                    continue
            else:
                uses.update(("b", "h", "q", "k"))
            parts.append(Idx((t,)).render({"f": f"(b * {H} + h)", "q": "q_idx", "k": "kv_idx"}))
        if idx.const or not parts:
            parts.append(str(idx.const))
        text = parts[0] if len(parts) == 1 else "(" + " + ".join(parts) + ")"
        return text, frozenset(uses)

    def root_coords(self, node: torch.fx.Node) -> tuple[Idx, ...]:
        shape = tuple(val(node).shape)
        return Idx.var("f").split(shape[:-2]) + (Idx.var("q"), Idx.var("k"))

    def _bounds(self, uses: frozenset[str]) -> str | None:
        terms = []
        if "q" in uses:
            terms.append(f"(q_idx < {self.canon.q_len})")
        if "k" in uses:
            terms.append(f"(kv_idx < {self.canon.kv_len})")
        return " & ".join(terms) if terms else None

    # ---------------------------------------------------------------------------------- E, the graph

    def _placeholder(self, name: str, dtype: torch.dtype, zero_dim: bool) -> torch.fx.Node:
        node = self.graph.placeholder(f"{name}{len(self.leaves)}")
        with self.fake:
            node.meta["val"] = torch.empty(() if zero_dim else (LANES,), dtype=dtype)
        return node

    def _leaf(self, code: Code) -> torch.fx.Node:
        if code.expr not in self.leaf_of_expr:
            node = self._placeholder("v", code.dtype, code.zero_dim)
            self.leaves[node] = self._tabulated(code) or code
            self.leaf_of_expr[code.expr] = node
        return self.leaf_of_expr[code.expr]

    def _tabulated(self, code: Code) -> Code | None:
        """A value of the distance k - q alone that enters E, read from a table of its values per distance
        where its own code is longer (T5's bucket: a log, conversions and a gather per score): the table
        holds the very values that code computes, evaluated once per distance."""
        if not (code.relative and {"q", "k"} <= code.uses and code.dtype in TABLE_DTYPES and code.mask is None):
            return None
        if len(self._closure(code.expr)) <= TABULATE_ABOVE:
            return None
        table = self._distance_table(code.expr, code.uses)
        if table is None:
            return None
        slot, offset = table
        return Code(self.code.let(_load_text(slot, offset, None)), code.dtype, code.uses, span=code.span)

    def _distance_table(self, value: str, uses: frozenset[str], grad_of: tuple[int, str] | None = None
                        ) -> tuple[str, str] | None:
        """A table of the index expression `value` (a function of the distance alone) per distance: its slot in
        the aux tuple and the offset that reads it at a tile's positions; None where it would pass 2^31
        entries. `grad_of`: (aux index, offset) of the tensor element `value` loads, where its gradient is
        summed per distance and then added there."""
        c = self.canon
        batch, heads = (c.batch if "b" in uses else 1), (c.heads if "h" in uses else 1)
        distances = c.q_len + c.kv_len - 1
        if batch * heads * distances >= 2 ** 31:
            return None
        t = len(self.tables)
        # Evaluated at a valid (q, k) pair of each distance: what the code reads tensors at.
        at_distance = ["q_idx = tl.maximum(-r, 0)", "kv_idx = tl.maximum(r, 0)"]
        table = DistanceTable(f"{self.name}_distance{t}", batch, heads, c.q_len, c.kv_len)
        self.table_sources.append(_function(table.function, "r, b, h, aux", at_distance + self._closure(value),
                                            f"return ({value}).to(tl.float32)"))
        if grad_of is not None:
            table = replace(table, grad_of=grad_of[0], offset_function=f"{table.function}_offset")
            self.table_sources.append(_function(table.offset_function, "r, b, h, aux",
                                                at_distance + self._closure(grad_of[1]), f"return {grad_of[1]}"))
        self.tables.append(table)
        self.features.add("distance_table")
        # The terms along the key axis first: they add per position vector, then one subtraction per score.
        start = [f"{c.q_len - 1}"] + [f"h * {distances}"] * (heads > 1) + [f"b * {heads * distances}"] * (batch > 1)
        return TABLE_SLOT.format(t), f"((kv_idx + ({' + '.join(start)})) - q_idx)"

    def _e_node(self, target: Any, args: tuple, kwargs: dict, uses: frozenset[str] | None = None) -> Diff:
        def as_e(a: Any) -> Any:
            if isinstance(a, Diff):
                return a.node
            if isinstance(a, Code):
                return self._leaf(a)
            if isinstance(a, (list, tuple)):
                return type(a)(as_e(x) for x in a)
            return a

        def as_float(a: Any) -> Any:
            if isinstance(a, Code) and a.as_float is not None:
                return Code(a.as_float, torch.float32, a.uses, a.zero_dim)
            if isinstance(a, (list, tuple)):
                return type(a)(as_float(x) for x in a)
            return a

        def fake(e_args: Any) -> Any:
            return torch.fx.node.map_arg(e_args, lambda n: n.meta["val"])

        def fake_value(a: Any) -> Any:  # without making leaves of index values
            if isinstance(a, Diff):
                return a.node.meta["val"]
            if isinstance(a, Code):
                return torch.empty(() if a.zero_dim else (LANES,), dtype=a.dtype)
            if isinstance(a, (list, tuple)):
                return type(a)(fake_value(x) for x in a)
            return a

        with self.fake:
            result = target(*fake_value(args), **{k: fake_value(v) for k, v in kwargs.items()})
        if result.dtype == torch.float32:
            # An integer promoted to fp32 by the op: its exact fp32 form (converted per position vector, not
            # per score) stands for it.
            args, kwargs = as_float(args), {k: as_float(v) for k, v in kwargs.items()}
        e_args, e_kwargs = as_e(args), {k: as_e(v) for k, v in kwargs.items()}
        node = self.graph.call_function(target, e_args, e_kwargs)
        with self.fake:
            node.meta["val"] = target(*fake(e_args), **fake(e_kwargs))
        if uses is None:
            uses = frozenset().union(*[a.uses for a in list(args) + list(kwargs.values())
                                       if isinstance(a, (Code, Diff))])
        return Diff(node, uses)

    # ---------------------------------------------------------------------------------- evaluation

    def value(self, node: Any, coords: tuple[Idx, ...]) -> Any:
        if not isinstance(node, torch.fx.Node):
            return node
        key = (node, coords)
        if key not in self.memo:
            self.memo[key] = self._evaluate(node, coords)
        return self.memo[key]

    def _evaluate(self, node: torch.fx.Node, coords: tuple[Idx, ...]) -> Code | Diff:
        kind = packet(node)
        if node is self.m.qk:
            return self._scores(coords)
        if kind in VIEW_OPS:
            return self.value(node.args[0], _view_coords(node, coords))
        if node.op == "call_function" and kind in CONSTANTS:
            value = constant_value(kind, node.args, node.kwargs)
            return Code(literal(value, held_dtype(val(node).dtype)), val(node).dtype, frozenset(),
                        val(node).dim() == 0, span=_span_of(value))
        if kind == aten.arange:
            return self._arange(node, coords)
        if kind in (aten.tril, aten.triu):
            return self._triangle(node, coords)
        if kind in (aten.embedding, aten.index):
            return self._gather(node, coords)
        if node.op == "call_function" and is_supported(node.target, node.args, node.kwargs):
            return self._pointwise(node, coords)
        if node in self.chain:
            raise Unsupported(f"the score chain has {node.target}")
        return self._load(node, coords)

    def _scores(self, coords: tuple[Idx, ...]) -> Diff:
        batch = tuple(val(self.m.qk).shape[:-2])
        c = self.canon
        if not (merge(coords[:-2], batch).is_var("f", c.batch * c.heads) and coords[-2].is_var("q", c.q_len)
                and coords[-1].is_var("k", c.kv_len)):
            raise Unsupported("the scores are read at other coordinates than they are computed at")
        s = Diff(self.s_leaf, frozenset(("b", "h", "q", "k")))
        ops = self.m.scores
        if ops.bias is None:
            return s
        if ops.alpha != 1:
            s = self._e_node(aten.mul.Tensor, (s, ops.alpha), {})
        bias = self.value(ops.bias, _broadcast(coords, tuple(val(self.m.qk).shape), tuple(_tensor(ops.bias).shape)))
        if ops.beta != 1:
            bias = self._pointwise_value(aten.mul.Tensor, (bias, ops.beta), {}, val(self.m.qk).dtype)
        return self._e_node(aten.add.Tensor, (s, bias), {})

    def _arange(self, node: torch.fx.Node, coords: tuple[Idx, ...]) -> Code:
        args = list(node.args)
        start, step = (0, 1) if len(args) == 1 else (args[0], args[2] if len(args) > 2 else 1)
        text, uses = self.render(coords[0])
        dtype = val(node).dtype
        expr = f"({start} + {step} * {text})" if (start, step) != (0, 1) else text
        span = None
        if not dtype.is_floating_point and all(isinstance(x, int) for x in (start, step)):
            ends = (start, start + step * (val(node).shape[0] - 1))
            span = (min(ends), max(ends))
        target = torch.int32 if narrow(dtype, span) else held_dtype(dtype)
        as_float = _converted(expr, uses, torch.float32) if float_exact(span) else None
        affine = None
        position = _affine_of(coords[0])
        if position is not None and span is not None:
            affine = (step * position[0], step * position[1], start + step * position[2])
        return Code(self.code.let(_converted(expr, uses, target)), dtype, uses, span=span, as_float=as_float,
                    affine=affine)

    def _triangle(self, node: torch.fx.Node, coords: tuple[Idx, ...]) -> Code:
        x = self.value(node.args[0], coords)
        if not isinstance(x, Code):
            raise Unsupported("tril/triu of the scores")
        diagonal = node.args[1] if len(node.args) > 1 else node.kwargs.get("diagonal", 0)
        row, row_uses = self.render(coords[-2])
        col, col_uses = self.render(coords[-1])
        op = "<=" if packet(node) == aten.tril else ">="
        keep = _converted(f"(({col}) - ({row}) {op} {diagonal})", row_uses | col_uses, torch.bool)
        zero = literal(0, held_dtype(x.dtype))
        expr = self.code.let(f"tl.where({keep}, {x.expr}, {zero})")
        span = (min(x.span[0], 0), max(x.span[1], 0)) if x.span is not None else None
        return Code(expr, x.dtype, x.uses | row_uses | col_uses, compares=x.compares + 1, span=span)

    def _gather(self, node: torch.fx.Node, coords: tuple[Idx, ...]) -> Code | Diff:
        """``table[i0, i1, ...]`` (``aten.index``, ``embedding``): index tensors evaluated at the output's
        coordinates, the other dims read at theirs, as advanced indexing places them."""
        if packet(node) == aten.embedding:
            table, indices = node.args[0], [node.args[1]]
        else:
            table, indices = node.args[0], list(node.args[1])
        present = [d for d, ix in enumerate(indices) if ix is not None]
        index_shape = tuple(torch.broadcast_shapes(*[tuple(_tensor(indices[d]).shape) for d in present]))
        table_shape = tuple(val(table).shape)
        adjacent = present == list(range(present[0], present[-1] + 1))
        start = present[0] if adjacent else 0
        index_coords = coords[start:start + len(index_shape)]
        plain = iter(coords[:start] + coords[start + len(index_shape):])
        parts, uses = [], set()
        wide = _needs_int64_offsets(val(table))
        relative = True  # every index a value of the distance alone, no other dim read at q or k
        for d, (size, stride) in enumerate(zip(table_shape, val(table).stride())):
            if d in present:
                i = self.value(indices[d], _broadcast(index_coords, index_shape, tuple(val(indices[d]).shape)))
                if not isinstance(i, Code):
                    raise Unsupported("a gather whose indices depend on the scores")
                wrapped = self.code.let(f"tl.where({i.expr} < 0, {i.expr} + {size}, {i.expr})")
                parts.append(_offset_term(wrapped, stride, wide))
                uses |= i.uses
                relative &= _of_distance(i)
            else:
                text, u = self.render(next(plain))
                parts.append(_offset_term(text, stride, wide))
                uses |= u
                relative &= not {"q", "k"} & u
        if table.meta.get("requires_grad", False) or "q" in uses and "k" in uses:
            self.features.add("relative_bias")
        return self._read(table, " + ".join(parts), frozenset(uses), gathered=True, relative=relative)

    def _load(self, node: torch.fx.Node, coords: tuple[Idx, ...]) -> Code | Diff:
        tensor = _tensor(node)
        if not all(isinstance(s, int) for s in tensor.stride()):
            raise Unsupported("a score input with symbolic strides")
        coords = _broadcast(coords, tuple(tensor.shape), tuple(tensor.shape))
        parts, uses = [], set()
        wide = _needs_int64_offsets(tensor)
        for c, stride, size in zip(coords, tensor.stride(), tensor.shape):
            if size == 1:
                continue
            text, u = self.render(c)
            parts.append(_offset_term(text, stride, wide))
            uses |= u
        return self._read(node, " + ".join(parts) if parts else "0", frozenset(uses))

    def _read(self, tensor: torch.fx.Node, offset: str, uses: frozenset[str], gathered: bool = False,
              relative: bool = False) -> Code | Diff:
        t = val(tensor)
        if t.device != val(self.m.qk).device:
            raise Unsupported(f"a score input on {t.device}, the scores on {val(self.m.qk).device}")
        index = self._aux_index(tensor)
        mask = self._bounds(uses)
        if not gathered:
            self._note_read(t, uses, index)
        if tensor.meta.get("requires_grad", False):
            leaf = self._placeholder("g", t.dtype, t.dim() == 0)
            self.leaves[leaf] = self._gathered_by_distance(index, offset, mask, uses, relative, t.dtype) or \
                GradLeaf(index, offset, mask, uses)
            return Diff(leaf, uses)
        self.aux_loads_in_code.add(index)
        load = _load_text(index, offset, mask)
        if held_dtype(t.dtype) != t.dtype:
            load += f".to({TRITON_DTYPE[held_dtype(t.dtype)]})"
        return Code(self.code.let(load), t.dtype, uses, t.dim() == 0, relative=relative)

    def _gathered_by_distance(self, index: int, offset: str, mask: str | None, uses: frozenset[str], relative: bool,
                              dtype: torch.dtype) -> GradLeaf | None:
        """An element of a table a gradient flows to, gathered at a function of the distance alone (a learnable
        relative-position bias), read from a table of its values per distance. Its gradient is summed per
        distance there, then added to the table's entries once per distance: per score, the atomic adds spread
        over Nq + Nk - 1 entries per head instead of contending for the few entries of the table."""
        if not (relative and {"q", "k"} <= uses and dtype in TABLE_DTYPES):
            return None
        table = self._distance_table(_load_text(index, offset, mask), uses, grad_of=(index, offset))
        if table is None:
            return None
        slot, table_offset = table
        return GradLeaf(index, table_offset, None, uses, slot=slot)

    def _aux_index(self, tensor: torch.fx.Node) -> int:
        if tensor not in self.aux:
            self.aux.append(tensor)
        return self.aux.index(tensor)

    def _pointwise(self, node: torch.fx.Node, coords: tuple[Idx, ...]) -> Code | Diff:
        shape = tuple(val(node).shape)

        def arg_value(a: Any) -> Any:
            if isinstance(a, torch.fx.Node):
                return self.value(a, _broadcast(coords, shape, tuple(_tensor(a).shape)))
            if isinstance(a, (list, tuple)):
                return type(a)(arg_value(x) for x in a)
            return a

        args = tuple(arg_value(a) for a in node.args)
        kwargs = {k: arg_value(v) for k, v in node.kwargs.items()}
        result = self._pointwise_value(node.target, args, kwargs, val(node).dtype, val(node).dim() == 0)
        if isinstance(result, Code) and packet(node) in (aten.where, aten.masked_fill):
            result = replace(result, mask=_mask_of(node, args), as_float=None, affine=None)
        return result

    def _pointwise_value(self, target: Any, args: tuple, kwargs: dict, dtype: torch.dtype,
                         zero_dim: bool = False) -> Code | Diff:
        flat = list(args) + list(kwargs.values())
        if any(isinstance(a, Diff) for a in flat):
            self._note_op(target, args)
            return self._e_node(target, args, kwargs)

        span = _result_span(target, args, kwargs, dtype)
        narrow_result = narrow(dtype, span)

        codes = [a for a in flat if isinstance(a, Code)]
        # Literals alone would compute in Python (constexpr) arithmetic, whose ~True is -2: the first is made a
        # tensor, so that the op is Triton's.
        literal_only = bool(codes) and all(_is_literal(a.expr) for a in codes)

        def operand(a: Any) -> Any:
            nonlocal literal_only
            if isinstance(a, Code) and literal_only:
                literal_only = False
                target_dtype = torch.int32 if a.narrow else held_dtype(a.dtype)
                return Operand(f"tl.full([], {a.expr}, {TRITON_DTYPE[target_dtype]})",
                               torch.int32 if a.narrow else a.dtype, a.zero_dim)
            if isinstance(a, Code):
                if a.as_float is not None and dtype == torch.float32:
                    return Operand(a.as_float, torch.float32, a.zero_dim)
                if a.narrow and dtype == torch.int64 and not narrow_result:
                    # The result may leave int32: the operation runs in int64.
                    return Operand(f"({a.expr}).to(tl.int64)", a.dtype, a.zero_dim)
                return Operand(a.expr, torch.int32 if a.narrow else a.dtype, a.zero_dim)
            if isinstance(a, (list, tuple)):
                return type(a)(operand(x) for x in a)
            return a

        uses = frozenset().union(*[a.uses for a in codes])
        compares = sum(a.compares for a in codes)
        if getattr(target, "overloadpacket", None) in (aten.lt, aten.le, aten.gt, aten.ge) and {"q", "k"} <= uses:
            compares += 1
        self._note_op(target, args)
        result = translate(target, operand(args), {k: operand(v) for k, v in kwargs.items()},
                           torch.int32 if narrow_result else dtype, round_halves=False)
        # Integers only have an fp32 form (a float result is its own).
        as_float = None if dtype.is_floating_point else self._float_form(target, args, kwargs, span)
        affine = None if dtype.is_floating_point or span is None else _affine_result(target, args, kwargs)
        nested = any(isinstance(a, (list, tuple)) for a in flat)  # operands in lists: not looked into
        relative = not nested and all(_of_distance(a) for a in codes) or \
            affine is not None and affine[0] == -affine[1] != 0
        return Code(self.code.let(result.expr), dtype, uses, zero_dim, compares=compares, span=span,
                    as_float=as_float, affine=affine, relative=relative, separable=self._separable(target, args))

    def _separable(self, target: Any, args: tuple) -> Separable | None:
        """`Code.separable` of ``target(*args)``: an equality or inequality of an integer (or bool) of the query
        position alone with one of the key position alone; its negation; its conjunction with index code that
        reads no tensors."""
        kind = getattr(target, "overloadpacket", None)
        codes = [a for a in args if isinstance(a, Code)]
        if len(codes) != len(args):
            return None
        if kind in (aten.eq, aten.ne) and len(args) == 2 and \
                not any(a.dtype.is_floating_point or a.dtype.is_complex for a in codes):
            for rows, cols in ((args[0], args[1]), (args[1], args[0])):
                if "q" in rows.uses and rows.uses <= {"b", "h", "q"} and "k" in cols.uses and \
                        cols.uses <= {"b", "h", "k"}:
                    return Separable(kind == aten.eq, rows.expr, cols.expr)
        if any(a.dtype != torch.bool for a in codes):
            return None
        if kind in (aten.logical_not, aten.bitwise_not) and len(args) == 1 and args[0].separable is not None:
            return args[0].separable.negated()
        if kind in (aten.logical_and, aten.bitwise_and, aten.__and__) and len(args) == 2:
            for one, other in ((args[0], args[1]), (args[1], args[0])):
                if one.separable is not None and other.separable is None and not self._reads_aux(other.expr):
                    return one.separable.joined(other.expr, other.uses)
        return None

    def _float_form(self, target: Any, args: tuple, kwargs: dict, span: Span | None) -> str | None:
        """The fp32 form of an integer result whose operands have one, where every value stays exact in fp32:
        sums, differences, negations and absolute values of positions (ALiBi's and relative-position
        distances) then cost a float op per score, not an int op and a conversion."""
        kind = getattr(target, "overloadpacket", None)
        if kind not in FLOAT_FORM_OPS or not float_exact(span) or kwargs.get("alpha", 1) != 1:
            return None
        if kind in CASTS:  # the value cast, not its dtype (or copy's destination)
            args = (args[1] if kind == aten.copy else args[0],)
        forms = []
        for a in args:
            if isinstance(a, Code) and a.as_float is not None:
                forms.append(a.as_float)
            elif isinstance(a, int) and not isinstance(a, bool) and float_exact((a, a)):
                forms.append(f"{float(a)!r}")
            else:
                return None
        if kind in CASTS:
            return forms[0]
        expr = {aten.add: "({0} + {1})", aten.sub: "({0} - {1})", aten.neg: "(-{0})", aten.abs: "tl.abs({0})"}[kind]
        return self.code.let(expr.format(*forms))

    # ---------------------------------------------------------------------------------- features

    def _note_op(self, target: Any, args: tuple) -> None:
        """Features the report names, read off the ops as they are lifted."""
        kind = getattr(target, "overloadpacket", None)
        values = [a for a in args if isinstance(a, (Code, Diff))]
        uses = frozenset().union(*[a.uses for a in values]) if values else frozenset()
        if kind == aten.tanh and any(isinstance(a, Diff) for a in values):
            self.features.add("softcap")
        if kind == aten.eq and {"q", "k"} <= uses and "b" in uses:
            self.features.add("document")
        if kind == aten.mul and len(values) == 2:
            a, b = values
            # a per-(batch, head) value times a position-derived one: ALiBi's slope × distance
            if any(isinstance(y, Code) and x.uses and x.uses <= {"b", "h"} and "k" in y.uses
                   for x, y in ((a, b), (b, a))):
                self.features.add("alibi")
        if kind in (aten.masked_fill, aten.where) and any(isinstance(a, Diff) for a in values):
            condition = args[1] if kind == aten.masked_fill else args[0]
            if isinstance(condition, Code):
                self.mask_compares = max(self.mask_compares, condition.compares)
        if kind == aten.add:
            for a in values:
                if isinstance(a, Code) and a.mask is not None:
                    self.mask_compares = max(self.mask_compares, a.compares)

    def _note_read(self, tensor: torch.Tensor, uses: frozenset[str], index: int) -> None:
        if uses and uses <= {"b", "k"} and "k" in uses:
            self.key_side_reads.add(index)
        elif {"q", "k"} <= uses:
            self.features.add("mask" if tensor.dtype == torch.bool else "bias")
        if "q" in uses:
            self.query_side_reads.add(index)

    # ---------------------------------------------------------------------------------- output

    def lift(self) -> Lifted:
        root = self.m.softmax.args[0]
        final = self.value(root, self.root_coords(root))
        if not isinstance(final, Diff):
            raise Unsupported("the softmax input does not depend on the scores")
        self.graph.output(final.node)
        keep, fill_value, score_graph, fill_graph = self._split_mask()
        functions: dict[str, str] = {}
        chunks = []
        chunks.append(self._score_function(f"{self.name}_score", score_graph))
        chunks.append(self._grad_function(f"{self.name}_score_grad", score_graph))
        functions["score"], functions["score_grad"] = f"{self.name}_score", f"{self.name}_score_grad"
        fill_bound = -math.inf
        keep_uses: frozenset[str] = frozenset()
        keep_reads_aux = False
        separable = None
        if keep is not None:
            keep_expr, keep_uses, keep_reads_aux, separable = keep
            chunks.append(self._index_function(f"{self.name}_keep", "b, h, q_idx, kv_idx, aux", [],
                                    f"return {keep_expr}"))
            if separable is not None:
                chunks.append(self._index_function(f"{self.name}_keep_rows", "b, h, q_idx, aux", [],
                                                   f"return {separable.rows}"))
                chunks.append(self._index_function(f"{self.name}_keep_cols", "b, h, kv_idx, aux", [],
                                                   f"return {separable.cols}"))
                functions.update(keep_rows=f"{self.name}_keep_rows", keep_cols=f"{self.name}_keep_cols")
                if separable.others is not None:
                    chunks.append(self._index_function(f"{self.name}_keep_others", "b, h, q_idx, kv_idx, aux", [],
                                                       f"return {separable.others}"))
                    functions["keep_others"] = f"{self.name}_keep_others"
            chunks.append(self._score_function(f"{self.name}_fill", fill_graph))
            functions.update(keep=f"{self.name}_keep", fill=f"{self.name}_fill")
            # A fill that no gradient flows through (a constant) has no gradient function: the kernels then add
            # no zero tile per masked tile (docs/flash-kernel-interface.md, fill_grad=None).
            fill_grad = self._grad_function(f"{self.name}_fill_grad", fill_graph, optional=True)
            if fill_grad is not None:
                chunks.append(fill_grad)
                functions["fill_grad"] = f"{self.name}_fill_grad"
            fill_bound = fill_value
        features = self._features()
        source = "\n\n".join(chunks + self.table_sources)
        for t in range(len(self.tables)):
            source = source.replace(TABLE_SLOT.format(t), str(len(self.aux) + t))
        return Lifted(source=source, functions=functions, aux=self.aux,
                      aux_needs_grad=[bool(a.meta.get("requires_grad", False)) for a in self.aux],
                      fill_bound=fill_bound,
                      keep_uses=keep_uses, keep_reads_aux=keep_reads_aux, separable=separable, features=features,
                      tables=self.tables,
                      linear_scale=self._linear_scale(score_graph))

    def _linear_scale(self, module: torch.fx.GraphModule) -> float | None:
        """c where the score graph computes s · c for a positive constant c, through casts that do not narrow
        (as emitted: a division by a constant is a product with its fp32 reciprocal)."""
        node = next(n for n in module.graph.nodes if n.op == "output").args[0]
        while isinstance(node, torch.fx.Node) and packet(node) in VALUE_CASTS and \
                node.meta["val"].dtype.is_floating_point and \
                node.meta["val"].dtype.itemsize >= node.args[0].meta["val"].dtype.itemsize:
            node = node.args[0]
        if not (isinstance(node, torch.fx.Node) and node.op == "call_function" and len(node.args) == 2 and
                held_dtype(node.meta["val"].dtype) == torch.float32):
            return None
        a, c = node.args
        if packet(node) == aten.div:
            c = float32_reciprocal(c)
        elif packet(node) == aten.mul:
            if isinstance(c, torch.fx.Node):
                c, a = a, c
        else:
            return None
        is_s = isinstance(a, torch.fx.Node) and a.op == "placeholder" and a.name == self.s_leaf.name
        return float(c) if is_s and isinstance(c, (int, float)) and not isinstance(c, bool) and 0 < c < math.inf \
            else None

    def _features(self) -> list[str]:
        features = set(self.features)
        if self.key_side_reads - self.query_side_reads:
            features.add("padding_mask")
        if self.mask_compares == 1:
            features.add("causal")
        elif self.mask_compares > 1:
            features.add("window")
        return sorted(features)

    def _split_mask(self):
        """(keep, fill bound, score graph, fill graph): the outermost masks of the chain split off."""
        node = next(n for n in self.graph.nodes if n.op == "output").args[0]
        while node.op == "call_function" and packet(node) in (aten.to, aten._to_copy) and len(node.users) == 1:
            node = node.args[0]  # casts after the masks stay in both graphs
        masks = []
        while True:
            found = self._mask_at(node)
            if found is None:
                break
            masks.append(found)
            inner = found[2]
            if len(inner.users) != 1 or inner.op != "call_function":
                break
            node = inner
        fills = {repr(m[1]) for m in masks}
        if not masks or len(fills) != 1:
            return None, None, self._module(), None
        fill = masks[0][1]
        additive = any(m[3] for m in masks)
        if isinstance(fill, float) and math.isnan(fill) or fill > -1e4:
            return None, None, self._module(), None
        if additive and not (fill == -math.inf or fill <= -1e30):
            return None, None, self._module(), None
        bound = fill if not additive or fill == -math.inf else fill / 2
        keep_expr = " & ".join(f"({m[0]})" for m in masks)
        keep_uses = frozenset().union(*[m[4] for m in masks])
        reads_aux = self._reads_aux(keep_expr)
        # One mask separable, the others (a causal mask, a window) reading no tensors: the map is the separable
        # one's kinds joined with the others' map, cached per shape.
        separable = None
        separable_masks = [m for m in masks if m[6] is not None and not m[6].inverted]
        if len(separable_masks) == 1:
            separable = separable_masks[0][6]
            for other in (m for m in masks if m is not separable_masks[0]):
                separable = None if self._reads_aux(other[0]) else separable.joined(other[0], other[4])
                if separable is None:
                    break
        inner = masks[-1][2]
        score = self._module(replace={masks[0][5]: inner})
        fill_module = self._module(replace={masks[0][5]: ("add", inner, fill) if additive else ("constant", fill)})
        return (keep_expr, keep_uses, reads_aux, separable), bound, score, fill_module

    def _reads_aux(self, expr: str) -> bool:
        """Whether the index expression `expr` loads from an aux tensor, itself or through the names it uses.
        (A KEEP that does not is evaluated once per shape: its block map is cached.)"""
        return any("aux[" in text for text in [expr, *self._closure(expr)])

    def _closure(self, expr: str) -> list[str]:
        """The statements of index code the expression `expr` reads, directly or not, in their order."""
        definitions = dict(line.split(" = ", 1) for line in self.code.lines)
        pending, seen = [expr], set()
        while pending:
            for name in re.findall(rf"\b{self.code.prefix}\d+\b", pending.pop()):
                if name in definitions and name not in seen:
                    seen.add(name)
                    pending.append(definitions[name])
        return [line for line in self.code.lines if line.split(" = ", 1)[0] in seen]

    def _mask_at(self, node: torch.fx.Node):
        """``(keep, fill, inner, additive, uses, node, separable)`` if ``node`` masks ``inner`` with a constant
        (`separable`: the keep's `Code.separable`, or None)."""
        if node.op != "call_function":
            return None
        kind = packet(node)
        if kind == aten.masked_fill and isinstance(node.args[2], (int, float)):
            condition = self.leaves.get(node.args[1])
            if isinstance(condition, Code) and isinstance(node.args[0], torch.fx.Node):
                return (f"~{condition.expr}", float(node.args[2]), node.args[0], False, condition.uses, node,
                        condition.separable and condition.separable.negated())
        if kind == aten.where:
            condition = self.leaves.get(node.args[0])
            a, b = node.args[1], node.args[2]
            if isinstance(condition, Code):
                if isinstance(a, torch.fx.Node) and isinstance(b, (int, float)):
                    return (condition.expr, float(b), a, False, condition.uses, node, condition.separable)
                if isinstance(b, torch.fx.Node) and isinstance(a, (int, float)):
                    return (f"~{condition.expr}", float(a), b, False, condition.uses, node,
                            condition.separable and condition.separable.negated())
        if kind == aten.add and len(node.args) == 2 and node.kwargs.get("alpha", 1) == 1:
            for x, y in ((node.args[0], node.args[1]), (node.args[1], node.args[0])):
                mask = self.leaves.get(y) if isinstance(y, torch.fx.Node) else None
                if isinstance(mask, Code) and mask.mask is not None and isinstance(x, torch.fx.Node):
                    keep, fill = mask.mask
                    return (keep, float(fill), x, True, mask.uses, node, None)
        return None

    def _module(self, replace: dict | None = None) -> torch.fx.GraphModule:
        """E as a module, with a node replaced by another node or by ``("constant", v)`` or
        ``("add", node, v)``."""
        graph = torch.fx.Graph()
        env: dict[torch.fx.Node, Any] = {}
        replace = replace or {}
        for node in self.graph.nodes:
            if node in replace:
                how = replace[node]
                if isinstance(how, torch.fx.Node):
                    env[node] = env[how]
                elif how[0] == "constant":
                    env[node] = graph.call_function(aten.full_like.default, (env[self.s_leaf], how[1]),
                                                    {"dtype": node.meta["val"].dtype})
                    env[node].meta["val"] = node.meta["val"]
                else:
                    env[node] = graph.call_function(aten.add.Tensor, (env[how[1]], how[2]))
                    env[node].meta["val"] = node.meta["val"]
                continue
            env[node] = graph.node_copy(node, lambda n: env[n])
        graph.eliminate_dead_code()
        module = torch.fx.GraphModule({}, graph)
        module.meta["leaves"] = [n.name for n in graph.nodes if n.op == "placeholder"]
        return module

    # ---------------------------------------------------------------------------------- code

    def _bind_leaves(self, module: torch.fx.GraphModule, lines: list[str]) -> dict[str, Operand]:
        """Operands for E's placeholders: s, index values, and tensor elements loaded for a gradient."""
        by_name = {n.name: n for n in self.graph.nodes if n.op == "placeholder"}
        env = {}
        for node in module.graph.nodes:
            if node.op != "placeholder":
                continue
            leaf = by_name.get(node.name)
            binding = self.leaves.get(leaf) if leaf is not None else None
            dtype = node.meta["val"].dtype
            zero_dim = node.meta["val"].dim() == 0
            if leaf is self.s_leaf:
                env[node.name] = Operand("s", dtype)
            elif isinstance(binding, Code):
                env[node.name] = Operand(binding.expr, binding.dtype, binding.zero_dim)
            elif isinstance(binding, GradLeaf):
                t = val(self.aux[binding.aux])
                load = _load_text(binding.slot or binding.aux, binding.offset, binding.mask)
                if binding.slot is None and held_dtype(t.dtype) != t.dtype:
                    load += f".to({TRITON_DTYPE[held_dtype(t.dtype)]})"
                lines.append(f"{node.name} = {load}")
                env[node.name] = Operand(node.name, dtype, zero_dim)
        return env

    def _index_function(self, name: str, params: str, lines: list[str], ret: str) -> str:
        """A jit function of `lines` and `ret`, after the statements of index code they read (only those: a
        value read from a distance table leaves its own code unread)."""
        return _function(name, params, self._closure("\n".join(lines + [ret])) + lines, ret)

    def _score_function(self, name: str, module: torch.fx.GraphModule) -> str:
        lines: list[str] = []
        env = self._bind_leaves(module, lines)
        result = _emit_graph(module, env, lines, "e")[0]
        return self._index_function(name, "s, b, h, q_idx, kv_idx, aux", lines,
                                    f"return ({result.expr} + {SPLAT_OF_S}).to(tl.float32)")

    def _grad_function(self, name: str, module: torch.fx.GraphModule, optional: bool = False) -> str | None:
        """The jit function of `module`'s gradient: d out/d s · ds returned, aux gradients accumulated. When
        `optional`, None where no gradient flows (a constant; the vector-Jacobian product reads ds wherever
        one does)."""
        placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
        by_name = {n.name: n for n in self.graph.nodes if n.op == "placeholder"}
        differentiable = [i for i, n in enumerate(placeholders)
                          if by_name.get(n.name) is self.s_leaf or isinstance(self.leaves.get(by_name.get(n.name)),
                                                                               GradLeaf)]
        backward = _vjp_graph(module, differentiable)
        if optional and not _reads_last_input(backward):
            return None
        lines: list[str] = []
        env = self._bind_leaves(module, lines)
        env_backward = {}
        backward_placeholders = [n for n in backward.graph.nodes if n.op == "placeholder"]
        for n, p in zip(backward_placeholders, placeholders + [None]):
            env_backward[n.name] = env[p.name] if p is not None else Operand("ds", torch.float32)
        grads = _emit_graph(backward, env_backward, lines, "d")
        result = "tl.zeros_like(s)"
        for i, grad in zip(differentiable, grads):
            leaf = by_name.get(placeholders[i].name)
            if grad is None:
                continue
            if leaf is self.s_leaf:
                result = f"({grad.expr} + {SPLAT_OF_S}).to(tl.float32)"
            else:
                # The dQ kernel passes aux_grad=None: the dK/dV kernel alone accumulates aux gradients.
                lines.append("if aux_grad is not None:")
                lines += ["    " + line for line in _accumulate(self.leaves[leaf], grad.expr)]
        return self._index_function(name, "s, ds, b, h, q_idx, kv_idx, aux, aux_grad", lines, f"return {result}")


def _load_text(aux: int | str, offset: str, mask: str | None) -> str:
    """Code loading aux tensor `aux` at `offset` (0 where `mask` is false)."""
    return f"tl.load(aux[{aux}] + {offset}" + (f", mask={mask}, other=0)" if mask else ")")


def _accumulate(leaf: GradLeaf, grad: str) -> list[str]:
    """Add a gradient tile into the aux tensor's gradient, summing first over the axes it is broadcast on."""
    full = f"({grad} + {SPLAT_OF_S}).to(tl.float32)"
    target = leaf.slot or leaf.aux
    if "q" not in leaf.uses and "k" not in leaf.uses:
        return [f"tl.atomic_add(aux_grad[{target}] + {leaf.offset}, tl.sum({full}))"]
    if "q" not in leaf.uses or "k" not in leaf.uses:
        # Summed over the axis of the index it does not read: q's is 0 in [q, kv] tiles, 1 in the [kv, q]
        # tiles of the dK/dV kernel.
        axis, transposed_axis = ("0", "1") if "q" not in leaf.uses else ("1", "0")

        def add(summed: str) -> str:
            return (f"tl.atomic_add(aux_grad[{target}] + ({leaf.offset}), "
                    f"tl.expand_dims(tl.sum({full}, {summed}), {summed}), mask={leaf.mask})")
        return ["if q_idx.shape[0] == 1:  # [kv, q] tiles", "    " + add(transposed_axis), "else:", "    " + add(axis)]
    if leaf.slot is not None:  # a distance table's gradient: summed per distance first
        return ["if q_idx.shape[0] == 1:  # [kv, q] tiles",
                f"    fd.add_by_distance(aux_grad[{target}], {leaf.offset}, {full})",
                "else:",
                f"    fd.add_by_distance(aux_grad[{target}], tl.trans({leaf.offset}), tl.trans({full}))"]
    return [f"tl.atomic_add(aux_grad[{target}] + ({leaf.offset}), {full}, mask={leaf.mask})"]


def _reads_last_input(module: torch.fx.GraphModule) -> bool:
    """Whether any of `module`'s outputs is computed from its last placeholder."""
    reached = {[n for n in module.graph.nodes if n.op == "placeholder"][-1]}
    for node in module.graph.nodes:
        if node.op != "placeholder" and any(arg in reached for arg in node.all_input_nodes):
            reached.add(node)
    output = [n for n in module.graph.nodes if n.op == "output"][0]
    return output in reached


def _vjp_graph(module: torch.fx.GraphModule, differentiable: list[int]) -> torch.fx.GraphModule:
    """E's vector-Jacobian product as a graph of pointwise ATen ops, traced by torch's autograd:
    inputs are E's inputs and the output's gradient, outputs the gradients of ``differentiable``."""
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    # Small real tensors to trace with. Every input gets the lanes, 0-d ones
    # too: a 0-d input's gradient is then per element (autograd would sum it), and the kernel sums it
    # as it accumulates.
    inputs = [torch.ones((LANES,), dtype=n.meta["val"].dtype) for n in placeholders]
    out_val = [n for n in module.graph.nodes if n.op == "output"][0].args[0].meta["val"]
    ds = torch.ones(tuple(out_val.shape), dtype=out_val.dtype)

    def vjp(*args):
        xs = list(args[:-1])
        for i in differentiable:
            xs[i] = xs[i].detach().requires_grad_(True)
        with torch.enable_grad():
            out = module(*xs)
            if not out.requires_grad:  # a constant (a mask's fill): no gradient flows
                return tuple(torch.zeros_like(xs[i]) for i in differentiable)
            grads = torch.autograd.grad(out, [xs[i] for i in differentiable], args[-1], allow_unused=True)
        return tuple(g if g is not None else torch.zeros_like(xs[i]) for g, i in zip(grads, differentiable))

    with torch.enable_grad():
        # Inside a custom op's implementation autograd is off whatever the grad mode: every gradient
        # would trace as zero. Refuse rather than emit that.
        if not (torch.ones((), requires_grad=True) * 2).requires_grad:
            raise RuntimeError("autograd is off where the score chain is differentiated")
    # Traced on the real tensors above (LANES elements each): the graph is pointwise ATen ops, whose trace
    # does not depend on values, and a fake-mode trace cost ~0.08 s per function where this costs ~0.01.
    return make_fx(vjp, tracing_mode="real")(*inputs, ds)


def _emit_graph(module: torch.fx.GraphModule, env: dict[str, Operand], lines: list[str], prefix: str
                ) -> list[Operand | None]:
    """Translate a graph of pointwise ops; returns its outputs as operands."""
    values: dict[torch.fx.Node, Any] = {}
    count = 0
    for node in module.graph.nodes:
        if node.op == "placeholder":
            values[node] = env[node.name]
        elif node.op == "call_function":
            def resolve(a):
                if isinstance(a, torch.fx.Node):
                    return values[a]
                if isinstance(a, (list, tuple)):
                    return type(a)(resolve(x) for x in a)
                return a

            target = node.target
            if packet(node) in (aten.detach, aten.alias, aten.view, aten.expand, aten.clone, aten._to_copy) and \
                    node.meta["val"].dtype == resolve(node.args[0]).dtype:
                values[node] = resolve(node.args[0])
                continue
            if packet(node) in (aten.full_like, aten.zeros_like, aten.ones_like, aten.full, aten.zeros, aten.ones,
                                aten.scalar_tensor):
                value = constant_value(packet(node), node.args, node.kwargs)
                values[node] = Operand(literal(value, held_dtype(node.meta["val"].dtype)), node.meta["val"].dtype)
                continue
            result = translate(target, resolve(node.args), {k: resolve(v) for k, v in node.kwargs.items()},
                               node.meta["val"].dtype, round_halves=False)
            name = f"{prefix}{count}"
            count += 1
            lines.append(f"{name} = {result.expr}")
            values[node] = Operand(name, result.dtype, node.meta["val"].dim() == 0)
        elif node.op == "output":
            outs = node.args[0]
            outs = outs if isinstance(outs, (list, tuple)) else (outs,)
            return [values[o] if isinstance(o, torch.fx.Node) else None for o in outs]
    raise AssertionError("graph without output")


def _function(name: str, params: str, lines: list[str], ret: str) -> str:
    body = "\n".join(f"    {line}" for line in lines + [ret])
    return f"@triton.jit\ndef {name}({params}):\n{body}\n"


def _tensor(node: torch.fx.Node) -> torch.Tensor:
    """The value a node of the chain stands for, which must be a tensor: a number Dynamo made symbolic (an int
    that changed between calls) is not planned for."""
    value = val(node)
    if not isinstance(value, torch.Tensor):
        raise Unsupported(f"the score chain reads {node.name}, a number Dynamo made symbolic because it changed "
                          "between calls (torch.compile(..., dynamic=False) keeps it a constant)")
    return value


def _of_distance(value: Code) -> bool:
    """Whether an index value is a function of the distance k - q alone (one not varying with q or k is)."""
    return value.relative or not {"q", "k"} & value.uses


def _affine_of(idx: Idx) -> tuple[int, int, int] | None:
    """``idx`` as (a, c, d) of a·q + c·k + d, where it is a sum of whole positions."""
    coefs = {"q": 0, "k": 0}
    for t in idx.terms:
        if t.var not in coefs or t.div != 1 or t.mod is not None:
            return None
        coefs[t.var] += t.coef
    return coefs["q"], coefs["k"], idx.const


def _affine_result(target: Any, args: tuple, kwargs: dict) -> tuple[int, int, int] | None:
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


def _span_of(value: Any) -> Span | None:
    if isinstance(value, Code):
        return (0, 1) if value.dtype == torch.bool else value.span
    if isinstance(value, (bool, int)):
        return int(value), int(value)
    if isinstance(value, float):
        return value, value
    return None


def _result_span(target: Any, args: tuple, kwargs: dict, dtype: torch.dtype) -> Span | None:
    """The span of an op's numeric result (None for bools, or where unknown); a float's widened for rounding,
    a float's conversion to an integer that of its truncated values (see spans.py)."""
    if dtype == torch.bool or not hasattr(target, "_schema"):
        return None
    kind = getattr(target, "overloadpacket", None)
    if kind in CASTS:
        source = args[1] if kind == aten.copy else args[0]
        span = _span_of(source)
        if dtype.is_floating_point:
            return float_rounding(span)
        from_float = isinstance(source, float) or isinstance(source, Code) and source.dtype.is_floating_point
        return truncated(span) if from_float else span
    bound = bind(target, args, kwargs)
    span = result_span(target, {name: _span_of(v) for name, v in bound.items() if v is not None})
    return float_rounding(span) if dtype.is_floating_point else span


def _needs_int64_offsets(tensor: torch.Tensor) -> bool:
    """Whether element offsets into ``tensor`` can leave int32 (indices, positions and program ids are int32)."""
    return sum((size - 1) * abs(stride) for size, stride in zip(tensor.shape, tensor.stride())) >= 2 ** 31


def _offset_term(index: str, stride: int, wide: bool) -> str:
    index = f"({index}).to(tl.int64)" if wide else index
    return index if stride == 1 else f"{index} * {stride}"


def _coef(name: str, coef: int) -> str:
    return name if coef == 1 else f"{coef} * {name}"


def _broadcast(coords: tuple[Idx, ...], shape: tuple, arg_shape: tuple) -> tuple[Idx, ...]:
    offset = len(shape) - len(arg_shape)
    return tuple(Idx.constant(0) if (size == 1 and shape[i + offset] != 1) else coords[i + offset]
                 for i, size in enumerate(arg_shape))


def _mask_of(node: torch.fx.Node, args: tuple) -> tuple[str, Any] | None:
    """``(keep, fill)`` when ``node`` is ``where(keep, 0, fill)`` or ``masked_fill(zeros, ~keep, fill)``:
    a mask meant to be added to the scores."""
    kind = packet(node)
    if kind == aten.where and isinstance(args[0], Code):
        a, b = args[1], args[2]
        if _is_zero(a) and isinstance(b, (int, float)):
            return args[0].expr, b
        if _is_zero(b) and isinstance(a, (int, float)):
            return f"~{args[0].expr}", a
    if kind == aten.masked_fill and isinstance(args[1], Code) and _is_zero(args[0]) and \
            isinstance(args[2], (int, float)):
        return f"~{args[1].expr}", args[2]
    return None


def _converted(expr: str, uses: frozenset[str], dtype: torch.dtype) -> str:
    """An index expression as a tensor of `dtype`. One that uses no index (a position along a dim of length 1, the
    constant 0) is made one (``tl.full``): Python's arithmetic on literals is not Triton's."""
    triton_dtype = TRITON_DTYPE[dtype]
    return f"({expr}).to({triton_dtype})" if uses else f"tl.full([], {expr}, {triton_dtype})"


def _is_literal(expr: str) -> bool:
    """Whether an index expression is a Python literal (a constant's, as `literal` writes it)."""
    return re.fullmatch(r'True|False|-?\d+|-?[\d.]+(e[-+]?\d+)?|float\("-?(inf|nan)"\)', expr) is not None


def _is_zero(a: Any) -> bool:
    if isinstance(a, (int, float)):
        return a == 0
    return isinstance(a, Code) and a.expr in ("0", "0.0", "False")


def _view_coords(node: torch.fx.Node, coords: tuple[Idx, ...]) -> tuple[Idx, ...]:
    """The coordinates of a view's input, given those its output is read at."""
    kind = packet(node)
    source = node.args[0]
    in_shape, out_shape = tuple(val(source).shape), tuple(val(node).shape)
    ndim = len(in_shape)
    if kind in (aten.alias, aten.clone, aten.contiguous, aten.detach, aten.lift_fresh_copy):
        return coords
    if kind == aten.expand:
        return _broadcast(coords, out_shape, in_shape)
    if kind in (aten.permute, aten.transpose, aten.t):
        if kind == aten.permute:
            order = [d % ndim for d in node.args[1]]
        elif kind == aten.transpose:
            order = list(range(ndim))
            a, b = node.args[1] % ndim, node.args[2] % ndim
            order[a], order[b] = order[b], order[a]
        else:
            order = list(range(ndim))[::-1]
        result = [None] * ndim
        for j, i in enumerate(order):
            result[i] = coords[j]
        return tuple(result)
    if kind == aten.slice:
        dim = (node.args[1] if len(node.args) > 1 else 0) % ndim
        start = node.args[2] if len(node.args) > 2 and node.args[2] is not None else 0
        step = node.args[4] if len(node.args) > 4 else 1
        if start < 0:
            start += in_shape[dim]
        start = min(max(start, 0), in_shape[dim])
        return coords[:dim] + (coords[dim].scaled(step, start),) + coords[dim + 1:]
    if kind == aten.select:
        dim = node.args[1] % ndim
        index = node.args[2] % in_shape[dim]
        return coords[:dim] + (Idx.constant(index),) + coords[dim:]
    if not (all(isinstance(s, int) for s in in_shape) and all(isinstance(s, int) for s in out_shape)):
        raise Unsupported("a view with symbolic sizes in the score chain")
    return _reshape_coords(coords, out_shape, in_shape)


def _reshape_coords(coords: tuple[Idx, ...], out_shape: tuple[int, ...], in_shape: tuple[int, ...]
                    ) -> tuple[Idx, ...]:
    """view, reshape, unsqueeze, squeeze, flatten, unflatten keep row-major order: match the input and
    output dims in groups of equal size and, within each, merge the output coordinates and split them
    over the input dims (size-1 dims carry coordinate 0 and are set aside)."""
    out_dims = [j for j, s in enumerate(out_shape) if s != 1]
    in_dims = [i for i, s in enumerate(in_shape) if s != 1]
    result = [Idx.constant(0)] * len(in_shape)
    i = j = 0
    while i < len(in_dims) or j < len(out_dims):
        group_in, group_out = [in_dims[i]], [out_dims[j]]
        i, j = i + 1, j + 1
        size_in, size_out = in_shape[group_in[0]], out_shape[group_out[0]]
        while size_in != size_out:
            if size_in < size_out:
                group_in.append(in_dims[i])
                size_in *= in_shape[in_dims[i]]
                i += 1
            else:
                group_out.append(out_dims[j])
                size_out *= out_shape[out_dims[j]]
                j += 1
        flat = merge(tuple(coords[d] for d in group_out), tuple(out_shape[d] for d in group_out))
        for d, part in zip(group_in, flat.split(tuple(in_shape[d] for d in group_in))):
            result[d] = part
    return tuple(result)
