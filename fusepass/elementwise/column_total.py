"""A column sum's second step: the row kernel's programs each wrote their rows' sums of the columns (partial sums,
P × L), and one launch adds them up for up to `OUTPUTS_A_LAUNCH` column sums of a group, each rounded once to its
output's dtype as torch rounds it.

ATen took two kernels a column sum for it (`sum(0)` over the partials, then the cast), each slower than a whole
column sum of Inductor's (bench/NOTES.md, the BERT profile of 2026-12-06). Here a program holds all P partials of a
few columns in one tile, so its loads go out at once rather than one row after another; programs add in a fixed
order, so a total does not change between runs.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from fusepass.codegen.elementary import to_bfloat16
from fusepass.runtime.launch import launch
from fusepass.runtime.sizes import cdiv, next_power_of_2

OUTPUTS_A_LAUNCH = 4
TILE = 4096  # partial sums a program holds (32 a thread at 4 warps)
# Rows of partials a program adds at a time, whatever their number (the row kernel's programs, which a new sequence
# length changes): one compiled kernel for every length. The row kernel runs up to two programs a multiprocessor
# (`row_kernel.COLUMN_PROGRAMS_PER_SM`): one step on a GPU of up to 256.
BLOCK_P = 512


@triton.jit
def _rounded(total, out):
    """`total` as `out` holds it, rounded as torch rounds: a float64 total to float32 first, then (half floats)
    once more, to nearest even."""
    if out.dtype.element_ty == tl.float64:
        return total
    elif out.dtype.element_ty == tl.bfloat16:
        return to_bfloat16(total)
    else:
        return total.to(tl.float32).to(out.dtype.element_ty)


@triton.jit(do_not_specialize=["programs"])  # the rows' count sets it: one kernel for every length
def _column_total_kernel(partials, out0, out1, out2, out3, programs, length,
                         BLOCK_P: tl.constexpr, BLOCK_L: tl.constexpr):
    which = tl.program_id(1)  # the column sum: its partials are the `which`-th P × L block
    cols = tl.program_id(0) * BLOCK_L + tl.arange(0, BLOCK_L)
    base = partials + which.to(tl.int64) * programs * length
    total = tl.zeros([BLOCK_L], dtype=partials.dtype.element_ty)
    for start in range(0, programs, BLOCK_P):
        rows = start + tl.arange(0, BLOCK_P)
        mask = (rows[:, None] < programs) & (cols[None, :] < length)
        total += tl.sum(tl.load(base + rows[:, None] * length + cols[None, :], mask=mask, other=0.0), axis=0)
    in_row = cols < length
    if which == 0:
        tl.store(out0 + cols, _rounded(total, out0), mask=in_row)
    elif which == 1:
        tl.store(out1 + cols, _rounded(total, out1), mask=in_row)
    elif which == 2:
        tl.store(out2 + cols, _rounded(total, out2), mask=in_row)
    else:
        tl.store(out3 + cols, _rounded(total, out3), mask=in_row)


def add_up(partials: torch.Tensor, outputs: Sequence[torch.Tensor]) -> None:
    """Write into each of `outputs` (contiguous, L elements) the sum over the programs of its partial sums:
    `partials` is C × P × L (C = len(outputs)), contiguous."""
    count, programs, length = partials.shape
    assert count == len(outputs) and partials.is_contiguous()
    if length == 0:
        return
    block_l = min(next_power_of_2(length), TILE // BLOCK_P)
    for first in range(0, count, OUTPUTS_A_LAUNCH):
        chosen = list(outputs[first:first + OUTPUTS_A_LAUNCH])
        pointers = chosen + [chosen[0]] * (OUTPUTS_A_LAUNCH - len(chosen))  # the unused ones are never written
        launch(_column_total_kernel, (cdiv(length, block_l), len(chosen)), partials[first], *pointers, programs,
               length, BLOCK_P=BLOCK_P, BLOCK_L=block_l, num_warps=4)
