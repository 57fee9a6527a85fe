"""The features a report names for an attention ("causal", "window", "alibi", "softcap", "padding_mask", "document",
"bias", "mask", ...), read off the ops and the tensor reads as the chain is lifted."""
from __future__ import annotations

from typing import Any

import torch

from fusepass.attention.lift.values import Code, Diff

aten = torch.ops.aten


class Features:
    def __init__(self) -> None:
        self.names: set[str] = set()
        # The aux tensors read at key positions alone, and those read at query positions: a tensor read on the key
        # side only is a padding mask (document ids are read on both sides).
        self.key_side_reads: set[int] = set()
        self.query_side_reads: set[int] = set()
        self.mask_compares = 0  # the most query-against-key comparisons a mask condition depends on

    def note_op(self, target: Any, args: tuple) -> None:
        """Features the report names, read off the ops as they are lifted."""
        kind = getattr(target, "overloadpacket", None)
        values = [a for a in args if isinstance(a, (Code, Diff))]
        uses = frozenset().union(*[a.uses for a in values]) if values else frozenset()
        if kind == aten.tanh and any(isinstance(a, Diff) for a in values):
            self.names.add("softcap")
        if kind == aten.eq and {"q", "k"} <= uses and "b" in uses:
            self.names.add("document")
        if kind == aten.mul and len(values) == 2:
            a, b = values
            # a per-(batch, head) value times a position-derived one: ALiBi's slope × distance
            if any(isinstance(y, Code) and x.uses and x.uses <= {"b", "h"} and "k" in y.uses
                   for x, y in ((a, b), (b, a))):
                self.names.add("alibi")
        if kind in (aten.masked_fill, aten.where) and any(isinstance(a, Diff) for a in values):
            condition = args[1] if kind == aten.masked_fill else args[0]
            if isinstance(condition, Code):
                self.mask_compares = max(self.mask_compares, condition.compares)
        if kind == aten.add:
            for a in values:
                if isinstance(a, Code) and a.mask is not None:
                    self.mask_compares = max(self.mask_compares, a.compares)

    def note_read(self, tensor: torch.Tensor, uses: frozenset[str], index: int) -> None:
        if uses and uses <= {"b", "k"} and "k" in uses:
            self.key_side_reads.add(index)
        elif {"q", "k"} <= uses:
            self.names.add("mask" if tensor.dtype == torch.bool else "bias")
        if "q" in uses:
            self.query_side_reads.add(index)

    def all(self) -> list[str]:
        """The names, with those the reads and comparisons imply."""
        features = set(self.names)
        if self.key_side_reads - self.query_side_reads:
            features.add("padding_mask")
        if self.mask_compares == 1:
            features.add("causal")
        elif self.mask_compares > 1:
            features.add("window")
        return sorted(features)
