"""The features a report names for an attention ("causal", "window", "alibi", "softcap", "padding_mask", "document",
"bias", "mask", ...), read off the ops and the tensor reads as the chain is lifted."""
from __future__ import annotations

from collections.abc import Callable
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
        self.dense_reads: set[int] = set()  # aux tensors read at query and key positions

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
            self.dense_reads.add(index)
        if "q" in uses:
            self.query_side_reads.add(index)

    def all(self, key_side_mask: bool = False, keep_reads: Callable[[int], bool] = lambda i: False) -> list[str]:
        """The names, with those the reads and comparisons imply: `key_side_mask`, whether a mask split off the
        scores varies with the key positions alone (a padding mask, however it was built), and `keep_reads`,
        whether that mask reads a given aux tensor (a dense tensor read there is a mask, a float one compared with
        0 as nanoGPT's tril buffer is; read elsewhere, a bias)."""
        features = set(self.names)
        if self.key_side_reads - self.query_side_reads or key_side_mask:
            features.add("padding_mask")
        features |= {"mask" if keep_reads(i) else "bias" for i in self.dense_reads}
        if self.mask_compares == 1:
            features.add("causal")
        elif self.mask_compares > 1:
            features.add("window")
        return sorted(features)
