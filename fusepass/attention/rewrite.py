"""The attention pass: each ``matmul → softmax → matmul`` becomes one call of the fused attention op.

Its fixed shape: match (``match``), read the operands' layouts (``layout``), lift the score chain
(``lift``), then replace the matched ops by ``torch.ops.fusepass.attention`` and record the rewrite. A
declined match leaves the graph exactly as it was and becomes a hotspot with its reason.
"""
from __future__ import annotations

import itertools
import operator
from dataclasses import replace

import torch
import torch.fx

from fusepass.attention.call import AttentionCall, register
from fusepass.attention.cost import attention_records
from fusepass.attention.dynamic import reads_symbolic_ints, rewrite_dynamic
from fusepass.attention.known_contents import ContentGuard, ContentsChanged, describe, known_input
from fusepass.attention.layout import Unsupported
from fusepass.attention.match import AttentionMatch, Operands, match, softmaxes
from fusepass.attention.plan import AttentionSpec, plan
from fusepass.attention.subgraph import removed_nodes, replaced_subgraph, subgraph_module, with_recomputed
from fusepass.attention.unfused import Unfused
from fusepass.context import PassContext, mark_planned
from fusepass.fx_util import hold, infer_meta, packet, val
from fusepass.report.ledger import op_bytes
from fusepass.report.records import KNOWN_CONTENTS, Hotspot, Rewrite
from fusepass.source import keep_location, location

aten = torch.ops.aten


_names = itertools.count()  # each rewrite's op spec by a name of its own, for the process's life


def _static(m: AttentionMatch) -> bool:
    return all(isinstance(s, int) for node in (m.qk, m.pv) for s in val(node).shape)


def _unfused_hotspot(softmax: torch.fx.Node, reason: str) -> Hotspot:
    """An attention left as its ops: what it keeps moving, the scores and the probabilities written and read."""
    return Hotspot(kind="attention", phase="forward", location=location(softmax), reason=reason,
                   ops=("aten.softmax",), bytes=2 * op_bytes(softmax))


