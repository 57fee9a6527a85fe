"""Find attention by meaning: ``matmul(softmax(chain(matmul(q, kᵀ))), v)``, however it was written.

The match anchors on a softmax over the last axis and walks: up through pointwise ops and views (the
score chain) to the matmul of Q and Kᵀ, down through casts, dropout and views to the matmul with V.
The matmuls may be ``matmul``/``@``, ``bmm`` with heads folded into the batch, ``mm``, ``einsum`` or
``baddbmm`` (its bias and alpha join the chain). A softmax that is not attention, or attention that
cannot be rewritten exactly, is declined with the reason the report shows.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx

from fusepass.attention.layout import REARRANGING_OPS, Unsupported
from fusepass.codegen.translate import is_supported
from fusepass.fx_util import packet, val

aten = torch.ops.aten

SOFTMAX = {aten.softmax, aten._softmax, aten._safe_softmax}
# The products an attention's two matmuls may be written as.
ATTENTION_PRODUCTS = {aten.matmul, aten.bmm, aten.mm, aten.einsum, aten.baddbmm}
PROBABILITY_PATH = {aten.to, aten._to_copy, aten.type_as, aten.dropout, aten.clone, aten.contiguous,
                    aten.alias, aten.view, aten.reshape, aten._unsafe_view, aten.detach}


@dataclass
class Operands:
    """A matmul read as [*batch, M, K] @ [*batch, K, N]: its two operands and how to permute each into
    that form (for einsum), and how the output [*batch, M, N] is permuted into the node's output."""

    left: torch.fx.Node
    right: torch.fx.Node
    left_perm: tuple[int, ...] | None = None  # into [*batch, M, K]
    right_perm: tuple[int, ...] | None = None  # into [*batch, N, K]: the right operand transposed
    out_perm: tuple[int, ...] | None = None  # from [*batch, M, N] to the node's output order
    bias: torch.fx.Node | None = None  # baddbmm: beta * bias + alpha * (left @ right)
    alpha: float = 1.0
    beta: float = 1.0


@dataclass
class AttentionMatch:
    softmax: torch.fx.Node
    qk: torch.fx.Node
    pv: torch.fx.Node
    scores: Operands
    values: Operands
    chain: list[torch.fx.Node]  # from the scores to the softmax input, graph order
    probability_path: list[torch.fx.Node]  # from the softmax to the matmul with V, graph order
    softmax_dtype: torch.dtype | None  # softmax(x, dtype=...) computes in that dtype
    dropout_p: float = 0.0
    features: list[str] = field(default_factory=list)


def _einsum(node: torch.fx.Node, scores: bool) -> Operands:
    equation = node.args[0].replace(" ", "")
    if "..." in equation or len(node.args[1]) != 2:
        raise Unsupported(f"einsum {equation!r}")
    inputs, out = equation.split("->")
    a, b = inputs.split(",")
    contracted = [c for c in a if c in b and c not in out]
    if len(contracted) != 1:
        raise Unsupported(f"einsum {equation!r} does not contract one axis")
    kdim = contracted[0]
    m = [c for c in a if c not in b and c in out]
    n = [c for c in b if c not in a and c in out]
    batch = [c for c in out if c in a and c in b]
    if len(m) != 1 or len(n) != 1 or sorted(batch + m + n) != sorted(out):
        raise Unsupported(f"einsum {equation!r} is not a batched matmul")
    canonical_out = batch + m + n
    if scores and list(out[-2:]) != m + n:
        raise Unsupported(f"einsum {equation!r} writes scores with the key axis not last")
    return Operands(
        left=node.args[1][0], right=node.args[1][1],
        left_perm=tuple(a.index(c) for c in batch + m + [kdim]),
        right_perm=tuple(b.index(c) for c in batch + n + [kdim]),
        out_perm=tuple(canonical_out.index(c) for c in out))


def operands(node: torch.fx.Node, scores: bool) -> Operands:
    kind = packet(node)
    if kind == aten.einsum:
        return _einsum(node, scores)
    if kind == aten.baddbmm:
        return Operands(left=node.args[1], right=node.args[2], right_perm=(0, 2, 1), bias=node.args[0],
                        alpha=node.kwargs.get("alpha", 1), beta=node.kwargs.get("beta", 1))
    left, right = node.args[0], node.args[1]
    if val(left).dim() < 2 or val(right).dim() < 2:
        raise Unsupported("a matmul with a 1-D operand")
    r = val(right).dim()
    perm = tuple(range(r - 2)) + (r - 1, r - 2)
    return Operands(left=left, right=right, right_perm=perm)


