"""The elementwise pass: partition the graph's pointwise ops, replace each group by its kernel.

Its fixed shape: group (``partition``), lower each group to a program (``lower``), replace the group by a
call of its launcher, record what was fused and what was not.
"""
from __future__ import annotations

import operator
import re

import torch
import torch.fx
from torch.fx.passes.tools_common import legalize_graph

from fusepass.codegen.translate import constant_value, packet_of
from fusepass.context import PassContext
from fusepass.elementwise import layer_norm
from fusepass.elementwise.kernel import PointwiseLauncher
from fusepass.elementwise.lower import Lowered, NotLowerable, lower
from fusepass.elementwise.pieces import is_piecewise
from fusepass.elementwise.reduction import is_reduction
from fusepass.elementwise.partition import Group, is_constant, partition, root_shape
from fusepass.elementwise.row_kernel import RowLauncher, row_layout, walked_bytes
from fusepass.elementwise.views import move_views
from fusepass.fx_util import op_name
from fusepass.report import attribution, profile, roofline
from fusepass.report.ledger import elementwise_rewrite, op_bytes, op_flops, unfused_bytes, value_bytes
from fusepass.report.records import Hotspot, Rewrite
from fusepass.source import first_location, keep_location, location


def kernel_name(group: Group) -> str:
    """``fused_mul_add_gelu``: the group's ops in order, readable in the rewritten graph."""
    names = []
    for node in group.compute_nodes:
        name = re.sub(r"\W", "", packet_of(node.target).__name__.strip("_"))
        if name not in names and name not in ("detach", "alias"):
            names.append(name)
    return "fused_" + "_".join(names[:6])


def lowerable_partition(graph: torch.fx.Graph, device: torch.device, reductions: bool = True
                        ) -> tuple[list[Group], list]:
    """`partition`, with the row reductions, column sums, cats and slice_backwards of a group that cannot be lowered
    (one read in another row than it reduces, a cat read along another dim than one of the group's) left as ATen
    ops, and the rest grouped again; without `reductions`, every reduction."""
    apart = frozenset() if reductions else frozenset(n for n in graph.nodes if is_reduction(n))
    while True:
        groups, declined = partition(graph, device, apart)
        unlowerable = set()
        for group in groups:
            if root_shape(group.nodes) is None and not any(map(is_piecewise, group.nodes)):
                continue
            try:
                lower(group, device)
            except NotLowerable:
                unlowerable |= {n for n in group.nodes if is_reduction(n) or is_piecewise(n)}
        if not unlowerable:
            return groups, declined
        apart |= unlowerable


def write_out_layer_norms(graph: torch.fx.Graph, device: torch.device) -> None:
    """Write out each `native_layer_norm` whose ops, written out, all land in one fused group (tried on a copy)."""
    found = layer_norm.candidates(graph)
    if not found:
        return
    trial, copies = torch.fx.Graph(), {}
    trial.output(trial.graph_copy(graph, copies))
    written = {node: layer_norm.write_out(trial, copies[node]) for node in found}
    groups, _ = lowerable_partition(trial, device)
    group_of = {member: i for i, group in enumerate(groups) for member in group.nodes}
    for node, new in written.items():
        if len({group_of.get(n) for n in new}) == 1 and new[0] in group_of:
            layer_norm.write_out(graph, node)


