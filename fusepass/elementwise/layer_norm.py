"""`nn.LayerNorm`'s ops written out as the row reductions, column sums and pointwise ops they compute, where those
fuse.

``native_layer_norm`` is one ATen kernel that reads its input and writes its output: written out, it joins the
residual add before it and the ops after it in one row kernel. Its backward, ``native_layer_norm_backward``, is
two (the input's gradient; the weight's and bias's, sums over the rows): written out, one row kernel computes the
input's gradient beside the ops around it and adds up the weight's and bias's (column sums, ``row_kernel``). Each
is written out only where the whole of it lands in one fused group (``fuse`` tries it on a copy of the graph
first): left in pieces, it would run as several ATen kernels where eager runs one or two. Computed as eager's
kernels compute them: in float32 for half precision, the biased variance, each output rounded once.
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from fusepass.elementwise import reduction
from fusepass.fx_util import Writer, val

aten = torch.ops.aten
FLOATING = (torch.float16, torch.bfloat16, torch.float32)


def _over_last_dim(node: torch.fx.Node, x: torch.fx.Node, shape: list, min_rank: int) -> bool:
    """A norm of `x` over its last dim, every tensor it reads floating, each of its outputs read by index."""
    # a normalized shape read off a symbolic size is a graph value, not a tensor: the norm stays ATen's
    tensors = [val(a) for a in node.all_input_nodes]
    return (isinstance(val(x), torch.Tensor) and val(x).dim() >= min_rank and len(shape) == 1 and
            all(isinstance(t, torch.Tensor) and t.dtype in FLOATING for t in tensors) and
            all(user.target is operator.getitem for user in node.users))


def _eligible(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target == aten.native_layer_norm.default and \
        _over_last_dim(node, node.args[0], node.args[1], 1)


def _computed_in(dtype: torch.dtype) -> torch.dtype:
    """Eager's kernels compute a half-precision norm in float32 (on the CPU too, where they save its mean and
    deviation rounded to the half dtype)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _eligible_backward(node: torch.fx.Node) -> bool:
    """The backward of a norm over the last dim of rows short enough to be held whole (its weight's and bias's
    gradients are column sums)."""
    if node.op != "call_function" or node.target != aten.native_layer_norm_backward.default or \
            not _over_last_dim(node, node.args[1], node.args[2], 2):
        return False
    return reduction.held_whole(val(node.args[1]).shape[-1])


def _backward(w: Writer, node: torch.fx.Node) -> list[torch.fx.Node | None]:
    """dx = rstd · (g − mean(g) − x̂ · mean(g · x̂)), g = dy · weight; the weight's gradient Σ dy · x̂ and the
    bias's Σ dy over the rows."""
    dy, x, _, mean, rstd, weight, bias, _ = node.args
    acc = _computed_in(val(x).dtype)
    rows = list(range(val(x).dim() - 1))
    dyf = w.cast(dy, acc)
    rstd = w.cast(rstd, acc)  # saved in the input's half dtype on the CPU
    xhat = w(aten.mul.Tensor, w(aten.sub.Tensor, w.cast(x, acc), w.cast(mean, acc)), rstd)
    g = dyf if weight is None else w(aten.mul.Tensor, dyf, w.cast(weight, acc))
    mean_g = w(aten.mean.dim, g, [-1], True)
    mean_gx = w(aten.mean.dim, w(aten.mul.Tensor, g, xhat), [-1], True)
    dx = w(aten.mul.Tensor, rstd, w(aten.sub.Tensor, w(aten.sub.Tensor, g, mean_g), w(aten.mul.Tensor, xhat, mean_gx)))
    outputs = {u.args[1] for u in node.users}
    dw = w.cast(w(aten.sum.dim_IntList, w(aten.mul.Tensor, dyf, xhat), rows), val(weight).dtype) \
        if 1 in outputs else None
    db = w.cast(w(aten.sum.dim_IntList, dyf, rows), val(bias).dtype) if 2 in outputs else None
    return [w.cast(dx, val(x).dtype), dw, db]


def _forward(w: Writer, node: torch.fx.Node) -> list[torch.fx.Node]:
    x, _, weight, bias, eps = node.args
    xf = w.cast(x, _computed_in(val(x).dtype))
    mean = w(aten.mean.dim, xf, [-1], True)
    centered = w(aten.sub.Tensor, xf, mean)
    variance = w(aten.mean.dim, w(aten.mul.Tensor, centered, centered), [-1], True)
    rstd = w(aten.rsqrt.default, w(aten.add.Tensor, variance, eps))
    y = w(aten.mul.Tensor, centered, rstd)
    if weight is not None:
        y = w(aten.mul.Tensor, y, weight)
    if bias is not None:
        y = w(aten.add.Tensor, y, bias)
    return [w.cast(y, val(x).dtype), mean, rstd]


def write_out(graph: torch.fx.Graph, node: torch.fx.Node) -> list[torch.fx.Node]:
    """Replace `node` by the ops it computes; the new nodes."""
    before = set(graph.nodes)
    writer = Writer(graph, node)
    results = _forward(writer, node) if node.target == aten.native_layer_norm.default else _backward(writer, node)
    for user in list(node.users):
        replacement = results[user.args[1]]
        if val(replacement).dtype != val(user).dtype:  # the saved mean and deviation, as eager keeps them
            replacement = writer.cast(replacement, val(user).dtype)
        user.replace_all_uses_with(replacement)
        graph.erase_node(user)
    graph.erase_node(node)
    return [n for n in graph.nodes if n not in before]


def candidates(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    return [n for n in graph.nodes if _eligible(n) or _eligible_backward(n)]