def _is_liftable_op(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and (is_supported(node.target, node.args, node.kwargs)
                                           or packet(node) in REARRANGING_OPS)


def _score_chain(softmax_input: torch.fx.Node) -> tuple[torch.fx.Node, list[torch.fx.Node]]:
    """The matmul that produces the raw scores and the chain of ops from it to the softmax."""
    shape = tuple(val(softmax_input).shape[-2:])
    seen, stack, candidates = set(), [softmax_input], []
    while stack:
        node = stack.pop()
        if node in seen or not isinstance(node, torch.fx.Node):
            continue
        seen.add(node)
        if packet(node) in ATTENTION_PRODUCTS and tuple(val(node).shape[-2:]) == shape:
            candidates.append(node)
            continue
        if _is_liftable_op(node):
            stack.extend(node.all_input_nodes)
    if not candidates:
        raise Unsupported("no matmul of Q and Kᵀ feeds the softmax")
    order = {n: i for i, n in enumerate(softmax_input.graph.nodes)}
    qk = max(candidates, key=order.__getitem__)  # the others, if any, are biases read as tensors
    chain, stack = set(), [softmax_input]
    while stack:  # the chain: every op between the scores and the softmax that depends on the scores
        node = stack.pop()
        if node in chain or node is qk:
            continue
        if _depends_on(node, qk, order):
            chain.add(node)
            stack.extend(node.all_input_nodes)
    return qk, sorted(chain, key=order.__getitem__)


def _depends_on(node: torch.fx.Node, target: torch.fx.Node, order: dict) -> bool:
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n is target:
            return True
        if n in seen or order[n] < order[target]:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return False


def _reads_dtype_only(user: torch.fx.Node, node: torch.fx.Node) -> bool:
    """``x.type_as(node)`` reads only ``node``'s dtype."""
    return packet(user) == aten.type_as and user.args[0] is not node


def _probability_path(softmax: torch.fx.Node) -> tuple[list[torch.fx.Node], torch.fx.Node, float]:
    path, node, dropout_p = [], softmax, 0.0
    while True:
        users = list(node.users)
        if len(users) != 1:
            what = ", ".join(sorted(str(packet(u) or u.op) for u in users))
            raise Unsupported(f"probabilities also used by {what}" if users else "probabilities unused")
        user = users[0]
        if packet(user) in PROBABILITY_PATH:
            if packet(user) == aten.dropout:
                p, train = user.args[1], user.args[2]
                if train and p > 0:
                    dropout_p = float(p)
            elif packet(user) in (aten.view, aten.reshape, aten._unsafe_view) and \
                    tuple(val(user).shape[-2:]) != tuple(val(node).shape[-2:]):
                raise Unsupported("probabilities reshaped across the query/key axes")
            path.append(user)
            node = user
            continue
        if packet(user) in ATTENTION_PRODUCTS:
            return path, user, dropout_p
        raise Unsupported(f"probabilities go to {packet(user) or user.op}, not to a matmul with V")


def match(softmax: torch.fx.Node) -> AttentionMatch:
    """The attention anchored on ``softmax``; raises ``Unsupported`` with the reason if there is none."""
    x = softmax.args[0]
    dim = softmax.args[1] % val(x).dim()
    if dim != val(x).dim() - 1:
        raise Unsupported(f"softmax over dim {softmax.args[1]}, not the key axis")
    softmax_dtype = None
    if packet(softmax) == aten.softmax:
        softmax_dtype = softmax.args[2] if len(softmax.args) > 2 else softmax.kwargs.get("dtype")
    elif packet(softmax) == aten._softmax and softmax.args[2]:
        softmax_dtype = torch.float32
    path, pv, dropout_p = _probability_path(softmax)
    qk, chain = _score_chain(x)
    for node in chain:
        if not _is_liftable_op(node):
            raise Unsupported(f"the score chain has {packet(node) or node.target}, which has no per-tile form")
    for node in [*chain, qk]:
        outside = [u for u in node.users if u not in chain and u is not softmax and not _reads_dtype_only(u, node)]
        if outside:
            raise Unsupported(f"scores also used by {packet(outside[0]) or outside[0].op}")
    scores = operands(qk, scores=True)
    values = operands(pv, scores=False)
    probabilities = path[-1] if path else softmax
    if values.left is not probabilities:
        raise Unsupported("probabilities are not the left operand of the matmul with V")
    return AttentionMatch(softmax=softmax, qk=qk, pv=pv, scores=scores, values=values, chain=chain,
                          probability_path=path, softmax_dtype=softmax_dtype, dropout_p=dropout_p)


def softmaxes(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    return [n for n in graph.nodes if n.op == "call_function" and packet(n) in SOFTMAX]
