"""Dynamo's torch-level graph → a functional ATen graph, traced before autograd.

Every pass then reads one op vocabulary (``aten.matmul``, ``aten.softmax.int``, ``aten.to.dtype``, …) that
still looks like the user's code, with the user's source line in each node's ``meta["stack_trace"]``.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx


def fake_mode_of(example_inputs: Sequence[object]) -> FakeTensorMode:
    return detect_fake_mode(example_inputs) or FakeTensorMode(allow_non_fake_inputs=True)


def capture(gm: torch.fx.GraphModule, example_inputs: Sequence[object]) -> torch.fx.GraphModule:
    fake_mode = fake_mode_of(example_inputs)
    fake_inputs = [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs]
    with fake_mode, torch.fx.traceback.preserve_node_meta():
        traced = make_fx(torch.fx.Interpreter(gm).run, pre_dispatch=True)(*fake_inputs)
    mark_requires_grad(traced.graph, example_inputs)
    return traced


def mark_requires_grad(graph: torch.fx.Graph, example_inputs: Sequence[object]) -> None:
    """``node.meta["requires_grad"]``: whether a gradient will flow to the node's value (the fake values
    of a graph traced before autograd do not say)."""
    inputs = iter(example_inputs)
    grad_mode = torch.is_grad_enabled()  # Dynamo compiles under the caller's grad mode
    for node in graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder":
            x = next(inputs, None)
            node.meta["requires_grad"] = grad_mode and bool(getattr(x, "requires_grad", False))
        elif node.op == "call_function":
            differentiable = isinstance(val, torch.Tensor) and val.is_floating_point() and \
                node.target is not torch.ops.aten.detach.default
            node.meta["requires_grad"] = differentiable and any(
                a.meta.get("requires_grad", False) for a in node.all_input_nodes)
