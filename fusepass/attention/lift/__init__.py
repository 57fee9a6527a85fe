"""Lift the score chain — every op between ``q @ kᵀ`` and the softmax — into the kernel's score functions.

Each value the chain reads is evaluated at the coordinates the kernel is at: the flat batch-head index
``f = b·H + h``, the query position ``q`` and the key position ``k`` (``index.Idx``). What that value is
decides how the kernel gets it:

- derived from ``arange``, constants and shapes (causal, window, ALiBi distances, T5 buckets): emitted as
  index arithmetic, no tensor at all;
- a tensor (a padding mask, ALiBi slopes, a bias table, a dense bias): loaded at its strides, gathered
  when the index is computed (``embedding``), broadcast dims costing nothing;
- the scores and what depends on them, or on a tensor that needs a gradient: a small FX graph ``E`` of
  pointwise ops over those loaded and index values (its "leaves").

Pointwise ops go through the one translator, in both places. ``E``'s derivative comes from torch's own
autograd (``make_fx`` of its vjp), so the backward score functions need no second table of derivatives.
A mask at the top of the chain (``masked_fill``, ``where``, or adding ``where(keep, 0, fill)``) is split
off as ``keep`` so the kernel can skip empty tiles and skip mask arithmetic on full ones.

One concept per module: `lifter` (the walk and the assembly; its docstring lists the forms recognized), `values`
(what a value is), `views` (coordinates through views), `index_code`, `egraph` (E), `masks`, `tables` (terms of
the distance alone), `emit` (E as jit functions, with its vjp), `features`.
"""
from fusepass.attention.lift.lifter import Lifter
from fusepass.attention.lift.values import Canon, Lifted

__all__ = ["Canon", "Lifted", "Lifter"]
