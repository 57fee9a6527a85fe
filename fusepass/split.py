"""Graphs with higher-order ops (an autograd.Function, activation checkpointing, ...): fusepass compiles the
regions between them and leaves each such op to run as Dynamo captured it.

Tracing to ATen would inline them and lose what they mean: an autograd.Function's own backward, a
checkpoint's recomputation. So the graph is split at each one; the pieces around it go through the
pipeline on their own, with the fake values of their inputs as examples.
"""
from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.fx.passes.split_module import split_module

from fusepass.capture import fake_mode_of


def is_higher_order(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator)


def has_higher_order_ops(gm: torch.fx.GraphModule) -> bool:
    return any(is_higher_order(n) for n in gm.graph.nodes)


def compile_around_higher_order_ops(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                                    compile_piece: Callable[[torch.fx.GraphModule, list[Any]], Callable[..., Any]]
                                    ) -> Callable[..., Any]:
    """Split ``gm`` so that each higher-order op sits in a piece of its own; compile the other pieces."""
    piece, pieces = 0, {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        if is_higher_order(node):
            piece += 1
            pieces[node] = piece
            piece += 1
        elif node.target is operator.getitem and node.args[0] in pieces and is_higher_order(node.args[0]):
            pieces[node] = pieces[node.args[0]]  # its results are taken apart beside it
        else:
            pieces[node] = piece
    own: set[str] = set()
    for node, index in pieces.items():
        if is_higher_order(node):
            own.add(f"submod_{index}")

    split = split_module(gm, None, lambda node: pieces[node], keep_original_order=True)
    fake_mode = fake_mode_of(example_inputs)
    fakes = [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs]
    FakeTensorProp(split, fake_mode).propagate(*fakes)
    needs_grad = _needs_grad(split.graph, example_inputs)
    for node in split.graph.nodes:
        if node.op != "call_module" or node.target in own:
            continue
        inputs = [_example(a.meta["val"], needs_grad[a], fake_mode) for a in node.args]
        module = getattr(split, node.target)
        single = _return_a_tuple(module)
        setattr(split, node.target, _Piece(compile_piece(module, inputs), single))
    return split.forward


def _needs_grad(graph: torch.fx.Graph, example_inputs: Sequence[Any]) -> dict[torch.fx.Node, bool]:
    """Whether a gradient flows to each value (the fake values a higher-order op returns do not say)."""
    inputs = iter(example_inputs)
    flags: dict[torch.fx.Node, bool] = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            flags[node] = bool(getattr(next(inputs, None), "requires_grad", False))
        else:
            flags[node] = any(flags.get(a, False) for a in node.all_input_nodes)
    return flags


def _example(val: Any, requires_grad: bool, fake_mode: Any) -> Any:
    """A fresh fake input for a piece, marked as needing a gradient where one flows to it."""
    if not isinstance(val, torch.Tensor):
        return val
    with fake_mode:
        fresh = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device)
    return fresh.requires_grad_(requires_grad and val.is_floating_point())


def _return_a_tuple(module: torch.fx.GraphModule) -> bool:
    """Make the piece return a tuple, as AOTAutograd wants; True if it returned a single value."""
    output = next(n for n in module.graph.nodes if n.op == "output")
    if isinstance(output.args[0], (tuple, list)):
        return False
    output.args = ((output.args[0],),)
    module.recompile()
    return True


class _Piece(torch.nn.Module):
    """A compiled piece standing where its submodule stood."""

    def __init__(self, compiled: Callable[..., Any], single: bool) -> None:
        super().__init__()
        self.compiled = compiled
        self.single = single

    def forward(self, *args: Any) -> Any:
        out = self.compiled(*args)
        return out[0] if self.single else out
