"""`choose_blocks`: tiles of a pointwise kernel's coalesced sizes, their rows padded by at most
`MAX_ROW_PADDING` (a program computes its masked lanes too); the kernel's grid and mask variants."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support import random_tensor

import fusepass
from fusepass.elementwise import kernel as pointwise
from fusepass.elementwise.kernel import HUNGRY_TILE, MAX_ROW_PADDING, MIN_ROW_TILE, choose_blocks
from fusepass.runtime.device import interpreting
from fusepass.runtime.sizes import cdiv


def _is_power_of_two(n):
    return n > 0 and n & (n - 1) == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 1 << 20), min_size=1, max_size=3), st.booleans())
def test_tiles_fit_and_pad_rows_little(sizes, register_hungry):
    xblock, yblock, num_warps = choose_blocks(sizes, register_hungry)
    tile = 1 << 14 if interpreting() else HUNGRY_TILE if register_hungry else 2048
    assert _is_power_of_two(xblock) and _is_power_of_two(yblock) and xblock * yblock <= tile
    assert num_warps in (4, 8)
    if len(sizes) == 1:
        assert xblock == 1
    elif yblock > MIN_ROW_TILE:
        assert cdiv(sizes[-1], yblock) * yblock <= sizes[-1] * (1 + MAX_ROW_PADDING)


def test_a_row_of_11585_takes_tiles_512_wide():
    # 6 tiles of 2048 or 12 of 1024 pad it by 6 %, 23 of 512 by 1.6 %.
    xblock, yblock, _ = choose_blocks([11585, 11585])
    assert yblock == 512 and xblock * yblock == (1 << 14 if interpreting() else 2048)


def test_a_register_hungry_kernel_takes_two_elements_a_thread(monkeypatch):
    monkeypatch.setattr(pointwise, "interpreting", lambda: False)  # the GPU's tiles
    xblock, yblock, num_warps = choose_blocks([1 << 26], register_hungry=True)
    assert xblock * yblock == 2 * 32 * num_warps
    xblock, yblock, num_warps = choose_blocks([1 << 26])
    assert xblock * yblock == 8 * 32 * num_warps


def _rows_plus_column(x, b):
    return torch.sigmoid(x * 0.5 + b) * x


@pytest.mark.parametrize("grid_2d", [True, False], ids=["2d-grid", "flat-grid"])
@pytest.mark.parametrize("shape", [(37, 45), (64, 128), (3, 5, 7), (300, 200)], ids=str)
def test_every_grid_and_mask_variant_computes_eager(monkeypatch, grid_2d, shape):
    """Column blocks on the grid's first axis and row blocks on its second, or one axis split by a division
    (row blocks past CUDA's limit on the second axis); masked, or unmasked where the blocks divide the sizes
    (64 x 128 here; 300 x 200 takes several blocks along both axes)."""
    if not grid_2d:
        monkeypatch.setattr(pointwise, "MAX_GRID_Y", 0)
    variants = []
    source = pointwise.kernel_source
    monkeypatch.setattr(pointwise, "kernel_source", lambda *a: variants.append(a[2]) or source(*a))
    monkeypatch.setattr(pointwise, "_kernels", {})
    x, b = random_tensor(shape, torch.float32), random_tensor(shape[-1:], torch.float32)
    out = torch.compile(_rows_plus_column, backend=fusepass.backend(strict=True))(x, b)
    torch.testing.assert_close(out, _rows_plus_column(x, b))
    (variant,) = variants
    assert variant.grid_2d == grid_2d and variant.even == (shape == (64, 128))
