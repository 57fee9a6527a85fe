"""The score functions the flash kernels call: what the attention pass lifts out of the user's score chain.

See docs/flash-kernel-interface.md for the contract between the lifted functions and the kernels.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DistanceTable:
    """A value of the distance r = k - q alone, tabulated per call over r in [-(q_len - 1), kv_len - 1]
    (`fusepass/flash/distance_table.py`) by the jit function named `function`, ``(r, b, h, aux) → fp32``.
    The table is [batch, heads, q_len + kv_len - 1], batch and heads 1 where the value does not vary with
    them; the score functions read it as the aux tensor after the chain's own and the tables before it."""

    function: str
    batch: int
    heads: int
    q_len: int
    kv_len: int
    # Where the value is an element of aux tensor `grad_of` that a gradient flows to: the jit function
    # ``(r, b, h, aux) → offset`` of that element. The score functions then sum its gradient per distance into
    # aux_grad[the table's slot], and the backward adds each distance's sum at that offset.
    grad_of: int | None = None
    offset_function: str | None = None


@dataclass(frozen=True)
class SeparableKeep:
    """keep = ``rows(b, h, q_idx, aux) == cols(b, h, kv_idx, aux)`` (``!=`` where not `equal`), and `others`'s
    keep where it is given: masks that read no tensors (a causal mask), whose map is cached per shape
    (blockmap.launch_separable_kinds)."""

    equal: bool
    rows: Any
    cols: Any
    others: ScoreMod | None = None


@dataclass(frozen=True)
class ScoreMod:
    """Generated ``@triton.jit`` functions of one attention's score chain.

    ``final = where(keep(b, h, q_idx, kv_idx, aux), score(s, ...), fill(s, ...))`` with ``s = q · k``.
    """

    name: str
    score: Any
    score_grad: Any
    keep: Any = None
    fill: Any = None
    fill_grad: Any = None
    # Upper bound of every fill value: masked tiles are skipped only where that contributes exactly zero.
    fill_bound: float = -math.inf
    has_aux_grad: bool = False
    # Whether keep reads batch / head indices or aux tensors (decides the block map's broadcast axes and
    # whether it can be cached per shape).
    keep_uses_batch: bool = False
    keep_uses_head: bool = False
    keep_reads_aux: bool = False
    # Where keep is, or joins other masks with, a comparison of a value of the query position alone with one of
    # the key position alone (document ids): the block map then classifies tiles by each side's range.
    separable_keep: SeparableKeep | None = None
    # (the value's jit function, the offset's or None, its table), read after aux
    tables: tuple[tuple[Any, Any, DistanceTable], ...] = ()
    # c where SCORE(s) is s · c for a positive constant c: the forward's FULL tiles then fold c into the
    # exponent's fma (max(s · c) is max(s) · c, rounding being monotonic) instead of a product per score.
    linear_scale: float | None = None

    @property
    def has_mask(self) -> bool:
        return self.keep is not None

    @property
    def mask_functions(self) -> tuple:
        """The functions that decide the mask: keep, and a separable keep's sides and other masks. Mods with the
        same ones have one block map at a shape, whichever attention they are (a model's layers lifted alike, an
        attention planned again at a new length: `blockmap.block_map_for`)."""
        separable = self.separable_keep
        if separable is None:
            return (self.keep,)
        others = () if separable.others is None else separable.others.mask_functions
        return (self.keep, separable.equal, separable.rows, separable.cols, *others)
