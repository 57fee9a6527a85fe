"""`nn.LayerNorm`'s forward op written out as the row reductions and pointwise ops it computes, where those fuse.

``native_layer_norm`` is one ATen kernel that reads its input and writes its output: written out, it joins the
residual add before it and the ops after it in one row kernel. It is written out only where the whole of it
lands in one fused group (``fuse`` tries it on a copy of the graph first): left in pieces, it would run as
several ATen kernels where eager runs one. Computed as eager's kernel computes it: in the dtype of the saved
mean and reciprocal deviation (float32 for half precision), the biased variance, the output rounded once. Its
backward stays ATen's (one kernel for the input's gradient, one for the weight's and bias's): written out, the
weight's gradient would be a sum over rows of a tensor the row kernel writes.
"""
from __future__ import annotations

import operator
import torch
import torch.fx

from fusepass.fx_util import Writer, val

aten = torch.ops.aten
FLOATING = (torch.float16, torch.bfloat16, torch.float32)


def _eligible(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or node.target != aten.native_layer_norm.default:
        return False
    x, shape = val(node.args[0]), node.args[1]
    # a normalized shape read off a symbolic size is a graph value, not a tensor: the norm stays ATen's
    tensors = [val(a) for a in node.all_input_nodes]
    return (isinstance(x, torch.Tensor) and x.dim() >= 1 and len(shape) == 1 and
            all(isinstance(t, torch.Tensor) and t.dtype in FLOATING for t in tensors) and
            all(user.target is operator.getitem for user in node.users))


def _forward(w: Writer, node: torch.fx.Node) -> list[torch.fx.Node]:
    x, _, weight, bias, eps = node.args
    outputs = {u.args[1]: u for u in node.users}
    acc = val(outputs[1]).dtype if 1 in outputs else (torch.float32 if val(x).dtype in FLOATING[:2] else val(x).dtype)
    xf = w.cast(x, acc)
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
    results = _forward(writer, node)
    for user in list(node.users):
        replacement = results[user.args[1]]
        if val(replacement).dtype != val(user).dtype:  # the saved mean and deviation, as eager keeps them
            replacement = writer.cast(replacement, val(user).dtype)
        user.replace_all_uses_with(replacement)
        graph.erase_node(user)
    graph.erase_node(node)
    return [n for n in graph.nodes if n not in before]


def candidates(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    return [n for n in graph.nodes if _eligible(n)]
