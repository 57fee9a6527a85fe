"""Matmuls never slower than Inductor leaves them: unaligned dims padded where the GPU's kernel for them is slow.

fusepass generates no GEMM: matmuls run as cuBLAS runs them. For a size no 16 bytes divide (a vocabulary of
50257, an FFN of 5461), cuBLAS may take a kernel far slower than for the next aligned size (bench/NOTES.md).
Inductor pads such dims (``shape_padding``); so does this pass, in the forward and
backward graphs: an ``mm``, ``addmm`` or ``bmm`` whose M, N or K is unaligned is timed on the running GPU as it is
and with its operands zero-padded to aligned sizes (the pads included), once per shape and dtype, and padded where
that is faster. Zeros added along K add nothing to the products; rows and columns added along M and N are cut off
the result (a view: no copy). Each padded matmul is a rewrite of the report, with both times.

Two padded matmuls that pad one value alike share its padded copy: a linear layer's backward reads its output's
gradient as dX = dY · W (dY's columns, K, padded) and dW = dYᵀ · X (the same columns, now M), and an LM head's dY is
the step's largest tensor (8192 × 50257 bf16: 0.8 GB a copy).
"""
from __future__ import annotations

import torch
import torch.fx

from fusepass.context import PassContext
from fusepass.fx_util import packet, val
from fusepass.report import attribution
from fusepass.report.ledger import op_bytes, op_flops
from fusepass.report.records import Rewrite
from fusepass.runtime.timing import median_ms, random_like
from fusepass.source import keep_location, location

aten = torch.ops.aten
ALIGN_BYTES = 16  # a row of a tensor-core GEMM's operand starts at a multiple of this
FASTER = 0.9  # padded only where the padded matmul, pads included, takes at most this fraction of the time

_decisions: dict[tuple, tuple[float, float]] = {}  # (layouts, dtype, device, pads) -> (ms as it is, ms padded)


