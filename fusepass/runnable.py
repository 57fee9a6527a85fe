"""The graph a compiled callable runs: the reported graph less what would cost host time on every call.

- fusepass's own ops are called as the Python functions that implement them: through the dispatcher each
  call also passed the autograd and custom-op layers (~30 µs forward and ~65 µs backward per attention call
  on the GPU machine, bench/results/launch-cost-*), which add nothing inside a compiled graph, where
  AOTAutograd has already placed the backward;
- ``aten.detach`` nodes, which AOTAutograd adds to the values the forward saves for the backward, are
  dropped: the graphs run without autograd, where a detached tensor is the tensor.
"""
from __future__ import annotations

import torch
import torch.fx

from fusepass.attention.op import run_attention, run_attention_backward

_DIRECT_CALLS = {
    torch.ops.fusepass.attention.default: run_attention,
    torch.ops.fusepass.attention_backward.default: run_attention_backward,
}


def copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    copy = torch.fx.Graph()
    output = copy.graph_copy(graph, {})
    copy.output(output)
    return copy


def runnable(module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of `module` with direct calls for fusepass's ops and without detaches (`module` is unchanged:
    the report shows it)."""
    graph = copy_graph(module.graph)
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is torch.ops.aten.detach.default:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
        elif node.target in _DIRECT_CALLS:
            node.target = _DIRECT_CALLS[node.target]
    return torch.fx.GraphModule(module, graph)
