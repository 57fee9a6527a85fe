"""E's modules, the scores' and the fill's, as the kernels' jit functions: each value and, through torch's own
autograd (``make_fx`` of E's vector-Jacobian product), its gradient, with the aux tensors' gradients accumulated.
No second table of derivatives exists."""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx

from fusepass.attention.lift.egraph import LANES, EGraph
from fusepass.attention.lift.index_code import IndexCode, load_text
from fusepass.attention.lift.values import Code, GradLeaf
from fusepass.codegen.operands import TRITON_DTYPE, Operand, held_dtype, literal, round_to
from fusepass.codegen.pointwise import float32_reciprocal
from fusepass.codegen.translate import CASTS, constant_value, translate
from fusepass.fx_util import packet, val

aten = torch.ops.aten
# Broadcasts a value to the scores' shape: -0.0, not 0.0, so that the addition is an identity the compiler
# removes (x + 0.0 is not: -0.0 + 0.0 = +0.0), instead of one more instruction per score.
SPLAT_OF_S = "tl.full(s.shape, -0.0, tl.float32)"
# Casts whose first argument is the value cast.
VALUE_CASTS = CASTS - {aten.copy}


class ScoreFunctions:
    """E's modules as jit functions: the leaves bound to the scores, index values and tensor elements (the aux
    tensors' loads), the graph translated by the one pointwise translator, the index code it reads first."""

    def __init__(self, e: EGraph, code: IndexCode, aux: list[torch.fx.Node]) -> None:
        self.e = e
        self.code = code
        self.aux = aux
        # The aux tensors a gradient reaches in the functions emitted so far: one that requires a gradient but
        # enters only through ops none passes (a comparison) gets none, as eager gives it none.
        self.reached: set[int] = set()

    def _bind_leaves(self, module: torch.fx.GraphModule, lines: list[str]) -> dict[str, Operand]:
        """Operands for E's placeholders: s, index values, and tensor elements loaded for a gradient."""
        by_name = {n.name: n for n in self.e.graph.nodes if n.op == "placeholder"}
        env = {}
        for node in module.graph.nodes:
            if node.op != "placeholder":
                continue
            leaf = by_name.get(node.name)
            binding = self.e.leaves.get(leaf) if leaf is not None else None
            dtype = node.meta["val"].dtype
            zero_dim = node.meta["val"].dim() == 0
            if leaf is self.e.s_leaf:
                env[node.name] = Operand("s", dtype)
            elif isinstance(binding, Code):
                env[node.name] = Operand(binding.expr, binding.dtype, binding.zero_dim)
            elif isinstance(binding, GradLeaf):
                t = val(self.aux[binding.aux])
                load = load_text(binding.slot or binding.aux, binding.offset, binding.mask)
                if binding.slot is None and held_dtype(t.dtype) != t.dtype:
                    load += f".to({TRITON_DTYPE[held_dtype(t.dtype)]})"
                lines.append(f"{node.name} = {load}")
                env[node.name] = Operand(node.name, dtype, zero_dim)
        return env

    def score(self, name: str, module: torch.fx.GraphModule) -> str:
        lines: list[str] = []
        env = self._bind_leaves(module, lines)
        result = emit_graph(module, env, lines, "e")[0]
        value = f"({result.expr} + {SPLAT_OF_S})"
        if not result.rounded and linear_scale(module, self.e.s_leaf) is None:
            # The softmax reads the scores in their eager dtype: rounded to it as eager rounds them, so that a large
            # additive fill (fp16's finfo.min) absorbs the scores as eager's does, and a row that keeps no key weighs
            # its keys alike. A scale alone is left as the forward's full tiles fold it into the exponent.
            value = round_to(value, result.dtype)
        return self.code.function(name, "s, b, h, q_idx, kv_idx, aux", lines, f"return {value}.to(tl.float32)")

    def gradient(self, name: str, module: torch.fx.GraphModule, optional: bool = False) -> str | None:
        """The jit function of `module`'s gradient: d out/d s · ds returned, aux gradients accumulated. When
        `optional`, None where no gradient flows (a constant; the vector-Jacobian product reads ds wherever
        one does)."""
        placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
        by_name = {n.name: n for n in self.e.graph.nodes if n.op == "placeholder"}
        differentiable = [i for i, n in enumerate(placeholders) if by_name.get(n.name) is self.e.s_leaf
                          or isinstance(self.e.leaves.get(by_name.get(n.name)), GradLeaf)]
        backward = vjp_graph(module, differentiable)
        if optional and not reads_last_input(backward):
            return None
        lines: list[str] = []
        env = self._bind_leaves(module, lines)
        env_backward = {}
        backward_placeholders = [n for n in backward.graph.nodes if n.op == "placeholder"]
        for n, p in zip(backward_placeholders, placeholders + [None]):
            env_backward[n.name] = env[p.name] if p is not None else Operand("ds", torch.float32)
        grads = emit_graph(backward, env_backward, lines, "d")
        result = "tl.zeros_like(s)"
        for i, grad in zip(differentiable, grads):
            leaf = by_name.get(placeholders[i].name)
            if grad is None:
                continue
            if leaf is self.e.s_leaf:
                result = f"({grad.expr} + {SPLAT_OF_S}).to(tl.float32)"
            elif not _zero(grad.expr):  # a comparison's derivative is the literal 0: no gradient reaches it
                self.reached.add(self.e.leaves[leaf].aux)
                # The dQ kernel passes aux_grad=None: the dK/dV kernel alone accumulates aux gradients.
                lines.append("if aux_grad is not None:")
                lines += ["    " + line for line in accumulate(self.e.leaves[leaf], grad.expr)]
        return self.code.function(name, "s, ds, b, h, q_idx, kv_idx, aux, aux_grad", lines, f"return {result}")


