"""HBM bytes moved by ops run one by one versus by the kernel that replaces them.

The model: an op run on its own reads each tensor input once and writes its output once; views move
nothing; a fused kernel reads each external input once and writes each output once.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.fx


def _int(size: object) -> int:
    if isinstance(size, int):
        return size
    hint = getattr(getattr(size, "node", None), "hint", None)
    return int(hint) if hint is not None else 1


def tensor_bytes(val: object) -> int:
    if not isinstance(val, torch.Tensor):
        return 0
    numel = 1
    for size in val.shape:
        numel *= _int(size)
    return numel * val.element_size()


def value_bytes(node: torch.fx.Node) -> int:
    return tensor_bytes(node.meta.get("val"))


def op_bytes(node: torch.fx.Node) -> int:
    """Bytes one op moves on its own: its tensor inputs read, its output written."""
    return sum(value_bytes(a) for a in node.all_input_nodes) + value_bytes(node)


def unfused_bytes(nodes: Iterable[torch.fx.Node]) -> int:
    return sum(op_bytes(n) for n in nodes)


def fused_bytes(inputs: Iterable[torch.fx.Node], outputs: Iterable[torch.fx.Node]) -> int:
    return sum(value_bytes(n) for n in inputs) + sum(value_bytes(n) for n in outputs)