def _aligned(n: int, dtype: torch.dtype) -> int:
    step = max(1, ALIGN_BYTES // dtype.itemsize)
    return -(-n // step) * step


def _operands(node: torch.fx.Node) -> tuple[torch.fx.Node | None, torch.fx.Node, torch.fx.Node] | None:
    """(bias or None, left, right) of an mm, addmm or bmm with static 2-d (3-d for bmm) operands."""
    kind = packet(node)
    if kind == aten.mm:
        bias, a, b = None, node.args[0], node.args[1]
    elif kind == aten.addmm and node.kwargs.get("beta", 1) == 1 and node.kwargs.get("alpha", 1) == 1:
        bias, a, b = node.args
    elif kind == aten.bmm:
        bias, a, b = None, node.args[0], node.args[1]
    else:
        return None
    if not all(isinstance(x, torch.fx.Node) and isinstance(val(x), torch.Tensor) for x in (a, b)):
        return None
    if not all(isinstance(s, int) for x in (a, b) for s in val(x).shape):
        return None
    return bias, a, b


def _padding(node: torch.fx.Node, a: torch.Tensor, b: torch.Tensor) -> tuple[int, int, int] | None:
    """How far M, K and N would be padded (None where every dim is aligned, or the op is not a tensor-core GEMM)."""
    if a.dtype not in (torch.float16, torch.bfloat16) or a.dtype != b.dtype or a.device.type != "cuda":
        return None
    m, k = a.shape[-2:]
    n = b.shape[-1]
    pads = tuple(_aligned(d, a.dtype) - d for d in (m, k, n))
    return pads if any(pads) else None


def _padded(x: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    """`x` zero-padded by `rows` and `columns` in its own order: a column-major operand (a transposed weight or
    gradient) stays column-major, so the pad is a copy without a transpose and its leading dimension aligned."""
    if not rows and not columns:
        return x
    if x.stride(-2) == 1 and x.stride(-1) != 1:
        return torch.nn.functional.pad(x.mT, (0, rows, 0, columns)).mT
    return torch.nn.functional.pad(x, (0, columns, 0, rows))


def padded_matmul(bias: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor, pads: tuple[int, int, int]
                  ) -> torch.Tensor:
    """``addmm(bias, a, b)`` (``bmm``, ``mm`` without a bias) from zero-padded operands, cut back to its size."""
    pad_m, pad_k, pad_n = pads
    return product_of_padded(bias, _padded(a, pad_m, pad_k), _padded(b, pad_k, pad_n), pads)


def product_of_padded(bias: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor, pads: tuple[int, int, int]
                      ) -> torch.Tensor:
    """``addmm(bias, a, b)`` (``bmm``, ``mm`` without a bias) of operands already padded by `pads` (M, K, N), cut
    back to the unpadded size."""
    pad_m, _, pad_n = pads
    m, n = a.shape[-2] - pad_m, b.shape[-1] - pad_n
    if bias is not None:  # broadcast to the output: padded along the dims it spans
        spans_n = pad_n if bias.dim() and bias.shape[-1] == n and n > 1 else 0
        spans_m = pad_m if bias.dim() == 2 and bias.shape[0] == m and m > 1 else 0
        if spans_n or spans_m:
            bias = torch.nn.functional.pad(bias, (0, spans_n) + ((0, spans_m) if bias.dim() == 2 else ()))
        out = torch.addmm(bias, a, b)
    else:
        out = torch.bmm(a, b) if a.dim() == 3 else torch.mm(a, b)
    return out[..., :m, :n]


def _measured(bias: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor, pads: tuple[int, int, int]
              ) -> tuple[float, float]:
    """(ms as it is, ms padded, pads included) on random operands of these shapes and strides, once per layout and
    dtype: cuBLAS's kernel depends on the strides too (a transposed operand's unaligned leading dimension, the LM
    head's weight gradient, is slow where the same operand contiguous is not)."""
    key = tuple(None if t is None else (tuple(t.shape), t.stride()) for t in (bias, a, b)) + (a.dtype, a.device, pads)
    if key not in _decisions:
        with torch._subclasses.fake_tensor.unset_fake_temporarily(), torch.no_grad():
            rb, ra, rbb = (None if t is None else random_like(t) for t in (bias, a, b))
            plain = (lambda: torch.addmm(rb, ra, rbb)) if rb is not None else (
                lambda: torch.bmm(ra, rbb) if ra.dim() == 3 else torch.mm(ra, rbb))
            as_is = median_ms(plain)
            padded = median_ms(lambda: padded_matmul(rb, ra, rbb, pads))
        _decisions[key] = as_is, padded
    return _decisions[key]


VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def read_padded_alone(node: torch.fx.Node) -> bool:
    """Whether `node`'s value reaches nothing but one padded copy, through views nothing else reads: a fused kernel
    making it can write it padded instead (`pads_in_producers.py`)."""
    while len(node.users) == 1:
        (user,) = node.users
        if user.target is _padded:
            return user.args[0] is node
        if user.target not in VIEWS:
            return False
        node = user
    return False


def _transpose_of(x: torch.fx.Node) -> torch.fx.Node | None:
    """The node whose 2-d value `x` transposes (a weight's or a gradient's ``t``), or None."""
    if x.op != "call_function" or val(x).dim() != 2:
        return None
    if x.target is aten.t.default or (x.target is aten.permute.default and list(x.args[1]) == [1, 0]):
        return x.args[0]
    if x.target is aten.transpose.int and {d % 2 for d in x.args[1:3]} == {0, 1}:
        return x.args[0]
    return None


_PadKey = tuple[torch.fx.Node, int, int]  # a value and the rows and columns its padded copy adds


def _pad_key(x: torch.fx.Node, rows: int, columns: int) -> tuple[_PadKey, bool]:
    """What padding `x` by `rows` and `columns` copies, as one key for a value and its transpose (whose padded copy
    `_padded` makes transposed, in the same memory order), and whether `x` is that transpose."""
    source = _transpose_of(x)
    return ((x, rows, columns), False) if source is None else ((source, columns, rows), True)


def pad_matmuls(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    """Pad each unaligned matmul whose padded form the running GPU runs faster; a value two of them pad alike is
    padded once."""
    if not ctx.run_kernels:
        return gm
    graph = gm.graph
    chosen = []
    for node in list(graph.nodes):
        found = _operands(node) if node.op == "call_function" else None
        if found is None:
            continue
        bias, a, b = found
        pads = _padding(node, val(a), val(b))
        if pads is None:
            continue
        bias_val = val(bias) if isinstance(bias, torch.fx.Node) else None
        if bias is not None and bias_val is None:
            continue
        as_is, padded = _measured(bias_val, val(a), val(b), pads)
        if padded <= FASTER * as_is:
            chosen.append((node, bias, a, b, pads, as_is, padded))
    if not chosen:
        return gm

    users: dict[_PadKey, list[torch.fx.Node]] = {}  # the matmuls that pad a value alike
    for node, _, a, b, (m, k, n), _, _ in chosen:
        for x, rows, columns in ((a, m, k), (b, k, n)):
            if rows or columns:
                users.setdefault(_pad_key(x, rows, columns)[0], []).append(node)
    order = {n: i for i, n in enumerate(graph.nodes)}
    made: set[torch.fx.Node] = set()  # the pads (and transposes of shared ones) this pass adds

    def added(node: torch.fx.Node, value: torch.Tensor, like: torch.fx.Node) -> torch.fx.Node:
        node.meta["val"] = value
        keep_location(node, like)
        made.add(node)
        return node

    shared: dict[_PadKey, torch.fx.Node] = {}
    for key, matmuls in users.items():
        if len(matmuls) > 1:  # padded once, ahead of the first matmul that reads it
            source, rows, columns = key
            with graph.inserting_before(min(matmuls, key=order.__getitem__)):
                shared[key] = added(graph.call_function(_padded, key), _padded(val(source), rows, columns),
                                    matmuls[0])

    def operand(x: torch.fx.Node, rows: int, columns: int, like: torch.fx.Node) -> torch.fx.Node:
        """`x` padded: its shared copy or a pad of its own, of the value `x` transposes where it does (transposed
        back: the same tensor, and the pad reads the value that makes it: `pads_in_producers.py`)."""
        if not rows and not columns:
            return x
        key, transposed = _pad_key(x, rows, columns)
        if key not in shared:
            padded = added(graph.call_function(_padded, key), _padded(val(key[0]), *key[1:]), like)
        else:
            padded = shared[key]
        if not transposed:
            return padded
        return added(graph.call_function(aten.t.default, (padded,)), val(padded).t(), like)

    for node, bias, a, b, pads, as_is, padded in chosen:
        m, k, n = pads
        shares = [_pad_key(x, rows, columns)[0] in shared for x, rows, columns in ((a, m, k), (b, k, n))
                  if rows or columns]
        # Each pad a node of its own: a fused kernel making the operand may write it padded (pads_in_producers.py).
        with graph.inserting_before(node):
            new = graph.call_function(product_of_padded, (bias, operand(a, m, k, node), operand(b, k, n, node), pads))
            keep_location(new, node)
        new.meta["val"] = node.meta["val"]
        new.meta["requires_grad"] = node.meta.get("requires_grad", False)
        record = Rewrite(
            kind="matmul", phase=ctx.phase, location=location(node), ops=(f"aten.{packet(node).__name__}",),
            bytes_unfused=op_bytes(node), bytes_fused=op_bytes(node), flops=op_flops(node), flops_fused=op_flops(node),
            measured_unfused_ms=as_is, measured_fused_ms=padded,
            detail={"padded": dict(zip("mkn", pads)), "shape": [list(val(a).shape), list(val(b).shape)],
                    **({"shared pads": sum(shares)} if any(shares) else {})})
        ctx.report.rewrites.append(record)
        attribution.tag(new, record)
        for piece in new.args[1:3]:  # the operands' pads (a shared one goes to its first matmul's record)
            while piece in made and attribution.RECORD not in piece.meta:
                attribution.tag(piece, record)
                piece = piece.args[0]
        node.replace_all_uses_with(new)
        graph.erase_node(node)
    graph.eliminate_dead_code()  # the transposes the pads read past: a value's users then say who reads it
    gm.recompile()
    return gm
