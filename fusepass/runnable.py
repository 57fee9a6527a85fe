"""The graph a compiled callable runs: the reported graph less what would cost host time on every call.

- fusepass's own ops are called as the Python functions that implement them: through the dispatcher each
  call also passed the autograd and custom-op layers, host time on every forward and backward call that adds
  nothing inside a compiled graph, where AOTAutograd has already placed the backward;
- ``aten.detach`` nodes, which AOTAutograd adds to the values the forward saves for the backward, are
  dropped: the graphs run without autograd, where a detached tensor is the tensor;
- the ATen ops a step calls most (views, matrix products) are called through torch's Python bindings
  (`BINDINGS`), which take the overload's arguments as the graph holds them: an op overload's call takes the
  dispatcher's boxed path, more host time per call (bench/host_by_op.py, bench/NOTES.md);
- with the ``annotate`` option (`annotate_phase`), each op runs inside a profiler range naming its record (report/attribution.py).

`on_device` runs a compiled graph with its tensors' device current: Triton launches on the current device.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from fusepass.attention.call import call_named
from fusepass.attention.dynamic import run_attention_dynamic, run_attention_dynamic_backward
from fusepass.attention.dynamic import spec_named as dynamic_spec_named
from fusepass.attention.op import run_attention, run_attention_backward
from fusepass.fx_util import hold
from fusepass.report import attribution
from fusepass.report.records import Rewrite

# fusepass's ops, as the compiled graph calls them: the spec each names is held by the graph (`fx_util.hold`).
_NAMED_BY = {
    torch.ops.fusepass.attention.default: call_named, run_attention: call_named,
    torch.ops.fusepass.attention_backward.default: call_named, run_attention_backward: call_named,
    torch.ops.fusepass.attention_dynamic.default: dynamic_spec_named, run_attention_dynamic: dynamic_spec_named,
    torch.ops.fusepass.attention_dynamic_backward.default: dynamic_spec_named,
    run_attention_dynamic_backward: dynamic_spec_named,
}

_DIRECT_CALLS = {
    torch.ops.fusepass.attention.default: run_attention,
    torch.ops.fusepass.attention_backward.default: run_attention_backward,
    torch.ops.fusepass.attention_dynamic.default: run_attention_dynamic,
    torch.ops.fusepass.attention_dynamic_backward.default: run_attention_dynamic_backward,
}


aten = torch.ops.aten
# Each overload → the binding that selects it from the same arguments (positional and keyword, as the graph's
# node holds them); tests/test_runnable.py checks each against its overload.
BINDINGS: dict[Any, Callable[..., Any]] = {
    aten.view.default: torch.Tensor.view,
    aten.t.default: torch.t,
    aten.transpose.int: torch.transpose,
    aten.permute.default: torch.permute,
    aten.expand.default: torch.Tensor.expand,
    aten.unsqueeze.default: torch.unsqueeze,
    aten.mm.default: torch.mm,
    aten.bmm.default: torch.bmm,
    aten.addmm.default: torch.addmm,
    aten.clone.default: torch.clone,
    aten.cat.default: torch.cat,
    aten.sum.dim_IntList: torch.sum,
    aten.gelu.default: torch.nn.functional.gelu,
    aten.add.Tensor: torch.add,
    aten.mul.Tensor: torch.mul,
    aten.empty.memory_format: torch.empty,
}


def copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    copy = torch.fx.Graph()
    output = copy.graph_copy(graph, {})
    copy.output(output)
    return copy


def _attention_record(node: torch.fx.Node) -> Rewrite | None:
    """The record of an attention op: its call's forward or backward record (a dynamic one's has none)."""
    if node.target not in (run_attention, run_attention_backward):
        return None
    unfused = call_named(node.args[-1]).unfused
    return unfused.forward_record if node.target is run_attention else unfused.backward_record


def runnable(module: torch.fx.GraphModule, annotate_phase: str | None = None) -> torch.fx.GraphModule:
    """A copy of `module` with direct calls for fusepass's ops and torch's bindings for ATen's most called, without
    detaches (`module` is unchanged: the report shows it); with `annotate_phase`, its ops (as overloads) run inside
    profiler ranges (`attribution.annotate`)."""
    graph = copy_graph(module.graph)
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is torch.ops.aten.detach.default:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
        elif node.target in _DIRECT_CALLS:
            node.target = _DIRECT_CALLS[node.target]
    held = [_NAMED_BY[n.target](n.args[-1]) for n in graph.nodes if n.target in _NAMED_BY]
    if annotate_phase is not None:  # its ranges name the ops by their overloads
        attribution.annotate(graph, annotate_phase, _attention_record)
    else:
        for node in graph.nodes:
            if node.op == "call_function" and node.target in BINDINGS:
                node.target = BINDINGS[node.target]
    result = torch.fx.GraphModule(module, graph)
    hold(result, *held)
    return result


def on_device(fn: Callable[..., Any], device: torch.device) -> Callable[..., Any]:
    """`fn` run with `device` the current CUDA device, where the graph's tensors live: Triton launches its
    kernels on the current device, and a model may live on another (cuda:1 while cuda:0 is current)."""
    if device.type != "cuda" or device.index is None:
        return fn
    index = device.index

    def run(*args: Any) -> Any:
        if torch.cuda.current_device() == index:
            return fn(*args)
        with torch.cuda.device(index):
            return fn(*args)

    return run
