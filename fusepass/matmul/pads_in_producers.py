"""A padded matmul's operand written padded by the fused kernel that makes it, not copied there.

The padding pass (`pad.py`) pads an unaligned operand by a copy (`pad._padded`). Where that operand is a fused
group's output reached through views alone (the LM head's logits gradient, the loss backward's where the loss is
compiled with the model; a SwiGLU's gradients) and read by nothing else, the group's kernel writes it into the first rows and columns
of a zero-padded buffer instead (`kernel.PaddedOutput`): the copy's read and write go, and the unpadded tensor is
never made (the LM head's: 0.8 GB at B8 T1024, vocabulary 50257).
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from fusepass.context import PassContext
from fusepass.elementwise.kernel import PaddedOutput, PointwiseLauncher
from fusepass.fx_util import val
from fusepass.matmul import pad
from fusepass.report import attribution
from fusepass.report.ledger import value_bytes


def _sole_output(x: torch.fx.Node) -> tuple[torch.fx.Node, int] | None:
    """(the group's call, which output) where `x` is a fused group's output, through views that nothing else
    reads, and read by nothing else."""
    while x.op == "call_function" and x.target in pad.VIEWS and len(x.users) == 1:
        x = x.args[0]
    if x.op == "call_function" and x.target is operator.getitem and len(x.users) == 1 and \
            isinstance(x.args[0].target, PointwiseLauncher):
        return x.args[0], x.args[1]
    return None


def _padded_output(x: torch.Tensor, output: torch.Tensor, index: int, rows: int, columns: int
                   ) -> PaddedOutput | None:
    """How the group's `output` lies in the buffer `x` padded by `rows` and `columns` is, where it can (both
    contiguous, the output a view of the buffer's first rows and columns)."""
    if not (x.is_contiguous() and output.is_contiguous()) or x.dim() < 2 or output.numel() == 0:
        return None
    shape = tuple(x.shape)
    buffer = torch.empty((*shape[:-2], shape[-2] + rows, shape[-1] + columns), device="meta")
    try:
        written = buffer[..., :shape[-2], :shape[-1]].view(output.shape)
    except (RuntimeError, ValueError):  # its rows do not lie evenly in the buffer's (a batched operand padded along M)
        return None
    return PaddedOutput(index, tuple(output.shape), written.stride(), shape, rows, columns)


def write_pads_in_producers(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    """Each padded copy of a fused group's output made by the group's kernel instead."""
    graph = gm.graph
    changed = False
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not pad._padded:
            continue
        x, rows, columns = node.args
        found = _sole_output(x)
        if found is None:
            continue
        call, index = found
        padded = _padded_output(val(x), call.meta["val"][index], index, rows, columns)
        if padded is None:
            continue
        result = call.target.write_padded(padded)
        with graph.inserting_after(call):
            buffer = graph.call_function(operator.getitem, (call, result))
        buffer.meta.update(node.meta)
        call.meta["val"] = (*call.meta["val"], node.meta["val"])
        record = call.meta.get(attribution.RECORD)
        if record is not None:
            attribution.tag(buffer, record)
            # The copy's bytes (the output read, the buffer written) are no longer moved.
            record.bytes_unfused += value_bytes(x) + value_bytes(node)
            record.detail.setdefault("written padded", []).append(
                f"{list(padded.shape)} for a matmul (+{rows} rows, +{columns} columns)")
        node.replace_all_uses_with(buffer)
        graph.erase_node(node)
        changed = True
    if changed:
        graph.eliminate_dead_code()
        gm.recompile()
    return gm
