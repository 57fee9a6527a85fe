"""Launch parameters: a kernel that does not fit in shared memory runs with fewer pipeline stages; the head dims'
column blocks and the width the tiles are chosen by."""
from __future__ import annotations

import pytest
import torch
from triton.runtime.errors import OutOfResources

from fusepass.flash.config import (INTERPRETER_CONFIG, FlashConfig, _backward_tiles, backward_configs, forward_warps,
                                   head_blocks, launch_fitting, tile_width)


class Kernel:
    """Fits with at most `fits` stages; records the stages of every attempt."""

    def __init__(self, fits: int) -> None:
        self.fits = fits
        self.attempts: list[int] = []

    def __getitem__(self, grid):
        def launch(*args, num_warps, num_stages, **constants):
            self.attempts.append(num_stages)
            if num_stages > self.fits:
                raise OutOfResources(233472, 232448, "shared memory")
        return launch


def test_fewer_stages_until_it_fits_and_remembered():
    kernel = Kernel(fits=2)
    launch_fitting(kernel, (1,), 0, num_warps=8, num_stages=4, BLOCK=128)
    assert kernel.attempts == [4, 3, 2]
    launch_fitting(kernel, (1,), 0, num_warps=8, num_stages=4, BLOCK=128)
    assert kernel.attempts == [4, 3, 2, 2]


def test_a_kernel_that_never_fits_raises():
    with pytest.raises(OutOfResources):
        launch_fitting(Kernel(fits=0), (1,), num_warps=4, num_stages=2)


def test_forwards_whose_score_functions_read_tables_run_at_twice_four_warps():
    """T5's relative bias (a value per score read from a table) at the 4-warp tiles: the forward at 8 warps, the tiles
    unchanged; other forwards and configs of other warps as configured."""
    four, eight = FlashConfig(128, 128, num_warps=4, num_stages=3), FlashConfig(128, 128, num_warps=8, num_stages=3)
    assert forward_warps(four, reads_tables=True) == 8 and forward_warps(four, reads_tables=False) == 4
    assert forward_warps(eight, reads_tables=True) == 8
    assert forward_warps(INTERPRETER_CONFIG, reads_tables=True) == INTERPRETER_CONFIG.num_warps


@pytest.mark.parametrize("head_dim, blocks", [(16, (16, 0)), (24, (32, 0)), (48, (32, 16)), (64, (64, 0)),
                                              (80, (64, 16)), (96, (64, 32)), (100, (128, 0)), (128, (128, 0)),
                                              (160, (128, 32)), (192, (128, 64)), (200, (256, 0)), (256, (256, 0))])
def test_q_k_head_dims_in_two_parts_where_they_cover_fewer_columns(head_dim, blocks):
    """192 = 128 + 64 columns in two products, not 256 in one; 100 would take 64 + 64, no fewer than 128."""
    assert head_blocks(head_dim) == blocks


def test_tiles_are_chosen_by_the_wider_side():
    """Latent attention's (192, 128) by its q·k columns; wider values than keys by V's padded block."""
    assert tile_width(192, 128) == 192
    assert tile_width(64, 96) == 128
    assert tile_width(128, 128) == 128


@pytest.mark.parametrize("width", [64, 128, 192, 256])
def test_the_devices_backward_configs_keep_the_tiles_choice(width):
    """On a GPU the configs gain the device's descriptors and program groups; every other choice stays, dK and dV
    apart among them (dropped once, the D256 tiles chosen for two launches ran as one and spilled)."""
    chosen = _backward_tiles(width, torch.bfloat16, True)
    device = backward_configs(width, torch.bfloat16, True, torch.device("cuda"))
    assert device.apart == chosen.apart
    for kernel in ("dkdv", "dq"):
        got, expected = getattr(device, kernel), getattr(chosen, kernel)
        assert (got.block_m, got.block_n, got.num_warps, got.num_stages) == \
            (expected.block_m, expected.block_n, expected.num_warps, expected.num_stages)
    assert backward_configs(256, torch.bfloat16, True, torch.device("cuda")).apart
