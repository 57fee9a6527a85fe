"""`add_by_distance`: a tile's gradient summed per distance k - q (its diagonals) before the atomic adds
lands where one atomic add per score would, for tiles taller than wide (sheared), square, and wider than tall
(per score), at the edges of the key and query ranges, where positions past them carry clamped offsets."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fusepass.flash.distance_table import add_by_distance

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _add_tile(Grad, Values, q0, k0, q_len, kv_len, base, R: tl.constexpr, C: tl.constexpr):
    """The dK/dV kernel's view of one [kv, q] tile: clamped positions, zero values past the ranges."""
    kv = k0 + tl.arange(0, R)[:, None]
    q = q0 + tl.arange(0, C)[None, :]
    inside = (kv < kv_len) & (q < q_len)
    values = tl.where(inside, tl.load(Values + tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]), 0.0)
    offset = (tl.minimum(kv, kv_len - 1) + base) - tl.minimum(q, q_len - 1)
    add_by_distance(Grad, offset, values)


def _check(rows, cols, q0, k0, q_len, kv_len):
    base = (q_len - 1) + 100  # the buffer's row for this (b, h) starts at 100
    values = torch.randn(rows, cols, device=DEVICE)
    grad = torch.zeros(100 + q_len + kv_len - 1 + 100, device=DEVICE)
    _add_tile[(1,)](grad, values, q0, k0, q_len, kv_len, base, R=rows, C=cols)
    expected = torch.zeros_like(grad)
    kv = torch.arange(k0, k0 + rows, device=DEVICE)[:, None]
    q = torch.arange(q0, q0 + cols, device=DEVICE)[None, :]
    inside = (kv < kv_len) & (q < q_len)
    offsets = (kv.clamp(max=kv_len - 1) + base - q.clamp(max=q_len - 1)).expand(rows, cols)
    expected.index_add_(0, offsets[inside], values[inside])
    torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows, cols", [(32, 16), (16, 16), (16, 32)])
@pytest.mark.parametrize("q0, k0", [(0, 0), (32, 16), (48, 32)])
def test_sums_land_where_per_score_adds_would(rows, cols, q0, k0):
    _check(rows, cols, q0, k0, q_len=53, kv_len=41)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([(64, 32), (32, 8), (16, 16), (8, 16)]), st.integers(1, 90), st.integers(1, 90),
       st.data())
def test_any_tile_at_any_place(shape, q_len, kv_len, data):
    rows, cols = shape
    q0 = data.draw(st.integers(0, q_len - 1))  # a tile starts inside both ranges
    k0 = data.draw(st.integers(0, kv_len - 1))
    _check(rows, cols, q0, k0, q_len, kv_len)
