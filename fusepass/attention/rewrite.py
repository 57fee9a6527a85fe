"""The attention pass: each ``matmul → softmax → matmul`` becomes one call of the fused attention op.

Its fixed shape: match (``match``), read the operands' layouts (``layout``), lift the score chain
(``lift``), then replace the matched ops by ``torch.ops.fusepass.attention`` and record the rewrite. A
declined match leaves the graph exactly as it was and becomes a hotspot with its reason.
"""
from __future__ import annotations

import itertools
import math
import operator

import torch
import torch.fx

from fusepass.attention.dynamic import reads_symbolic_ints, rewrite_dynamic
from fusepass.attention.layout import OperandView, Unsupported, broadcast_to, canonical, operand_view
from fusepass.attention.lift import Canon, Lifter
from fusepass.attention.match import AttentionMatch, Operands, match, softmaxes, val
from fusepass.attention.op import AttentionSpec, Unfused, compile_ahead_of_first_call, register
from fusepass.attention.subgraph import removed_nodes, replaced_subgraph, subgraph_module
from fusepass.context import PassContext, mark_planned
from fusepass.flash.config import FlashConfig, ModeledRows, backward_configs, forward_config, narrow_kv_tiles
from fusepass.fx_util import hold, infer_meta
from fusepass.report.ledger import (
    AttentionShape,
    AuxRead,
    Tiles,
    attention_rewrites,
    op_bytes,
    tile_density,
    value_bytes,
)
from fusepass.report.records import Hotspot, Rewrite
from fusepass.source import keep_location, location

aten = torch.ops.aten
HEAD_DIMS = range(16, 257)


def _operand_view(node: torch.fx.Node, perm: tuple[int, ...] | None, batch: tuple[int, ...],
                  swap: bool = False, widen_from: torch.dtype | None = None) -> OperandView:
    """A matmul operand read as [*batch, N, D]: permuted (einsum), last two dims swapped (Kᵀ, V), broadcast."""
    view = operand_view(node, widen_from)
    if perm is not None:
        view = view.permute(perm)
    if swap:
        view = view.swap_last()
    return broadcast_to(view, batch)


def _pv_batch(m: AttentionMatch) -> tuple[int, ...]:
    """The batch dims of the matmul with V, in [*batch, q, d] order (an einsum may write them otherwise)."""
    shape = tuple(val(m.pv).shape)
    if m.values.out_perm is None:
        return shape[:-2]
    canonical_out = [0] * len(shape)
    for i, p in enumerate(m.values.out_perm):
        canonical_out[p] = shape[i]
    return tuple(canonical_out[:-2])


