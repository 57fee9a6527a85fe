"""The walk: each value the score chain reads, evaluated at the coordinates the kernel is at (`views`), becomes
index code (`values.Code`) or a node of E (`values.Diff`); then the masks are split off (`masks`) and E and the
index code are assembled into the kernel's functions (`emit`), with the tables (`tables`) and the features
(`features`) found on the way.

The forms recognized, by the ATen op at a value (`Lifter._evaluate`): the scores themselves (with baddbmm's bias
and scales); views and copies (read through, `views.view_coords`); constants; ``arange`` (positions); ``tril`` and
``triu`` (triangle masks); gathers (``embedding``, ``index``: a tensor read at computed indices); any pointwise op
the translator has (`codegen/rules.py`): index code where no operand depends on the scores or takes a
gradient, a node of E otherwise; and any other graph value outside the chain: a tensor loaded at its strides.
Anything else in the chain is declined with its op named.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from fusepass.attention.index import Idx, merge
from fusepass.attention.known_contents import BAND_DTYPES, Band, band_of, known_tensor
from fusepass.attention.layout import REARRANGING_OPS, Scale, Unsupported
from fusepass.attention.lift.egraph import EGraph
from fusepass.attention.lift.emit import ScoreFunctions, linear_scale
from fusepass.attention.lift.features import Features
from fusepass.attention.lift.index_code import IndexCode, load_text
from fusepass.attention.lift.masks import split_masks
from fusepass.attention.lift.sizes import Sizes
from fusepass.attention.lift.tables import DistanceTables
from fusepass.attention.lift.values import (Canon, Code, Diff, GradLeaf, Lifted, Separable, affine_of, affine_result,
                                            converted, indicator_of, is_literal, literal_value, mask_of, of_distance,
                                            op_span, span_of, tensor_of)
from fusepass.attention.lift.views import (bounds, broadcast, needs_int64_offsets, offset_term, render, repeat_coords,
                                           root_coords, view_coords)
from fusepass.attention.match import AttentionMatch
from fusepass.attention.spans import Span, float_exact, narrow
from fusepass.codegen.operands import TRITON_DTYPE, Operand, held_dtype, literal
from fusepass.codegen.translate import CASTS, CONSTANTS, constant_value, is_supported, translate
from fusepass.fx_util import packet, val

aten = torch.ops.aten
# The stem of the score functions' names, the same for every attention: the source is then the chain's alone, so that
# attentions lifted alike (a model's layers, one attention planned again at a new length) load one module and
# share its jit functions, and with them the flash kernels compiled for those (`codegen.modules.load_module`).
FUNCTIONS = "chain"
# Integer ops whose fp32 form (Code.as_float) is exact when every value is.
FLOAT_FORM_OPS = {aten.add, aten.sub, aten.neg, aten.abs, *CASTS}


class Lifter:
    def __init__(self, m: AttentionMatch, canon: Canon, sizes_vary: bool = False, scales: tuple[Scale, ...] = ()
                 ) -> None:
        self.m = m
        self.canon = canon
        self.scales = scales  # Q's and K's, applied to the scores (the kernel reads the tensors before them)
        self.sizes = Sizes(sizes_vary)  # run-time values where the sizes vary
        self.code = IndexCode()
        self.tables = DistanceTables(canon, FUNCTIONS, self.code, self.sizes)
        self.e = EGraph(val(m.qk).dtype, self.tables.tabulated)
        self.features = Features()
        self.aux: list[torch.fx.Node] = []  # the tensors the score functions read, in their order in `aux`
        self.memo: dict[tuple[torch.fx.Node, tuple[Idx, ...]], Code | Diff] = {}
        self.chain = set(m.chain)
        self.bands: list[tuple[torch.fx.Node, Band]] = []  # buffers read as the bands they hold, guarded per call

    def lift(self) -> Lifted:
        root = self.m.softmax.args[0]
        final = self.value(root, root_coords(root))
        if not isinstance(final, Diff):
            raise Unsupported("the softmax input does not depend on the scores")
        self.e.graph.output(final.node)
        split = split_masks(self.e, self.code)
        emit = ScoreFunctions(self.e, self.code, self.aux)
        name = FUNCTIONS
        score_graph = split.score if split is not None else self.e.module()
        chunks = [emit.score(f"{name}_score", score_graph), emit.gradient(f"{name}_score_grad", score_graph)]
        functions = {"score": f"{name}_score", "score_grad": f"{name}_score_grad"}
        if split is not None:
            chunks.append(self.code.function(f"{name}_keep", "b, h, q_idx, kv_idx, aux", [], f"return {split.keep}"))
            separable = split.separable
            if separable is not None:
                chunks.append(self.code.function(f"{name}_keep_rows", "b, h, q_idx, aux", [],
                                                 f"return {separable.rows}"))
                chunks.append(self.code.function(f"{name}_keep_cols", "b, h, kv_idx, aux", [],
                                                 f"return {separable.cols}"))
                functions.update(keep_rows=f"{name}_keep_rows", keep_cols=f"{name}_keep_cols")
                if separable.others is not None:
                    chunks.append(self.code.function(f"{name}_keep_others", "b, h, q_idx, kv_idx, aux", [],
                                                     f"return {separable.others}"))
                    functions["keep_others"] = f"{name}_keep_others"
            chunks.append(emit.score(f"{name}_fill", split.fill))
            functions.update(keep=f"{name}_keep", fill=f"{name}_fill")
            # A fill that no gradient flows through (a constant) has no gradient function: the kernels then add
            # no zero tile per masked tile (docs/flash-kernel-interface.md, fill_grad=None).
            fill_grad = emit.gradient(f"{name}_fill_grad", split.fill, optional=True)
            if fill_grad is not None:
                chunks.append(fill_grad)
                functions["fill_grad"] = f"{name}_fill_grad"
        if self.tables.tables:
            self.features.names.add("distance_table")
        keep_text = "" if split is None else "\n".join([split.keep, *self.code.closure(split.keep)])
        # The aux tuple: the tensors read, the sizes, the distance tables.
        source = self.sizes.placed("\n\n".join(chunks + self.tables.sources), len(self.aux))
        return Lifted(source=self.tables.placed(source, len(self.aux) + len(self.sizes.values)),
                      functions=functions, aux=self.aux, sizes=tuple(self.sizes.values),
                      aux_needs_grad=[bool(a.meta.get("requires_grad", False)) and i in emit.reached
                                      for i, a in enumerate(self.aux)],
                      fill_bound=split.fill_bound if split is not None else -math.inf,
                      keep_uses=split.uses if split is not None else frozenset(),
                      keep_reads_aux=split is not None and split.reads_aux,
                      separable=split.separable if split is not None else None,
                      features=self.features.all(split is not None and split.key_side,
                                                 lambda i: f"aux[{i}]" in keep_text),
                      tables=self.tables.tables, linear_scale=linear_scale(score_graph, self.e.s_leaf),
                      bands=self.bands)

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
        if kind in REARRANGING_OPS:
            return self.value(node.args[0], view_coords(node, coords))
        if kind == aten.repeat and (source_coords := repeat_coords(node, coords)) is not None:
            return self.value(node.args[0], source_coords)
        if node.op == "call_function" and kind in CONSTANTS or _scalar_constant(node) is not None:
            value = constant_value(kind, node.args, node.kwargs) if node.op == "call_function" else \
                _scalar_constant(node)
            return Code(literal(value, held_dtype(val(node).dtype)), val(node).dtype, frozenset(),
                        val(node).dim() == 0, span=span_of(value))
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
        return self._band(node, coords) or self._load(node, coords)

    def _scores(self, coords: tuple[Idx, ...]) -> Diff:
        batch = tuple(val(self.m.qk).shape[:-2])
        c = self.canon
        if not (merge(coords[:-2], batch).is_var("f", c.batch * c.heads) and coords[-2].is_var("q", c.q_len)
                and coords[-1].is_var("k", c.kv_len)):
            raise Unsupported("the scores are read at other coordinates than they are computed at")
        s = Diff(self.e.s_leaf, frozenset(("b", "h", "q", "k")))
        for scale in self.scales:
            s = self.e.node(aten.mul.Tensor if scale.op == aten.mul else aten.div.Tensor, (s, scale.by), {})
        ops = self.m.scores
        if ops.bias is None:
            return s
        if ops.alpha != 1:
            s = self.e.node(aten.mul.Tensor, (s, ops.alpha), {})
        bias = self.value(ops.bias, broadcast(coords, tuple(val(self.m.qk).shape), tuple(tensor_of(ops.bias).shape)))
        if ops.beta != 1:
            bias = self._pointwise_value(aten.mul.Tensor, (bias, ops.beta), {}, val(self.m.qk).dtype)
        return self.e.node(aten.add.Tensor, (s, bias), {})

    def _arange(self, node: torch.fx.Node, coords: tuple[Idx, ...]) -> Code:
        args = list(node.args)
        start, step = (0, 1) if len(args) == 1 else (args[0], args[2] if len(args) > 2 else 1)
        text, uses = render(coords[0], self.canon)
        dtype = val(node).dtype
        expr = f"({start} + {step} * {text})" if (start, step) != (0, 1) else text
        span = None
        if not dtype.is_floating_point and all(isinstance(x, int) for x in (start, step)):
            ends = (start, start + step * (val(node).shape[0] - 1))
            span = (min(ends), max(ends))
        target = torch.int32 if narrow(dtype, span) else held_dtype(dtype)
        as_float = converted(expr, uses, torch.float32) if float_exact(span) else None
        affine = None
        position = affine_of(coords[0])
        if position is not None and span is not None:
            affine = (step * position[0], step * position[1], start + step * position[2])
        return Code(self.code.let(converted(expr, uses, target)), dtype, uses, span=span, as_float=as_float,
                    affine=affine)

    def _triangle(self, node: torch.fx.Node, coords: tuple[Idx, ...]) -> Code:
        x = self.value(node.args[0], coords)
        if not isinstance(x, Code):
            raise Unsupported("tril/triu of the scores")
        diagonal = node.args[1] if len(node.args) > 1 else node.kwargs.get("diagonal", 0)
        distance, uses = self._diagonal(coords)
        op = "<=" if packet(node) == aten.tril else ">="
        keep = converted(f"({distance} {op} {diagonal})", uses, torch.bool)
        zero = literal(0, held_dtype(x.dtype))
        expr = self.code.let(f"tl.where({keep}, {x.expr}, {zero})")
        span = (min(x.span[0], 0), max(x.span[1], 0)) if x.span is not None else None
        # A triangle of a constant (``torch.full((n, n), -inf).triu(1)``, nn.Transformer's causal mask) is that
        # constant inside it and 0 outside: a mask meant to be added to the scores (`mask_of`).
        fill = literal_value(x.expr)
        return Code(expr, x.dtype, x.uses | uses, compares=x.compares + 1, span=span,
                    mask=(f"~{keep}", fill) if fill else None)

    def _diagonal(self, coords: tuple[Idx, ...]) -> tuple[str, frozenset[str]]:
        """The diagonal ``col - row`` of a tensor read at `coords` (of its last two dims), and what it uses."""
        row, row_uses = render(coords[-2], self.canon)
        col, col_uses = render(coords[-1], self.canon)
        return f"(({col}) - ({row}))", row_uses | col_uses

    def _band(self, node: torch.fx.Node, coords: tuple[Idx, ...]) -> Code | None:
        """A buffer read as the band it holds (`known_contents`): the positions compared, as ``tril`` is, in
        place of a load per score; the attention's call checks on each call that it still holds it."""
        tensor = known_tensor(node)
        fake = val(node)
        if tensor is None or node.meta.get("requires_grad") or tuple(tensor.shape) != tuple(fake.shape) or \
                tensor.dtype != fake.dtype or tensor.device != fake.device or tensor.dtype not in BAND_DTYPES:
            return None
        with unset_fake_temporarily():
            band = band_of(tensor)
        if band is None:
            return None
        if all(n is not node for n, _ in self.bands):
            self.bands.append((node, band))
        distance, uses = self._diagonal(broadcast(coords, tuple(fake.shape), tuple(fake.shape)))
        dtype, held = band.dtype, held_dtype(band.dtype)
        bounds = [*([f"({distance} >= {band.lo})"] if band.lo is not None else []),
                  *([f"({distance} <= {band.hi})"] if band.hi is not None else [])]
        span = (min(band.inside, band.outside), max(band.inside, band.outside))
        keep = converted(" & ".join(bounds), uses, torch.bool)
        if dtype == torch.bool:
            expr = keep if band.inside else f"(~{keep})"
        else:
            expr = f"tl.where({keep}, {literal(band.inside, held)}, {literal(band.outside, held)})"
        compares = band.bounds if {"q", "k"} <= uses else 0
        mask = (keep, band.outside) if band.inside == 0 else (f"~{keep}", band.inside) if band.outside == 0 else None
        return Code(self.code.let(expr), dtype, uses, compares=compares, span=span,
                    mask=mask if dtype.is_floating_point else None)

    def _gather(self, node: torch.fx.Node, coords: tuple[Idx, ...]) -> Code | Diff:
        """``table[i0, i1, ...]`` (``aten.index``, ``embedding``): index tensors evaluated at the output's
        coordinates, the other dims read at theirs, as advanced indexing places them."""
        if packet(node) == aten.embedding:
            table, indices = node.args[0], [node.args[1]]
        else:
            table, indices = node.args[0], list(node.args[1])
        present = [d for d, ix in enumerate(indices) if ix is not None]
        index_shape = tuple(torch.broadcast_shapes(*[tuple(tensor_of(indices[d]).shape) for d in present]))
        table_shape = tuple(val(table).shape)
        adjacent = present == list(range(present[0], present[-1] + 1))
        start = present[0] if adjacent else 0
        index_coords = coords[start:start + len(index_shape)]
        plain = iter(coords[:start] + coords[start + len(index_shape):])
        parts, uses = [], set()
        wide = needs_int64_offsets(val(table))
        relative = True  # every index a value of the distance alone, no other dim read at q or k
        for d, (size, stride) in enumerate(zip(table_shape, val(table).stride())):
            if d in present:
                i = self.value(indices[d], broadcast(index_coords, index_shape, tuple(val(indices[d]).shape)))
                if not isinstance(i, Code):
                    raise Unsupported("a gather whose indices depend on the scores")
                wrapped = self.code.let(f"tl.where({i.expr} < 0, {i.expr} + {self.sizes.text(size)}, {i.expr})")
                parts.append(offset_term(wrapped, stride, wide, self.sizes))
                uses |= i.uses
                relative &= of_distance(i)
            else:
                text, u = render(next(plain), self.canon)
                parts.append(offset_term(text, stride, wide, self.sizes))
                uses |= u
                relative &= not {"q", "k"} & u
        if table.meta.get("requires_grad", False) or "q" in uses and "k" in uses:
            self.features.names.add("relative_bias")
        return self._read(table, " + ".join(parts), frozenset(uses), gathered=True, relative=relative)

    def _load(self, node: torch.fx.Node, coords: tuple[Idx, ...]) -> Code | Diff:
        tensor = tensor_of(node)
        if not all(isinstance(s, int) for s in tensor.stride()):
            raise Unsupported("a score input with symbolic strides")
        coords = broadcast(coords, tuple(tensor.shape), tuple(tensor.shape))
        parts, uses = [], set()
        wide = needs_int64_offsets(tensor)
        for c, stride, size in zip(coords, tensor.stride(), tensor.shape):
            if size == 1:
                continue
            text, u = render(c, self.canon)
            parts.append(offset_term(text, stride, wide, self.sizes))
            uses |= u
        return self._read(node, " + ".join(parts) if parts else "0", frozenset(uses))

    def _read(self, tensor: torch.fx.Node, offset: str, uses: frozenset[str], gathered: bool = False,
              relative: bool = False) -> Code | Diff:
        t = val(tensor)
        if t.device != val(self.m.qk).device:
            raise Unsupported(f"a score input on {t.device}, the scores on {val(self.m.qk).device}")
        index = self._aux_index(tensor)
        mask = bounds(uses, self.canon, self.sizes)
        if not gathered:
            self.features.note_read(t, uses, index)
        if tensor.meta.get("requires_grad", False):
            leaf = self.tables.gathered(index, offset, mask, uses, relative, t.dtype) or \
                GradLeaf(index, offset, mask, uses)
            return self.e.grad_leaf(leaf, t.dtype, t.dim() == 0, uses)
        load = load_text(index, offset, mask)
        if held_dtype(t.dtype) != t.dtype:
            load += f".to({TRITON_DTYPE[held_dtype(t.dtype)]})"
        return Code(self.code.let(load), t.dtype, uses, t.dim() == 0, relative=relative)

    def _aux_index(self, tensor: torch.fx.Node) -> int:
        if tensor not in self.aux:
            self.aux.append(tensor)
        return self.aux.index(tensor)

    def _pointwise(self, node: torch.fx.Node, coords: tuple[Idx, ...]) -> Code | Diff:
        shape = tuple(val(node).shape)

        def arg_value(a: Any) -> Any:
            if isinstance(a, torch.fx.Node):
                return self.value(a, broadcast(coords, shape, tuple(tensor_of(a).shape)))
            if isinstance(a, (list, tuple)):
                return type(a)(arg_value(x) for x in a)
            return a

        args = tuple(arg_value(a) for a in node.args)
        kwargs = {k: arg_value(v) for k, v in node.kwargs.items()}
        result = self._pointwise_value(node.target, args, kwargs, val(node).dtype, val(node).dim() == 0)
        if isinstance(result, Code) and packet(node) in (aten.where, aten.masked_fill, aten.mul):
            mask = mask_of(node, args)
            if mask is not None or packet(node) != aten.mul:
                result = replace(result, mask=mask, as_float=None, affine=None)
        if isinstance(result, Code):
            result = replace(result, indicator=indicator_of(node, args))
        return result

    def _pointwise_value(self, target: Any, args: tuple, kwargs: dict, dtype: torch.dtype,
                         zero_dim: bool = False) -> Code | Diff:
        flat = list(args) + list(kwargs.values())
        # An additive mask added to another value before the scores (T5's decoder: its position bias and mask, in a
        # forward without gradients) stays a leaf of E of its own, which `masks.split_masks` can split off.
        added_mask = getattr(target, "overloadpacket", None) == aten.add and \
            any(isinstance(a, Code) and a.mask is not None for a in args) and \
            all(isinstance(a, (Code, Diff)) for a in args)
        if added_mask or any(isinstance(a, Diff) for a in flat):
            self.features.note_op(target, args)
            return self.e.node(target, args, kwargs)

        span = op_span(target, args, kwargs, dtype)
        narrow_result = narrow(dtype, span)

        codes = [a for a in flat if isinstance(a, Code)]
        # Literals alone would compute in Python (constexpr) arithmetic, whose ~True is -2: the first is made a
        # tensor, so that the op is Triton's.
        literal_only = bool(codes) and all(is_literal(a.expr) for a in codes)

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
                    if is_literal(a.expr):
                        return Operand(a.expr, torch.int64, a.zero_dim)
                    return Operand(f"({a.expr}).to(tl.int64)", a.dtype, a.zero_dim)
                return Operand(a.expr, torch.int32 if a.narrow else a.dtype, a.zero_dim)
            if isinstance(a, (list, tuple)):
                return type(a)(operand(x) for x in a)
            return a

        uses = frozenset().union(*[a.uses for a in codes])
        compares = sum(a.compares for a in codes)
        if getattr(target, "overloadpacket", None) in (aten.lt, aten.le, aten.gt, aten.ge) and {"q", "k"} <= uses:
            compares += 1
        if getattr(target, "overloadpacket", None) == aten.abs and {"q", "k"} <= uses:
            compares += 1  # |k - q| bounded is a band: two comparisons in one
        self.features.note_op(target, args)
        result = translate(target, operand(args), {k: operand(v) for k, v in kwargs.items()},
                           torch.int32 if narrow_result else dtype, round_halves=False)
        # Integers only have an fp32 form (a float result is its own).
        as_float = None if dtype.is_floating_point else self._float_form(target, args, kwargs, span)
        affine = None if dtype.is_floating_point or span is None else affine_result(target, args, kwargs)
        nested = any(isinstance(a, (list, tuple)) for a in flat)  # operands in lists: not looked into
        relative = not nested and all(of_distance(a) for a in codes) or \
            affine is not None and affine[0] == -affine[1] != 0
        return Code(self.code.let(result.expr), dtype, uses, zero_dim, compares=compares, span=span,
                    as_float=as_float, affine=affine, relative=relative, separable=self._separable(target, args))

    def _separable(self, target: Any, args: tuple) -> Separable | None:
        """`Code.separable` of ``target(*args)``: an equality or inequality of an integer (or bool) of the query
        position alone with one of the key position alone; its negation; its conjunction or disjunction with index
        code that reads no tensors."""
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
        conjunction = kind in (aten.logical_and, aten.bitwise_and, aten.__and__)
        if (conjunction or kind in (aten.logical_or, aten.bitwise_or, aten.__or__)) and len(args) == 2:
            for one, other in ((args[0], args[1]), (args[1], args[0])):
                if one.separable is not None and other.separable is None and not self.code.reads_aux(other.expr):
                    if conjunction:
                        return one.separable.joined(other.expr, other.uses)
                    # A | B = ~(~A & ~B): a fill where the ids differ or past the causal mask keeps their conjunction.
                    # (B negated by a comparison: a constant's code is a Python bool, whose `~` is an int.)
                    joined = one.separable.negated().joined(f"(({other.expr}) == 0)", other.uses)
                    return None if joined is None else joined.negated()
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


def _scalar_constant(node: torch.fx.Node) -> bool | int | float | None:
    """The value of a one-element constant the trace baked into the graph (``torch.tensor(0.0)`` in the user's code
    is a ``_tensor_constant`` attribute): a literal in the score functions, so that ``where(keep, tensor(0.0),
    min)`` is a mask like ``where(keep, 0, min)``. Parameters and buffers are the graph's inputs, never these."""
    if node.op != "get_attr":
        return None
    value = getattr(node.graph.owning_module, node.target, None)
    if not isinstance(value, torch.Tensor) or value.numel() != 1 or value.requires_grad or \
            isinstance(value, torch._subclasses.FakeTensor) or value.is_meta:
        return None
    return value.item()
