"""A column sum's second step (`column_total.add_up`): the programs' partial sums added up per column, in the
partials' dtype, rounded once to each output's, several column sums a launch."""
from __future__ import annotations

import pytest
import torch
from support import DEVICE

from fusepass.elementwise import column_total


@pytest.mark.parametrize("count, programs, length", [(1, 5, 37), (2, 13, 3), (6, 3, 70), (3, 0, 9), (1, 1, 1)],
                         ids=["one", "two", "past one launch", "no programs", "one element"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_totals_are_the_partials_summed_and_rounded_once(count, programs, length, dtype):
    partials = torch.randn(count, programs, length, dtype=dtype, device=DEVICE)
    out_dtypes = [torch.bfloat16, torch.float16, dtype, torch.bfloat16, torch.float32, dtype][:count]
    outputs = [torch.full((length,), 7.0, dtype=d, device=DEVICE) for d in out_dtypes]
    column_total.add_up(partials, outputs)
    for partial, out in zip(partials, outputs):
        # (a float32 total may round the other way where the exact sum lies within its error of a tie: one ulp)
        torch.testing.assert_close(out, partial.double().sum(0).to(out.dtype), rtol=torch.finfo(out.dtype).eps,
                                   atol=1e-6 * programs)


def test_more_partials_than_a_tile_are_added_a_block_at_a_time(monkeypatch):
    monkeypatch.setattr(column_total, "BLOCK_P", 4)
    partials = torch.randn(2, 19, 23, dtype=torch.float32, device=DEVICE)
    outputs = [torch.empty(23, dtype=torch.float32, device=DEVICE) for _ in range(2)]
    column_total.add_up(partials, outputs)
    for partial, out in zip(partials, outputs):
        torch.testing.assert_close(out, partial.sum(0))


def test_one_kernel_adds_up_any_count_of_partials(monkeypatch):
    """The row kernel's program count changes with the rows (a new sequence length): the launch's constexprs do
    not, so Triton compiles the kernel once for every length."""
    launched = []
    launch = column_total.launch
    monkeypatch.setattr(column_total, "launch", lambda kernel, grid, *args, **keywords: (
        launched.append(keywords), launch(kernel, grid, *args, **keywords)))
    for programs in (3, 261):
        column_total.add_up(torch.randn(1, programs, 40, device=DEVICE), [torch.empty(40, device=DEVICE)])
    assert launched[0] == launched[1]
