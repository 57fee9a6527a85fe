"""Lengths other than those Dynamo saw, at which a symbolic attention's kernels are compiled ahead.

A flash kernel is compiled per way its last tile along each axis is placed (`flash.tiles.tail_placement`: a
length that is a multiple of the tile or not) and per whether a length is a multiple of 16 (Triton specializes
its int arguments so): a symbolic attention compiled at 1536 still compiles three kernels, ~2 s, at its first
length that no tile divides. The tiles are 128, 64 or 32 long: a length's kind is which of 128, 64, 32 and 16
divide it, one of five. The compile plans the attention at one length of each other kind too, whose rewrite starts
compiling its kernels on background threads (`flash.ahead`), so that a later length of that kind finds them
compiled (a kind whose kernels another kind's are, where no tile of 32 runs, finds them in Triton's cache). Only
sizes past `LONGEST_TILE` twice are taken for lengths (batch and head counts stay as seen), and only made shorter:
a length sliced out of a buffer (nanoGPT's `tril`) stays within it.
"""
from __future__ import annotations

from typing import Any

import sympy
import torch

LONGEST_TILE = 128  # the flash kernels' longest tile along either axis (`flash.config`)
SPECIALIZED_MULTIPLE = 16  # Triton compiles apart an int argument that is a multiple of this
# A length's kind, by the largest of these dividing it (None: no multiple of 16), each with the step below a multiple
# of LONGEST_TILE to the kind's length below a seen one (None's: the length seen, less one where it is a multiple of
# 16): the tiles' lengths, then Triton's multiple. The kinds most lengths are come first (their kernels compile first).
KINDS = ((LONGEST_TILE, 0), (None, None), (64, 64), (32, 32), (SPECIALIZED_MULTIPLE, SPECIALIZED_MULTIPLE))


def hint(value: Any) -> int:
    return int(value.node.hint) if isinstance(value, torch.SymInt) else int(value)


def size_at(value: Any, lengths: dict[sympy.Symbol, int]) -> int:
    """A size (an int or a symbolic one) with its symbols at `lengths` (the others at their hints)."""
    if not isinstance(value, torch.SymInt):
        return int(value)
    node = value.node
    return int(node.expr.xreplace({s: sympy.Integer(lengths.get(s, node.shape_env.var_to_val[s]))
                                   for s in node.expr.free_symbols}))


class AtLengths:
    """The sizes, strides, dtype and device of a symbolic tensor with its symbols at `lengths` (all that
    `dynamic.plan_static` reads of an input): the sizes Dynamo saw, where `lengths` is empty."""

    def __init__(self, fake: torch.Tensor, lengths: dict[sympy.Symbol, int] | None = None) -> None:
        lengths = lengths or {}
        self.shape = torch.Size([size_at(s, lengths) for s in fake.shape])
        self._stride = tuple(size_at(s, lengths) for s in fake.stride())
        self.dtype = fake.dtype
        self.device = fake.device

    def stride(self) -> tuple[int, ...]:
        return self._stride


def kind(n: int) -> int | None:
    """The largest of `KINDS`' multiples dividing `n`, or None (no multiple of 16)."""
    return next((m for m, _ in KINDS if m is not None and n % m == 0), None)


def other_lengths(tensors: list[torch.Tensor]) -> list[dict[sympy.Symbol, int]]:
    """Values for the length symbols of `tensors`' symbolic shapes, one set per kind (`KINDS`) of length the sizes
    seen are not all of, each length the largest of that kind below the multiple of `LONGEST_TILE` at or below the
    one seen (one less where that is no multiple of 16 and the length seen one); none where no symbol holds a length.
    A symbolic int the attention reads beside them (a window size that changed between calls) keeps its value unless
    a shape holds it."""
    seen: dict[sympy.Symbol, int] = {}
    for tensor in tensors:
        for size in tensor.shape:
            if isinstance(size, torch.SymInt):
                var_to_val = size.node.shape_env.var_to_val
                seen.update((s, int(var_to_val[s])) for s in size.node.expr.free_symbols if s in var_to_val)
    lengths = {s: n for s, n in seen.items() if n > 2 * LONGEST_TILE}
    if not lengths:
        return []
    kinds = []
    for multiple, step in KINDS:
        if all(kind(n) == multiple for n in lengths.values()):
            continue
        if step is None:  # the length seen less one, where that is no multiple of 16
            kinds.append({s: n if kind(n) is None else n - 1 for s, n in lengths.items()})
        else:
            kinds.append({s: n - n % LONGEST_TILE - step for s, n in lengths.items()})
    return kinds
