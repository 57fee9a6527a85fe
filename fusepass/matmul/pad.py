"""Matmuls never slower than Inductor leaves them: unaligned dims padded where the GPU's kernel for them is slow.

fusepass generates no GEMM: matmuls run as cuBLAS runs them. For a size no 16 bytes divide (a vocabulary of
50257, an FFN of 5461), cuBLAS may take a kernel far slower than for the next aligned size (bench/NOTES.md).
Inductor pads such dims (``shape_padding``); so does this pass, in the forward and
backward graphs: an ``mm``, ``addmm`` or ``bmm`` whose M, N or K is unaligned is timed on the running GPU as it is
and with its operands zero-padded to aligned sizes (the pads included), once per shape and dtype, and padded where
that is faster. Zeros added along K add nothing to the products; rows and columns added along M and N are cut off
the result (a view: no copy). Each padded matmul is a rewrite of the report, with both times.
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
    m, n = a.shape[-2], b.shape[-1]
    a, b = _padded(a, pad_m, pad_k), _padded(b, pad_k, pad_n)
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


def pad_matmuls(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    """Pad each unaligned matmul whose padded form the running GPU runs faster."""
    if not ctx.run_kernels:
        return gm
    graph = gm.graph
    changed = False
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
        if padded > FASTER * as_is:
            continue
        with graph.inserting_before(node):
            new = graph.call_function(padded_matmul, (bias, a, b, pads))
            keep_location(new, node)
        new.meta["val"] = node.meta["val"]
        new.meta["requires_grad"] = node.meta.get("requires_grad", False)
        record = Rewrite(
            kind="matmul", phase=ctx.phase, location=location(node), ops=(f"aten.{packet(node).__name__}",),
            bytes_unfused=op_bytes(node), bytes_fused=op_bytes(node), flops=op_flops(node), flops_fused=op_flops(node),
            measured_unfused_ms=as_is, measured_fused_ms=padded,
            detail={"padded": dict(zip("mkn", pads)), "shape": [list(val(a).shape), list(val(b).shape)]})
        ctx.report.rewrites.append(record)
        attribution.tag(new, record)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        changed = True
    if changed:
        gm.recompile()
    return gm