def _zero(expr: str) -> bool:
    """Whether an emitted value is the literal zero."""
    try:
        return float(expr) == 0.0
    except ValueError:
        return False


def linear_scale(module: torch.fx.GraphModule, s_leaf: torch.fx.Node) -> float | None:
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
    is_s = isinstance(a, torch.fx.Node) and a.op == "placeholder" and a.name == s_leaf.name
    return float(c) if is_s and isinstance(c, (int, float)) and not isinstance(c, bool) and 0 < c < math.inf \
        else None


def accumulate(leaf: GradLeaf, grad: str) -> list[str]:
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


def reads_last_input(module: torch.fx.GraphModule) -> bool:
    """Whether any of `module`'s outputs is computed from its last placeholder."""
    reached = {[n for n in module.graph.nodes if n.op == "placeholder"][-1]}
    for node in module.graph.nodes:
        if node.op != "placeholder" and any(arg in reached for arg in node.all_input_nodes):
            reached.add(node)
    output = [n for n in module.graph.nodes if n.op == "output"][0]
    return output in reached


def vjp_graph(module: torch.fx.GraphModule, differentiable: list[int]) -> torch.fx.GraphModule:
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
    # does not depend on values, and a real trace of a few elements is several times cheaper than a fake one.
    return make_fx(vjp, tracing_mode="real")(*inputs, ds)


# Ops through which a value reaches a graph's output continuously, as the value of a sum, product, quotient or smooth
# function (or a selected branch): a value within its dtype's rounding moves the output as little. A comparison,
# a rounding or an integer cast would not.
_CONTINUOUS = {aten.add, aten.sub, aten.rsub, aten.mul, aten.div, aten.neg, aten.exp, aten.exp2, aten.tanh,
               aten.tanh_backward, aten.sigmoid, aten.where, aten.masked_fill}


def _continuous_uses(module: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The nodes whose every use reaches the output through `_CONTINUOUS` ops and casts between float dtypes."""
    continuous: set[torch.fx.Node] = set()
    for node in reversed(module.graph.nodes):
        if all(user.op == "output" or user in continuous and not user.kwargs.get("rounding_mode") and (
                packet(user) in _CONTINUOUS or packet(user) in VALUE_CASTS and val(user).dtype.is_floating_point)
               for user in node.users):
            continuous.add(node)
    return continuous


def emit_graph(module: torch.fx.GraphModule, env: dict[str, Operand], lines: list[str], prefix: str
                ) -> list[Operand | None]:
    """Translate a graph of pointwise ops; returns its outputs as operands."""
    values: dict[torch.fx.Node, Any] = {}
    continuous = _continuous_uses(module)
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
                               node.meta["val"].dtype, round_halves=False, continuous_uses=node in continuous)
            name = f"{prefix}{count}"
            count += 1
            lines.append(f"{name} = {result.expr}")
            values[node] = Operand(name, result.dtype, node.meta["val"].dim() == 0)
        elif node.op == "output":
            outs = node.args[0]
            outs = outs if isinstance(outs, (list, tuple)) else (outs,)
            return [values[o] if isinstance(o, torch.fx.Node) else None for o in outs]
    raise AssertionError("graph without output")


