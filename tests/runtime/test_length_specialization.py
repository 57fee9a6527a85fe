"""Kernels launched again at a new sequence length take its lengths, block and program counts unspecialised: Triton
would compile each again wherever a count's divisibility by 16 changed (bench/NOTES.md, the new-lengths runs), and
none of them aligns a load by those values."""
from __future__ import annotations

import pytest

from fusepass.attention import sdpa_floor
from fusepass.elementwise import column_total
from fusepass.flash import blockmap


def _unspecialized(kernel) -> set[str]:
    """The parameters Triton does not specialise on their values, compiled or interpreted."""
    if hasattr(kernel, "params"):
        return {p.name for p in kernel.params if p.do_not_specialize}
    return set(kernel.kwargs["do_not_specialize"] or ())


@pytest.mark.parametrize("kernel, by_length", [
    (blockmap._tile_kind_kernel, {"q_len", "kv_len", "n_q_blocks", "n_kv_blocks"}),
    (blockmap._separable_kind_kernel, {"q_len", "kv_len", "n_q_blocks", "n_kv_blocks"}),
    (blockmap._tile_lists_kernel, {"n_q_blocks", "n_kind_q_blocks", "n_kv_blocks"}),
    (sdpa_floor._mask_kernel, {"q_len", "kv_len"}),
    (column_total._column_total_kernel, {"programs"}),
], ids=["tile kinds", "separable kinds", "tile lists", "floor's mask", "column totals"])
def test_a_kernel_is_not_specialised_on_lengths(kernel, by_length):
    assert by_length <= _unspecialized(kernel)