def fuse_elementwise(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    move_views(gm.graph, ctx.device)
    if ctx.options.reductions and ctx.run_kernels:
        write_out_layer_norms(gm.graph, ctx.device)
    groups, declined = lowerable_partition(gm.graph, ctx.device, ctx.options.reductions)
    for d in declined:
        hotspot = Hotspot(kind="elementwise", phase=ctx.phase, location=location(d.node), reason=d.reason,
                          ops=(op_name(d.node),), bytes=op_bytes(d.node), flops=op_flops(d.node))
        ctx.report.hotspots.append(hotspot)
        attribution.tag(d.node, hotspot)
    changed = False
    for group in groups:
        ops = tuple(op_name(n) for n in group.compute_nodes)
        where = first_location(group.nodes)
        try:
            # Lowered again (lowerable_partition tried it on the graph as it was): a group replaced before this
            # one has rewired its inputs.
            lowered = lower(group, ctx.device)
            # Recorded before the graph changes: the ledger reads the group's nodes as they are.
            root = root_shape(group.nodes)
            extra = 0 if root is None else walked_bytes(lowered, [value_bytes(n) for n in group.inputs], ctx.device)
            detail = {"kernel": kernel_name(group),
                      "shape": list(map(str, root if root is not None else group.outputs[0].meta["val"].shape))}
            layout = None if root is None else row_layout(lowered, ctx.device)
            if layout is not None:
                detail["row kernel"] = layout
            record = elementwise_rewrite(ctx.phase, where, ops, group.compute_nodes, group.inputs, group.outputs,
                                         detail=detail, kind="elementwise" if root is None else "reduction",
                                         extra_bytes=extra)
            if ctx.run_kernels:
                _replace(gm, group, lowered, ctx, where, ops, record)
                changed = True
        except Exception as error:
            ctx.fallback("elementwise", where, "fusion failed", error, ops, unfused_bytes(group.compute_nodes))
            continue
        ctx.report.rewrites.append(record)
    if changed:
        legalize_graph(gm)
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return gm


def fallback_module(group: Group, inputs: list[torch.fx.Node]) -> torch.fx.GraphModule:
    """The group's own ops as a module: what runs if its kernel cannot."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for i, node in enumerate(inputs):
        env[node] = graph.placeholder(f"input_{i}")

    def lookup(node: torch.fx.Node) -> torch.fx.Node:
        if node not in env and is_constant(node):
            val = node.meta["val"]
            value = constant_value(packet_of(node.target), node.args, node.kwargs)
            env[node] = graph.call_function(torch.ops.aten.full.default, (list(val.shape), value),
                                            {"dtype": val.dtype, "device": val.device})
        return env[node]

    for node in group.nodes:
        env[node] = graph.node_copy(node, lookup)
    graph.output(tuple(env[o] for o in group.outputs))
    return torch.fx.GraphModule({}, graph)


def _replace(gm: torch.fx.GraphModule, group: Group, lowered: Lowered, ctx: PassContext, where: str,
             ops: tuple[str, ...], record: Rewrite) -> None:
    name = kernel_name(group)
    inputs = group.inputs
    fallback = fallback_module(group, inputs)
    failure_bytes = unfused_bytes(group.compute_nodes)

    def on_failure(error: Exception) -> None:
        ctx.fallback("elementwise", where, f"kernel {name} failed", error, ops, failure_bytes, withdrawn=[record])
        roofline.estimate(ctx.report)  # the report was estimated when compiled; this hotspot came after

    kind = RowLauncher if root_shape(group.nodes) is not None else PointwiseLauncher
    launcher = kind(name, lowered, ctx.device, fallback, on_failure, profile.first_call_profiler(record, ctx.device),
                    ctx.options.replay)
    graph = gm.graph
    members = set(group.nodes)
    with graph.inserting_before(group.nodes[0]):
        call = graph.call_function(launcher, tuple(inputs))
        call.meta["val"] = tuple(out.meta["val"] for out in group.outputs)
        keep_location(call, group.nodes[0])
        attribution.tag(call, record)
        results = []
        for i, out in enumerate(group.outputs):
            item = graph.call_function(operator.getitem, (call, i))
            item.meta.update(out.meta)
            results.append(item)
    for out, item in zip(group.outputs, results):
        out.replace_all_uses_with(item, delete_user_cb=lambda user: user not in members or user in group.kept_views)
    for node in reversed(group.nodes):
        if node not in group.kept_views and not node.users:
            graph.erase_node(node)