def plan(m: AttentionMatch, name: str) -> tuple[AttentionSpec, list[torch.fx.Node], list[str]]:
    """The spec of the rewrite and the graph values the op reads; raises ``Unsupported``."""
    shape = tuple(val(m.qk).shape)
    if not all(isinstance(s, int) for s in shape):
        raise Unsupported("symbolic shapes")
    batch, q_len, kv_len = shape[:-2], shape[-2], shape[-1]
    flat = math.prod(batch)
    if 0 in (flat, q_len, kv_len):
        raise Unsupported("an empty attention (a length of 0): its ops have nothing to move")
    pv_batch = _pv_batch(m)
    if math.prod(pv_batch) != flat:
        raise Unsupported("the matmul with V has another batch than the scores")
    v_view = _operand_view(m.values.right, m.values.right_perm, pv_batch, swap=True)
    # Q and K upcast for the scores (``q.float() @ k.float().T``) beside a V left as it was: the kernel reads them
    # as V's dtype, whose products its fp32 accumulation holds exactly (eager differs in summation order only).
    widen_from = val(v_view.source).dtype
    q_view = _operand_view(m.scores.left, m.scores.left_perm, batch, widen_from=widen_from)
    k_view = _operand_view(m.scores.right, m.scores.right_perm, batch, widen_from=widen_from)
    # The kernel's batch: the first of Q's leading dims (finer than the scores' where a reshape merged them),
    # or where K's heads are repeated, K's dims before them (bmm's [B·H] merges Q's batch and heads into one).
    B = q_view.meta.shape[0] if q_view.meta.dim() > 2 else 1
    if k_view.group_dim is not None:
        B = math.prod(k_view.meta.shape[:k_view.group_dim])
    H = flat // B
    q, k, v = (canonical(view, B, H) for view in (q_view, k_view, v_view))
    q_src, k_src, v_src = q_view.source, k_view.source, v_view.source
    if q.group != 1:
        raise Unsupported("queries shared across heads")
    dtypes = {val(q_src).dtype, val(k_src).dtype, val(v_src).dtype}
    if len(dtypes) != 1 or next(iter(dtypes)) not in (torch.float32, torch.float16, torch.bfloat16):
        raise Unsupported(f"Q, K, V dtypes {sorted(map(str, dtypes))}")
    if k.group != v.group or k.size[1] != v.size[1]:
        raise Unsupported("K and V have different head layouts")
    if q.size[3] != k.size[3] or q.size[3] != v.size[3]:
        raise Unsupported(f"head dims differ: q {q.size[3]}, k {k.size[3]}, v {v.size[3]}")
    if q.size[3] not in HEAD_DIMS:
        raise Unsupported(f"head dim {q.size[3]} outside 16..256")
    canon = Canon(batch=B, heads=H, q_len=q_len, kv_len=kv_len)
    lifted = Lifter(m, canon, name).lift()
    if any(lifted.aux_needs_grad) and torch.are_deterministic_algorithms_enabled():
        # Dynamo recompiles where the setting changes (it guards on it).
        raise Unsupported("deterministic algorithms are requested: the kernel would sum the gradient of a score "
                          "input (a learnable bias) with atomic adds, in no fixed order")
    spec = AttentionSpec(name=name, q=q, k=k, v=v, lifted=lifted, out_dtype=val(m.pv).dtype,
                         dropout_p=m.dropout_p, aux_strides=[tuple(val(a).stride()) for a in lifted.aux])
    features = list(lifted.features)
    if k.group > 1:
        features.append("gqa")
    if q_len != kv_len:
        features.append("cross")
    if m.dropout_p > 0:
        features.append("dropout")
    return spec, [q_src, k_src, v_src], sorted(set(features))


