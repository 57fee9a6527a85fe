"""An attention whose values have another head dim than its queries and keys (multi-head latent attention's 192-wide
q·k beside 128-wide values), fused with the narrower side padded by zeros to the wider one.

The kernels take one head dim for Q, K and V. Zeros appended to Q's and K's rows add nothing to q·k; zeros appended
to V's rows make output columns that are cut off again (a slice of the fused op's output), and their gradients
are the slices of the padded operands' own (autograd's backward of the pad). So the rewrite computes what the
eager code does, forward and backward, at the cost of the padded columns' bytes and products. The pads go into the
graph before planning, on the operands of the two products as the user wrote them (``matmul``, ``@``, ``bmm``,
``baddbmm``; an einsum's operand order is its equation's, left declined), and come out again if the attention is
not rewritten after all.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx

from fusepass.attention.match import AttentionMatch
from fusepass.fx_util import Writer, infer_meta, packet, val
from fusepass.source import keep_location

aten = torch.ops.aten
# The products whose operands are padded as written: q·kᵀ's (baddbmm's bias is [.., M, N], which no pad changes), and
# the product with V's (a baddbmm there would add a bias of V's head dim).
PADDED_SCORES = {aten.matmul, aten.bmm, aten.mm, aten.baddbmm}
PADDED_VALUES = {aten.matmul, aten.bmm, aten.mm}


def differing_head_dims(m: AttentionMatch) -> tuple[int, int] | None:
    """(q·k's head dim, V's) where they differ and both products can be padded as written, else None."""
    if packet(m.qk) not in PADDED_SCORES or packet(m.pv) not in PADDED_VALUES:
        return None
    q, k_t, v = val(m.scores.left), val(m.scores.right), val(m.values.right)
    qk_dim, v_dim = q.shape[-1], v.shape[-1]
    if qk_dim == v_dim or k_t.shape[-2] != qk_dim or not isinstance(qk_dim, int) or not isinstance(v_dim, int):
        return None
    return qk_dim, v_dim


def pad_to_one_head_dim(graph: torch.fx.Graph, m: AttentionMatch) -> Callable[[], None]:
    """Pad the narrower side of `m` (`differing_head_dims`) with zeros in `graph`; returns what takes the pads out
    again."""
    qk_dim, v_dim = differing_head_dims(m)
    inserted: list[torch.fx.Node] = []
    replaced: list[tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node]] = []  # (reader, old input, new input)

    def pad(operand: torch.fx.Node, reader: torch.fx.Node, widths: list[int]) -> None:
        padded = Writer(graph, reader)(aten.constant_pad_nd.default, operand, widths, 0.0)
        reader.replace_input_with(operand, padded)
        inserted.append(padded)
        replaced.append((reader, operand, padded))

    if v_dim < qk_dim:
        pad(m.values.right, m.pv, [0, qk_dim - v_dim])
        infer_meta([m.pv])
        users = list(m.pv.users)
        cut = Writer(graph, m.pv.next)(aten.slice.Tensor, m.pv, -1, 0, v_dim)
        keep_location(cut, m.pv)
        for user in users:
            user.replace_input_with(m.pv, cut)
        inserted.append(cut)
    else:
        pad(m.scores.left, m.qk, [0, v_dim - qk_dim])  # Q's rows
        pad(m.scores.right, m.qk, [0, 0, 0, v_dim - qk_dim])  # Kᵀ's columns

    def undo() -> None:
        if v_dim < qk_dim:
            cut = inserted[-1]
            cut.replace_all_uses_with(m.pv)
        for reader, old, new in replaced:
            reader.replace_input_with(new, old)
        if v_dim < qk_dim:
            infer_meta([m.pv])
        for node in reversed(inserted):
            graph.erase_node(node)

    return undo
