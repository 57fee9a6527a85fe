"""`tiles.truncated`, the exact weights' cut (docs/flash-kernel-interface.md): a float32 cut toward zero to the
mantissa of bf16 or fp16 by one bitwise and is a value of that dtype, no farther from zero than the input, and less
than one of the dtype's units in the last place below it: the value the dtype's round-toward-zero conversion gives,
which its conversion for the product with V then keeps exactly. On the weights' range, (0, 1] (fp16: from its
smallest normal, 2^-14)."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from support import DEVICE

from fusepass.flash.tiles import truncated


@triton.jit
def _cut(X, Like, Out, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(Out + i, truncated(tl.load(X + i), tl.load(Like + i)))


@pytest.mark.parametrize("dtype, smallest", [(torch.bfloat16, 2.0 ** -126), (torch.float16, 2.0 ** -14)], ids=str)
def test_a_weight_cut_toward_zero_is_a_value_of_the_dtype_within_one_unit_below(dtype, smallest):
    n = 4096
    x = torch.exp2(torch.rand(n, dtype=torch.float64, device=DEVICE) * torch.log2(torch.tensor(smallest))).float()
    x[:4] = torch.tensor([1.0, smallest, 0.5 + 2.0 ** -20, 1.0 - 2.0 ** -24])  # edges: exact values and just off them
    out = torch.empty_like(x)
    _cut[(1,)](x, torch.zeros(n, dtype=dtype, device=DEVICE), out, N=n)
    assert torch.equal(out.to(dtype).float(), out)  # a value of the dtype, kept by its conversion
    assert (out <= x).all() and (out > 0).all()
    ulp = torch.finfo(dtype).eps * torch.exp2(torch.floor(torch.log2(x.double()))).float()
    assert (x - out < ulp).all()
    assert torch.equal(out[:4], torch.tensor([1.0, smallest, 0.5, 1.0 - torch.finfo(dtype).eps / 2], device=DEVICE))
