"""Index code in int32 where int64 positions provably fit, in int64 where they might not."""
from __future__ import annotations

import inspect
import math

import pytest
import torch
import torch.nn.functional as F
from support import SUMMED_GRADIENT_FP32, check, last_attention, random_tensor


from fusepass.attention.spans import fits, float_rounding, result_span, truncated

aten = torch.ops.aten


@pytest.mark.parametrize("target, spans, expected", [
    (aten.add.Tensor, {"self": (0, 9), "other": (-3, 2), "alpha": (1, 1)}, (-3, 11)),
    (aten.sub.Tensor, {"self": (0, 9), "other": (0, 9), "alpha": (1, 1)}, (-9, 9)),
    (aten.sub.Tensor, {"self": (0, 9), "other": (0, 9), "alpha": (2, 2)}, (-18, 9)),
    (aten.mul.Tensor, {"self": (-2, 3), "other": (-5, 4)}, (-15, 12)),
    (aten.neg.default, {"self": (-2, 3)}, (-3, 2)),
    (aten.abs.default, {"self": (-7, 3)}, (0, 7)),
    (aten.abs.default, {"self": (-7, -3)}, (3, 7)),
    (aten.maximum.default, {"self": (-7, 3), "other": (0, 1)}, (0, 3)),
    (aten.clamp.default, {"self": (-7, 30), "max": (15, 15)}, (-7, 15)),
    (aten.clamp.default, {"self": (-7, 30), "min": (0, 0), "max": (15, 15)}, (0, 15)),
    (aten.clamp.default, {"self": (-7, 30), "min": None}, None),  # a bound of unknown span
    (aten.where.self, {"condition": (0, 1), "self": (0, 4), "other": (-1, -1)}, (-1, 4)),
    (aten.remainder.Scalar, {"self": (0, 9), "other": (4, 4)}, None),  # not tracked: widened
    (aten.add.Tensor, {"self": None, "other": (0, 1), "alpha": (1, 1)}, None),
    (aten.div.Tensor, {"self": (1.0, 8192.0), "other": (8.0, 8.0)}, (0.125, 1024.0)),
    (aten.div.Tensor, {"self": (1.0, 2.0), "other": (-1.0, 1.0)}, None),  # a divisor that may be zero
    (aten.div.Tensor_mode, {"self": (0, 9), "other": (2, 2), "rounding_mode": None}, None),  # floor or trunc
    (aten.log.default, {"self": (1.0, math.e)}, (0.0, 1.0)),
    (aten.log.default, {"self": (0.0, 1.0)}, None),  # log 0 is not finite
])
def test_result_spans(target, spans, expected):
    assert result_span(target, spans) == expected


def test_float_spans_widen_for_rounding_and_truncate_toward_zero():
    low, high = float_rounding((-1.5, 20.0))
    assert low < -1.5 and 20.0 < high < 20.01
    assert truncated(float_rounding((-1.5, 20.0))) == (-1, 20)
    assert float_rounding((0.0, float("inf"))) is None and truncated(None) is None


def test_int32_bounds_are_symmetric():
    assert fits((-(2 ** 31 - 1), 2 ** 31 - 1))
    assert not fits((-(2 ** 31), 0)) and not fits((0, 2 ** 31)) and not fits(None)


def alibi(q, k, v, slopes):
    n = q.shape[-2]
    i = torch.arange(n, device=q.device)
    bias = slopes[:, None, None] * (i[None, None, :] - i[None, :, None])
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias, dim=-1) @ v


def alibi_through_int64_overflow(q, k, v, slopes):
    """The same distances, passing through values int32 cannot hold: computed in int64 or wrong."""
    n = q.shape[-2]
    i = torch.arange(n, device=q.device)
    distance = ((i[None, None, :] - i[None, :, None]) * 2 ** 33) // 2 ** 33
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + slopes[:, None, None] * distance,
                         dim=-1) @ v


def _score_source() -> str:
    spec = last_attention()
    return inspect.getsource(getattr(spec.mod.score, "fn", spec.mod.score))


@pytest.mark.parametrize("fn, int64", [(alibi, False), (alibi_through_int64_overflow, True)])
def test_positions_run_in_int32_unless_they_may_overflow(fn, int64):
    q, k, v = (random_tensor((2, 3, 37, 16), torch.float32) for _ in range(3))
    slopes = random_tensor((3,), torch.float32)
    # The slopes' gradients sum ~10^4 products with cancellation: fp32 summation order moves them by ~1e-3.
    check(fn, q, k, v, slopes, backward=True, **SUMMED_GRADIENT_FP32)
    source = _score_source()
    assert ("tl.int64" in source) == int64, source
    assert "/" not in source  # the division by sqrt(d) is a product with its reciprocal


def alibi_far_from_zero(q, k, v, slopes):
    """Positions offset by 2^24: their differences are small, but fp32 cannot hold the positions exactly."""
    n = q.shape[-2]
    i = torch.arange(n, device=q.device) + 2 ** 24 + 1
    bias = slopes[:, None, None] * (i[None, None, :] - i[None, :, None])
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias, dim=-1) @ v


@pytest.mark.parametrize("fn, per_vector", [(alibi, True), (alibi_far_from_zero, False)])
def test_distances_convert_to_float_per_position_vector_where_exact(fn, per_vector):
    q, k, v = (random_tensor((2, 3, 37, 16), torch.float32) for _ in range(3))
    slopes = random_tensor((3,), torch.float32) * 4  # large enough that a distance off by one shows
    check(fn, q, k, v, slopes, backward=True, **SUMMED_GRADIENT_FP32)
    source = _score_source()
    assert ("(kv_idx).to(tl.float32)" in source) == per_vector, source


def t5_bucket_bias(q, k, v, table, log_of=lambda d: d):
    n = q.shape[-2]
    i = torch.arange(n, device=q.device)
    relative = i[None, :] - i[:, None]
    distance = relative.abs()
    large = 4 + (torch.log(log_of(distance.float().clamp(min=1) / 4)) / math.log(32 / 4) * 4).to(torch.long)
    buckets = (relative > 0).to(torch.long) * 8 + torch.where(distance < 4, distance, large.clamp(max=7))
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return torch.softmax(scores + F.embedding(buckets, table).permute(2, 0, 1), dim=-1) @ v


@pytest.mark.parametrize("log_of, int64", [
    (lambda d: d, False),
    (lambda d: d - 0.25, True),  # may reach log of a non-positive value: no span, the buckets stay in int64
])
def test_log_buckets_run_in_int32_where_the_logs_are_bounded(log_of, int64):
    q, k, v = (random_tensor((2, 3, 37, 16), torch.float32) for _ in range(3))
    table = random_tensor((16, 3), torch.float32)
    check(lambda q, k, v, table: t5_bucket_bias(q, k, v, table, log_of), q, k, v, table, backward=True)
    source = last_attention().spec.lifted.source  # the buckets are computed per distance (a table)
    assert ("tl.int64" in source) == int64, source