def list_unfused_attention(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    """With the attention pass off (``attention=False``), each attention the pass would have matched is a hotspot."""
    for softmax in softmaxes(gm.graph):
        try:
            match(softmax)
        except Unsupported:
            continue
        ctx.report.hotspots.append(_unfused_hotspot(softmax, "the attention rewrite is off (attention=False)"))
    return gm


def rewrite_attention(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    graph = gm.graph
    changed = False
    # SDPA keeps its autograd graph in Python for the backward, which a graph replayed whole skips
    sdpa = ctx.options.sdpa and not ctx.options.graphs
    for softmax in softmaxes(graph):
        where = location(softmax)
        name = f"attention_{next(_names)}"
        try:
            m = match(softmax)
            if not _static(m) or reads_symbolic_ints(graph, m):
                ctx.report.rewrites.extend(rewrite_dynamic(graph, m, ctx, name, where, rewrite_attention))
                changed = changed or ctx.run_kernels
                continue
            spec, sources, features = plan(m, name, ctx.options.replay, ctx.sizes_vary, sdpa)
            # The op's inputs: Q, K and V's sources, what the score functions read, the buffers read as the bands
            # they hold (for their guards), then whatever else the replaced ops read.
            banded = [node for node, _ in spec.lifted.bands]
            read = sources + spec.lifted.aux + banded
            replaced = replaced_subgraph(graph, removed_nodes(m), read)
            records, forward_tiles = attention_records(replaced, spec, sources, features, where,
                                                       ctx.report.ceilings.sms)
            spec = replace(spec, forward_tiles=forward_tiles, out_by_position=_read_by_position(m, spec))
            module, extra = subgraph_module(with_recomputed(replaced, read), read, m.pv)
            lost = [n.name for n in extra if n.meta.get("requires_grad")]
            if lost:
                raise Unsupported(f"a gradient flows to {', '.join(lost)}, which the replaced ops read and which "
                                  "cannot be recomputed from the fused op's inputs (a random op)")
        except Unsupported as reason:
            ctx.report.hotspots.append(_unfused_hotspot(softmax, str(reason)))
            continue
        except Exception as error:
            ctx.fallback("attention", where, "attention rewrite failed", error, ("aten.softmax",),
                         op_bytes(softmax))
            continue
        if spec.lifted.bands:
            records[0].detail[KNOWN_CONTENTS] = {known_input(node).name: describe(band)
                                                 for node, band in spec.lifted.bands}
        ctx.report.rewrites.extend(records)
        if ctx.run_kernels:
            ops, cost = records[0].ops, records[0].bytes_unfused

            def on_failure(error: Exception, phase: str, where: str = where, ops: tuple = ops,
                           cost: int = cost, records: list[Rewrite] = records) -> None:
                reason = "a buffer read as known contents changed" if isinstance(error, ContentsChanged) else \
                    f"attention {phase} kernel failed"
                ctx.fallback("attention", where, reason, error, ops, cost, phase, withdrawn=records)

            inputs = read + extra
            guards = [ContentGuard(len(spec.lifted.aux) + i, known_input(node), band)
                      for i, (node, band) in enumerate(spec.lifted.bands)]
            call = AttentionCall(spec, Unfused(module, [bool(n.meta.get("requires_grad")) for n in inputs],
                                               tuple(val(m.pv).shape), m.values.out_perm, on_failure, records[0],
                                               records[1] if len(records) > 1 else None), guards)
            _replace(graph, m, register(call), sources, spec, banded + extra)
            hold(gm, call)
            call.compile_ahead_of_first_call([val(n) for n in sources], [val(a) for a in spec.lifted.aux])
            changed = True
        else:
            mark_planned(replaced, spec.name)
    if changed:
        graph.eliminate_dead_code()
        gm.recompile()
    return gm


def _read_by_position(m: AttentionMatch, spec: AttentionSpec) -> bool:
    """Whether the attention's output, [B, H, N, D] as the op returns it, is read only with its heads and positions
    swapped (``.transpose(1, 2)``, ``.permute(0, 2, 1, 3)``; after a view of bmm's [B·H, N, D] as [B, H, N, D], as
    BLOOM merges heads): laid out [B, N, H, D], what the reader makes of it is then contiguous, and its
    ``.contiguous()`` or ``.reshape(B, N, H·D)`` copies nothing, forward or backward."""
    if m.values.out_perm is not None or len(m.pv.users) != 1:
        return False
    (user,) = m.pv.users
    if tuple(val(m.pv).shape) != spec.out_shape:
        if _as_out_shape(user, spec) is None:
            return False
        (user,) = user.users
    if packet(user) == aten.transpose:
        return {user.args[1] % 4, user.args[2] % 4} == {1, 2}
    return packet(user) == aten.permute and [d % 4 for d in user.args[1]] == [0, 2, 1, 3]


def _as_out_shape(node: torch.fx.Node, spec: AttentionSpec) -> torch.fx.Node | None:
    """`node` where it is a view of the attention's output as the op's [B, H, N, D], read by one op alone."""
    return node if packet(node) in (aten.view, aten.reshape, aten._unsafe_view) and len(node.users) == 1 and \
        tuple(val(node).shape) == spec.out_shape else None


def _replace(graph: torch.fx.Graph, m: AttentionMatch, name: str, sources: list[torch.fx.Node],
             spec: AttentionSpec, extra: list[torch.fx.Node]) -> None:
    existing = set(graph.nodes)
    with graph.inserting_before(m.pv):
        # Dropout's seed is drawn on the attention's device, where its kernels read it: a CUDA graph's replay draws it
        # anew. Without dropout, none: an empty tensor.
        device = val(m.pv).device
        if spec.dropout_p > 0:
            seed = graph.call_function(aten.randint.low, (0, 2**31 - 1, [1]), {"dtype": torch.int64, "device": device})
        else:
            seed = graph.call_function(aten.empty.memory_format, ([0],), {"dtype": torch.int64, "device": device})
        op = graph.call_function(torch.ops.fusepass.attention.default,
                                 (*sources, list(spec.lifted.aux) + extra, seed, name))
        keep_location(op, m.softmax)
        out = graph.call_function(operator.getitem, (op, 0))
        # bmm's [B·H, N, D] viewed back to [B, H, N, D]: that view is the op's output itself (laid out by position,
        # the output has no [B·H, N, D] view)
        merged = tuple(val(m.pv).shape) != spec.out_shape and spec.out_by_position
        result = out if merged else _to_output_layout(graph, out, m.values, tuple(val(m.pv).shape), spec.out_shape)
    infer_meta(n for n in graph.nodes if n not in existing)
    (_as_out_shape(next(iter(m.pv.users)), spec) if merged else m.pv).replace_all_uses_with(result)


def _to_output_layout(graph: torch.fx.Graph, out: torch.fx.Node, values: Operands, shape: tuple[int, ...],
                      op_shape: tuple[int, ...]) -> torch.fx.Node:
    """The op's [B, H, Nq, D] (`op_shape`) as the matmul with V produced it: its batch dims, its einsum order.
    The op's output itself where they agree (a view of it would be an output AOTAutograd regenerates per call)."""
    if values.out_perm is None:
        if tuple(shape) == tuple(op_shape):
            return out
        return graph.call_function(aten.view.default, (out, list(shape)))
    canonical_shape = [None] * len(shape)
    for i, p in enumerate(values.out_perm):
        canonical_shape[p] = shape[i]
    viewed = graph.call_function(aten.view.default, (out, canonical_shape))
    return graph.call_function(aten.permute.default, (viewed, list(values.out_perm)))
