"""FX helpers every pass shares: a node's value, its op, what a pass inserts, what a graph keeps alive."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.fx
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

aten = torch.ops.aten


def val(node: torch.fx.Node) -> Any:
    """The node's fake value (a tensor, a list of them, a size)."""
    return node.meta["val"]


def packet(node: object) -> Any:
    """The ATen op a node calls (``aten.mul``, every overload of it), or None."""
    return getattr(getattr(node, "target", None), "overloadpacket", None)


def op_name(node: torch.fx.Node) -> str:
    """``aten.matmul``, ``fusepass.attention``, or a launcher's kernel name: how the report names an op."""
    op = packet(node)
    if op is not None:
        return op._qualified_op_name.replace("::", ".")
    return getattr(node.target, "__name__", str(node.target))


def fake_mode_of(nodes: Iterable[torch.fx.Node]) -> FakeTensorMode | None:
    """The fake mode of the first of `nodes`' inputs that has a fake value."""
    return next((n.meta["val"].fake_mode for node in nodes for n in node.all_input_nodes
                 if isinstance(n.meta.get("val"), FakeTensor)), None)


def infer_meta(nodes: Iterable[torch.fx.Node], fake_mode: FakeTensorMode | None = None) -> None:
    """Give the nodes a pass inserted, in graph order, what later passes read of the nodes they meet: a fake
    value (``meta["val"]``: the target run on its inputs' fake values, in the graph's fake mode) and whether a
    gradient reaches it (``meta["requires_grad"]``, as `capture.mark_requires_grad` marks the graph)."""
    nodes = list(nodes)
    # The values' own mode: a graph planned apart from Dynamo's (attention/dynamic.py) has its own. The Python
    # dispatcher, as Dynamo's tracing has it: some fake kernels take symbolic sizes only through it (baddbmm's
    # expand of a broadcast input, BLOOM's ALiBi).
    with fake_mode_of(nodes) or fake_mode or FakeTensorMode(), enable_python_dispatcher():
        for node in nodes:
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
            node.meta["val"] = node.target(*args, **kwargs)
            node.meta["requires_grad"] = any(n.meta.get("requires_grad", False) for n in node.all_input_nodes)


class Writer:
    """Inserts ATen ops before a node, each with what later passes read of it (`infer_meta`)."""

    def __init__(self, graph: torch.fx.Graph, at: torch.fx.Node) -> None:
        self.graph, self.at = graph, at
        self.fake_mode = fake_mode_of([at])  # for an op of no tensor inputs (a range)

    def __call__(self, target: Callable, *args, **kwargs) -> torch.fx.Node:
        with self.graph.inserting_before(self.at):
            node = self.graph.call_function(target, args, kwargs)
        node.meta.update({k: v for k, v in self.at.meta.items() if k in ("stack_trace", "nn_module_stack",
                                                                          "source_fn_stack")})
        infer_meta([node], self.fake_mode)
        return node

    def cast(self, x: torch.fx.Node, dtype: torch.dtype) -> torch.fx.Node:
        return x if val(x).dtype == dtype else self(aten._to_copy.default, x, dtype=dtype)


HELD = "fusepass_held"  # a GraphModule attribute: what it keeps alive for the ops its nodes name


def hold(module: torch.fx.GraphModule, *objects: object) -> None:
    """Keep `objects` alive as long as `module` (the registries of attention specs hold them weakly, so that a
    spec lives as long as the graphs that call it by name)."""
    module.__dict__.setdefault(HELD, []).extend(objects)
