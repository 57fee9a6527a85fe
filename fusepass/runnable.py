"""The graph a compiled callable runs: the reported graph less what would cost host time on every call.

- fusepass's own ops are called as the Python functions that implement them: through the dispatcher each
  call also passed the autograd and custom-op layers, host time on every forward and backward call that adds
  nothing inside a compiled graph, where AOTAutograd has already placed the backward;
- ``aten.detach`` nodes, which AOTAutograd adds to the values the forward saves for the backward, are
  dropped: the graphs run without autograd, where a detached tensor is the tensor;
- with the ``annotate`` option (`annotate_phase`), each op runs inside a profiler range naming its record (report/attribution.py).

`on_device` runs a compiled graph with its tensors' device current: Triton launches on the current device.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from fusepass.attention.call import call_named
from fusepass.attention.dynamic import spec_named as dynamic_spec_named
from fusepass.attention.op import run_attention, run_attention_backward
from fusepass.fx_util import hold
from fusepass.report import attribution
from fusepass.report.records import Rewrite

# fusepass's ops, as the compiled graph calls them: the spec each names is held by the graph (`fx_util.hold`).
_NAMED_BY = {
    torch.ops.fusepass.attention.default: call_named, run_attention: call_named,
    torch.ops.fusepass.attention_backward.default: call_named, run_attention_backward: call_named,
    torch.ops.fusepass.attention_dynamic.default: dynamic_spec_named,
    torch.ops.fusepass.attention_dynamic_backward.default: dynamic_spec_named,
}

_DIRECT_CALLS = {
    torch.ops.fusepass.attention.default: run_attention,
    torch.ops.fusepass.attention_backward.default: run_attention_backward,
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
    """A copy of `module` with direct calls for fusepass's ops and without detaches (`module` is unchanged:
    the report shows it); with `annotate_phase`, its ops run inside profiler ranges (`attribution.annotate`)."""
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
    if annotate_phase is not None:
        attribution.annotate(graph, annotate_phase, _attention_record)
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
