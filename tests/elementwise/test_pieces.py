"""Cats and slice_backwards in fused groups: each piece read where its guard holds (`elementwise/pieces.py`), so
that rotary embeddings' ``rotate_half``, forward and backward, is one kernel with the products around it."""
from __future__ import annotations

import pytest
import torch
from support import check, fused_kernel_count, random_tensor, rewrites

import fusepass


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rotary(q, cos, sin):  # Llama's apply_rotary_pos_emb, for one of q and k
    return q * cos + rotate_half(q) * sin


def middle_dim(a, b):
    return torch.cat((a.sin(), b * 2.0, a[:, :2].cos()), dim=1).tanh()


def permuted(a, b):  # the cat read through a permute: its guard on another dim of the group's
    return torch.cat((a.exp(), b), dim=2).permute(0, 2, 1) * 0.5 + 1.0


def one_coordinate(a, b, c):  # the cat read at one coordinate of its dim: the piece holding it, no guard
    return torch.cat((a.sin(), b.cos()), dim=1).select(1, 4) * c


def sliced_gradient(x, y):  # the backward places the slice's gradient into x's (slice_backward)
    return (x[:, 2:7].exp() * 3.0).sigmoid() + y


def hotspot_ops(report: fusepass.Report) -> set[str]:
    return {op for h in report.hotspots for op in h.ops if "cat" in op or "slice_backward" in op}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_embeddings_forward_and_backward_are_one_kernel_each(dtype):
    q = random_tensor((2, 3, 11, 14), dtype)
    cos, sin = random_tensor((11, 14), dtype), random_tensor((11, 14), dtype)
    report = check(rotary, q, cos, sin, backward=True)
    assert fused_kernel_count(report, "forward") == 1 and not hotspot_ops(report), report
    assert "aten.cat" in rewrites(report, "elementwise", "forward")[0].ops
    assert any("aten.slice_backward" in r.ops for r in rewrites(report, "elementwise", "backward")), report


@pytest.mark.parametrize("fn, shapes", [(middle_dim, [(3, 5, 7), (3, 4, 7)]), (permuted, [(2, 5, 3), (2, 5, 4)]),
                                        (sliced_gradient, [(4, 9), (4, 5)])],
                         ids=["middle dim", "permuted", "slice_backward"])
def test_pieces_join_their_neighbours(fn, shapes):
    report = check(fn, *(random_tensor(s, torch.float32) for s in shapes), backward=True)
    assert not hotspot_ops(report), report


def test_a_cat_read_at_one_coordinate_takes_the_piece_there():
    report = check(one_coordinate, *(random_tensor(s, torch.float32) for s in [(3, 3, 5), (3, 4, 5), (3, 5)]),
                   backward=True)
    assert not hotspot_ops(report) and fused_kernel_count(report, "forward") == 1, report


def scalar_in_pieces(x, s):  # each piece reads the one-element tensor: a load moving along no dim, unguarded
    return torch.cat(((x[4:] + s).sin(), x[:4] * s), dim=0) + s


def test_a_one_element_tensor_read_in_each_piece():
    report = check(scalar_in_pieces, random_tensor((9,), torch.bfloat16), random_tensor((1,), torch.bfloat16),
                   backward=True, backend=fusepass.backend(strict=True))
    assert not hotspot_ops(report) and fused_kernel_count(report, "forward") == 1, report


def mixed_dtypes(a, b):
    return torch.cat((a.sin(), b.cos()), dim=-1) * 2.0


def test_a_cat_of_other_dtypes_converts_each_piece_to_its_result():
    report = check(mixed_dtypes, random_tensor((4, 5), torch.bfloat16), random_tensor((4, 3), torch.float32),
                   backward=True)
    assert not hotspot_ops(report) and fused_kernel_count(report, "forward") == 1, report


def empty_legacy(a):
    """torch.cat skips a 1-d empty tensor whatever the others' ranks (legacy behaviour): not lowered as pieces."""
    return torch.cat((a.sin(), torch.empty(0, device=a.device)), dim=1) * 2.0


def test_a_cat_with_an_empty_one_dimensional_tensor_stays_an_aten_op():
    report = check(empty_legacy, random_tensor((4, 5), torch.float32))
    assert any("another rank" in h.reason for h in report.hotspots), report
