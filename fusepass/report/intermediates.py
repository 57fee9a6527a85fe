"""The largest tensors a forward graph still writes to HBM and reads back after both passes.

Each becomes a hotspot of kind "intermediate", naming the op that writes it. Graph inputs and outputs do
not count (the tensors a forward graph keeps for the backward are among its outputs), nor do views. Only
the few largest of at least ``MIN_BYTES`` are listed: a smaller tensor costs well under a microsecond of
HBM time on an H200.
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from fusepass.fx_util import op_name
from fusepass.report.ledger import aliased_input, storage_root, value_bytes
from fusepass.report.records import Hotspot
from fusepass.source import location

LARGEST = 3
MIN_BYTES = 1 << 20


def _outputs(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    found: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if node.op == "output":
            torch.fx.map_arg(node.args, lambda a: found.add(storage_root(a)))
    return found


def largest_intermediates(graph: torch.fx.Graph, phase: str) -> list[Hotspot]:
    outputs = _outputs(graph)
    found = []
    for node in graph.nodes:
        val = node.meta.get("val")
        if node.op != "call_function" or not isinstance(val, torch.Tensor) or node in outputs or \
                aliased_input(node) is not None or value_bytes(node) < MIN_BYTES:
            continue
        # An element of a tuple is written by the op that returned the tuple.
        producer = node.args[0] if node.target is operator.getitem else node
        readers = max(1, len(node.users))
        where = location(node) if location(node) != "?" else location(producer)
        shape = "x".join(str(s) for s in val.shape)
        found.append(Hotspot(
            kind="intermediate", phase=phase, location=where, ops=(op_name(producer),),
            bytes=value_bytes(node) * (1 + readers),
            reason=f"{shape} {str(val.dtype).removeprefix('torch.')} written by {op_name(producer)}, "
                   f"read by {readers} op{'s' * (readers != 1)}"))
    found.sort(key=lambda h: -h.bytes)
    return found[:LARGEST]
