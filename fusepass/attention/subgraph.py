"""The ops an attention rewrite replaces, and those ops as a module of their own.

The module runs what the rewrite removed: to time it against the fused op (``FUSEPASS_PROFILE``), and,
where sizes are symbolic, to trace it again at each concrete size (``dynamic``).
"""
from __future__ import annotations

import torch
import torch.fx

from fusepass.attention.match import AttentionMatch


def removed_nodes(m: AttentionMatch) -> list[torch.fx.Node]:
    return [m.qk, *m.chain, m.softmax, *m.probability_path, m.pv]


def replaced_subgraph(graph: torch.fx.Graph, removed: list[torch.fx.Node], kept: list[torch.fx.Node]
                      ) -> list[torch.fx.Node]:
    """The matched ops and every op only they use (a mask's construction, repeated K/V heads, views):
    what the rewrite leaves dead, in graph order. ``kept``: what the fused op reads."""
    dead = set(removed)
    for node in reversed(graph.nodes):
        if node.op == "call_function" and node not in dead and node not in kept and node.users and \
                all(user in dead for user in node.users):
            dead.add(node)
    return [n for n in graph.nodes if n in dead]


def subgraph_module(replaced: list[torch.fx.Node], leading: list[torch.fx.Node], output: torch.fx.Node
                    ) -> tuple[torch.fx.GraphModule, list[torch.fx.Node]]:
    """The replaced ops as a module of (``leading``, then whatever else they read); and that whatever else."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    members = set(replaced)
    # The trace's constants among them (`with_built_from_sizes`) come along.
    constants = {n.target: getattr(n.graph.owning_module, n.target) for n in replaced if n.op == "get_attr"}
    extra = [a for n in replaced for a in n.all_input_nodes if a not in members and a not in leading]
    extra = list(dict.fromkeys(extra))
    for i, node in enumerate(leading + extra):
        env.setdefault(node, graph.placeholder(f"input_{i}"))
    for node in replaced:
        env[node] = graph.node_copy(node, env.__getitem__)
    graph.output((env[output],))
    return torch.fx.GraphModule(constants, graph), extra


def with_recomputed(replaced: list[torch.fx.Node], leading: list[torch.fx.Node]) -> list[torch.fx.Node]:
    """``replaced`` and the ops outside it that compute, from ``leading``, what it reads with a gradient (a bias
    several attentions share, built from a table the score functions read), in graph order: a module of these
    computes gradients that reach what the fused op's reach."""
    members = set(replaced) | _recomputed(replaced, set(leading))
    return [n for n in replaced[0].graph.nodes if n in members]


def _recomputed(replaced: list[torch.fx.Node], leading: set[torch.fx.Node]) -> set[torch.fx.Node]:
    """Deterministic call_functions with a gradient that the replaced ops read, and theirs, up to ``leading``."""
    found: set[torch.fx.Node] = set()
    pending = [a for n in replaced for a in n.all_input_nodes]
    members = set(replaced)
    while pending:
        node = pending.pop()
        if node in found or node in members or node in leading or node.op != "call_function" or \
                not node.meta.get("requires_grad") or _random(node):
            continue
        found.add(node)
        pending.extend(node.all_input_nodes)
    return found


def with_built_from_sizes(replaced: list[torch.fx.Node]) -> list[torch.fx.Node]:
    """``replaced`` and the tensors it reads that are computed from sizes and constants alone, with what computes
    them, in graph order: a mask a model builds once from ``arange`` for all its layers. Where sizes are symbolic
    the module computes such a tensor itself, so that each size's plan lifts it into index code (no load per tile,
    no sizes in the score functions' source) instead of reading it as an input."""
    memo: dict[torch.fx.Node, bool] = {}
    members = set(replaced)
    pending = [a for n in replaced for a in n.all_input_nodes]
    while pending:
        node = pending.pop()
        if node in members or not isinstance(node.meta.get("val"), torch.Tensor) or \
                not _built_from_sizes(node, memo):
            continue
        members.add(node)
        pending.extend(node.all_input_nodes)
    return [n for n in replaced[0].graph.nodes if n in members]


def _built_from_sizes(node: torch.fx.Node, memo: dict[torch.fx.Node, bool]) -> bool:
    """Whether a deterministic op computes the node's tensor from sizes and constants alone (no input tensor): a
    constant of the trace (``torch.tensor(0.0)``) is one."""
    if node not in memo:
        memo[node] = node.op == "get_attr" or node.op == "call_function" and not _random(node) and \
            not node.meta.get("requires_grad") and \
            all(_number(a) or _built_from_sizes(a, memo) for a in node.all_input_nodes)
    return memo[node]


def _number(node: torch.fx.Node) -> bool:
    """Whether the node's value is a number (a size), not a tensor or what holds tensors."""
    return isinstance(node.meta.get("val"), (int, float, torch.SymInt, torch.SymFloat, torch.SymBool))


def _random(node: torch.fx.Node) -> bool:
    return torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())