def _records(replaced: list[torch.fx.Node], spec: AttentionSpec, sources: list[torch.fx.Node],
             features: list[str], where: str, sms: int) -> tuple[list[Rewrite], FlashConfig | None]:
    """The ledger's records of this rewrite (forward, and backward when a gradient flows to an input), and the
    forward's tiles on the GPU where the density model knows the mask's rows (None where it does not)."""
    kept = sources + spec.lifted.aux
    batch, heads, q_len, head_dim = spec.out_shape
    dtype = val(sources[0]).dtype
    masked = "keep" in spec.lifted.functions
    shape = AttentionShape(batch=batch, heads=heads, kv_heads=spec.k.size[1], q_len=q_len, kv_len=spec.k.size[2],
                           head_dim=head_dim, itemsize=dtype.itemsize, out_itemsize=spec.out_dtype.itemsize,
                           masked=masked)
    # Tiles are skipped only where the fill contributes nothing (docs/flash-kernel-interface.md).
    skips = masked and spec.lifted.fill_bound != math.inf
    cuda = torch.device("cuda")  # the ledger models the GPU's tiles, wherever the graph runs

    def tiles(config: FlashConfig) -> Tiles:
        return tile_density(features, skips, q_len, shape.kv_len, config.block_m, config.block_n, sms)

    backward = backward_configs(head_dim, dtype, masked, cuda)
    aux = [AuxRead(bytes=value_bytes(a), itemsize=val(a).element_size(),
                   per_tile=value_bytes(a) // val(a).element_size() >= q_len * shape.kv_len,
                   needs_grad=bool(a.meta.get("requires_grad"))) for a in spec.lifted.aux]
    gradient_flows = any(n.meta.get("requires_grad") for n in kept)
    forward = forward_config(head_dim, dtype, masked, cuda)
    known = True
    if masked:  # the width the kernel takes for the mask's rows, as far as the density model knows them
        wide = tiles(forward)
        known = wide.known and not spec.lifted.keep_reads_aux
        forward = narrow_kv_tiles(forward, ModeledRows(wide.density * wide.kv_blocks(shape)) if known else None)
    records = attention_rewrites(where, replaced, kept, shape, tiles(forward),
                                 (tiles(backward.dkdv), tiles(backward.dq)), aux,
                                 tuple(features), {"shape": [batch, heads, q_len, shape.kv_len, head_dim],
                                                   "kv_heads": shape.kv_heads}, gradient_flows)
    return records, forward if known else None


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
    for softmax in softmaxes(graph):
        where = location(softmax)
        name = f"attention_{next(_names)}"
        try:
            m = match(softmax)
            if not _static(m) or reads_symbolic_ints(graph, m):
                ctx.report.rewrites.extend(rewrite_dynamic(graph, m, ctx, name, where, rewrite_attention))
                changed = changed or ctx.run_kernels
                continue
            spec, sources, features = plan(m, name)
            spec.replay = ctx.options.replay
            replaced = replaced_subgraph(graph, removed_nodes(m), sources + spec.lifted.aux)
            records, spec.forward_tiles = _records(replaced, spec, sources, features, where,
                                                   ctx.report.ceilings.sms)
        except Unsupported as reason:
            ctx.report.hotspots.append(_unfused_hotspot(softmax, str(reason)))
            continue
        except Exception as error:
            ctx.fallback("attention", where, "attention rewrite failed", error, ("aten.softmax",),
                         op_bytes(softmax))
            continue
        ctx.report.rewrites.extend(records)
        if ctx.run_kernels:
            module, extra = subgraph_module(replaced, sources + spec.lifted.aux, m.pv)
            ops, cost = records[0].ops, records[0].bytes_unfused

            def on_failure(error: Exception, phase: str, where: str = where, ops: tuple = ops,
                           cost: int = cost, records: list[Rewrite] = records) -> None:
                ctx.fallback("attention", where, f"attention {phase} kernel failed", error, ops, cost, phase,
                             withdrawn=records)

            inputs = sources + spec.lifted.aux + extra
            spec.unfused = Unfused(module, [bool(n.meta.get("requires_grad")) for n in inputs],
                                   tuple(val(m.pv).shape), m.values.out_perm, on_failure, records[0],
                                   records[1] if len(records) > 1 else None)
            _replace(graph, m, register(spec), sources, spec, extra)
            hold(gm, spec)
            compile_ahead_of_first_call(spec, [val(n) for n in sources], [val(a) for a in spec.lifted.aux])
            changed = True
        else:
            mark_planned(replaced, spec.name)
    if changed:
        graph.eliminate_dead_code()
        gm.recompile()
    return gm


def _replace(graph: torch.fx.Graph, m: AttentionMatch, name: str, sources: list[torch.fx.Node],
             spec: AttentionSpec, extra: list[torch.fx.Node]) -> None:
    existing = set(graph.nodes)
    with graph.inserting_before(m.pv):
        if spec.dropout_p > 0:
            seed = graph.call_function(aten.randint.low, (0, 2**31 - 1, [1]),
                                       {"dtype": torch.int64, "device": torch.device("cpu")})
        else:
            seed = graph.call_function(aten.empty.memory_format, ([0],),
                                       {"dtype": torch.int64, "device": torch.device("cpu")})
        call = graph.call_function(torch.ops.fusepass.attention.default,
                                   (*sources, list(spec.lifted.aux) + extra, seed, name))
        keep_location(call, m.softmax)
        out = graph.call_function(operator.getitem, (call, 0))
        result = _to_output_layout(graph, out, m.values, tuple(val(m.pv).shape), spec.out_shape)
    infer_meta(n for n in graph.nodes if n not in existing)
    m.pv.replace_all_uses_with(result)


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
