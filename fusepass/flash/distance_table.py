"""Values of the distance k - q alone, tabulated once per call for the flash kernels to read.

A score term that depends on the query and key positions only through their distance (T5's log-bucketed
relative bias: a log, two conversions and a gather per score) takes Nq + Nk - 1 values per batch and head
instead of Nq · Nk; the lifted score functions read it from this table (`fusepass.attention.lift`,
`_tabulated`). The table holds what the same code computes at a (q, k) pair of each distance, so the
scores are the very values the score functions would compute.

Where the value is an element of a tensor a gradient flows to (a learnable relative-position table), the
backward's score functions sum its gradient per distance into a buffer of the table's shape
(`add_by_distance`: a tile's diagonals summed first, one atomic add per distance the tile holds), and
`add_distance_gradients` adds each distance's sum to the element that distance read.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusepass.flash.score_mod import ScoreMod
from fusepass.runtime.launch import launch
from fusepass.runtime.sizes import cdiv

BLOCK = 1024


@triton.jit
def _distances(q_len, n_distances, BLOCK: tl.constexpr):
    """This program's entries of a table's row, and their distances (past the end: the last one again)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    return i, tl.minimum(i, n_distances - 1) - (q_len - 1)


@triton.jit
def _distance_table_kernel(Table, q_len, n_distances, heads, aux, VALUE: tl.constexpr, BLOCK: tl.constexpr):
    i, r = _distances(q_len, n_distances, BLOCK)
    batch_head = tl.program_id(1)
    value = VALUE(r, batch_head // heads, batch_head % heads, aux)
    tl.store(Table + batch_head.to(tl.int64) * n_distances + i, value, mask=i < n_distances)


@triton.jit
def _add_distance_gradients_kernel(Grad, Target, q_len, n_distances, heads, aux, OFFSET: tl.constexpr,
                                   BLOCK: tl.constexpr):
    i, r = _distances(q_len, n_distances, BLOCK)
    batch_head = tl.program_id(1)
    offset = OFFSET(r, batch_head // heads, batch_head % heads, aux)
    grad = tl.load(Grad + batch_head.to(tl.int64) * n_distances + i, mask=i < n_distances, other=0.0)
    tl.atomic_add(Target + offset, grad, mask=i < n_distances)


@triton.jit
def add_by_distance(Grad, offset, values):
    """``Grad[offset] += values`` for a [kv, q] tile whose offsets are k - q plus a constant: the values of each
    distance (a diagonal of the tile) summed first, then one atomic add per distance instead of one per score.

    The tile is sheared (column j rotated up by j rows), so that row i holds diagonal i, and diagonal i - R past
    the wrap. Each diagonal adds at the offset of its first element, which lies inside the tile's key and
    query ranges wherever the diagonal holds any value (positions past them carry clamped offsets and zero
    values). Tiles wider than tall add per score."""
    R: tl.constexpr = values.shape[0]
    C: tl.constexpr = values.shape[1]
    if C > R:
        tl.atomic_add(Grad + offset, values)
    else:
        i = tl.arange(0, R)[:, None]
        j = tl.arange(0, C)[None, :]
        source = (i + j) % R
        wrapped = i + j >= R
        values = tl.gather(values, source, 0)
        offset = tl.gather(offset, source, 0)
        diagonal = tl.arange(0, R)
        tl.atomic_add(Grad + tl.sum(tl.where(j == 0, offset, 0), 1), tl.sum(tl.where(wrapped, 0.0, values), 1))
        tl.atomic_add(Grad + tl.sum(tl.where(j == R - i, offset, 0), 1), tl.sum(tl.where(wrapped, values, 0.0), 1),
                      mask=diagonal > R - C)


def _grid(table) -> tuple[int, int]:
    return cdiv(table.q_len + table.kv_len - 1, BLOCK), table.batch * table.heads


def _shape(table) -> tuple[int, int, int]:
    return table.batch, table.heads, table.q_len + table.kv_len - 1


def distance_tables(mod: ScoreMod, aux: tuple, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The tables of `mod`'s values of the distance alone, [batch, heads, Nq + Nk - 1] fp32 each, in the
    order its score functions read them after `aux`."""
    tables = []
    for value, _, table in mod.tables:
        out = torch.empty(_shape(table), dtype=torch.float32, device=device)
        launch(_distance_table_kernel, _grid(table), out, table.q_len, out.shape[2], table.heads, aux, VALUE=value,
               BLOCK=BLOCK)
        tables.append(out)
    return tuple(tables)


def meta_distance_tables(mod: ScoreMod) -> tuple[torch.Tensor, ...]:
    """`distance_tables` as meta tensors: their shapes and dtype, nothing computed (for `compile_ahead`)."""
    return tuple(torch.empty(_shape(table), dtype=torch.float32, device="meta") for _, _, table in mod.tables)


def distance_gradients(mod: ScoreMod, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Per table, in order: a zeroed fp32 buffer of its shape where a gradient flows to its values (the score
    functions add into it after the caller's aux gradients), else an empty stand-in."""
    return tuple(torch.zeros(_shape(table), dtype=torch.float32, device=device) if table.grad_of is not None
                 else torch.empty(0, device=device) for _, _, table in mod.tables)


def add_distance_gradients(mod: ScoreMod, aux: tuple, aux_grad: tuple, gradients: tuple[torch.Tensor, ...]) -> None:
    """Add each distance's summed gradient (`distance_gradients`, filled by the backward) to the gradient of
    the tensor element its value read."""
    for (_, offset, table), grad in zip(mod.tables, gradients):
        if table.grad_of is not None:
            launch(_add_distance_gradients_kernel, _grid(table), grad, aux_grad[table.grad_of], table.q_len,
                   grad.shape[2], table.heads, aux, OFFSET=offset, BLOCK=BLOCK)
