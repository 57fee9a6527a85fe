"""Where the process asks for deterministic algorithms, an attention whose backward kernel would sum a score
input's gradient with atomic adds (a learnable bias, in no fixed order) is left to the replaced ops and
reported as a hotspot with the reason; one whose bias takes no gradient is rewritten as ever."""
from __future__ import annotations

import pytest
import torch
from support import SUMMED_GRADIENT_FP32, check, random_tensor


def alibi_causal(q, k, v, slopes):
    n = q.shape[-2]
    distance = torch.arange(n, device=q.device)[None, :] - torch.arange(n, device=q.device)[:, None]
    s = q @ k.transpose(-1, -2) * 0.25 + slopes[:, None, None] * distance
    return torch.softmax(s.masked_fill(distance > 0, float("-inf")), dim=-1) @ v


def alibi_fixed_slopes(q, k, v):
    slopes = 2.0 ** -torch.arange(1, q.shape[1] + 1, device=q.device, dtype=q.dtype)
    return alibi_causal(q, k, v, slopes)


@pytest.fixture
def deterministic():
    enabled, warn_only = torch.are_deterministic_algorithms_enabled(), \
        torch.is_deterministic_algorithms_warn_only_enabled()
    # Warnings only: eager's own matmuls on the GPU would otherwise ask for a cuBLAS workspace setting.
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def _qkv():
    return (random_tensor((2, 3, 29, 16), torch.float32) for _ in range(3))


def test_a_learnable_bias_is_left_to_the_replaced_ops(deterministic):
    report = check(alibi_causal, *_qkv(), random_tensor((3,), torch.float32), backward=True,
                   **SUMMED_GRADIENT_FP32)
    assert not [r for r in report.rewrites if r.kind == "attention"]
    hotspot, = [h for h in report.hotspots if h.kind == "attention"]
    assert hotspot.reason.startswith("deterministic algorithms are requested")


def test_a_bias_without_a_gradient_is_rewritten(deterministic):
    report = check(alibi_fixed_slopes, *_qkv(), backward=True)
    assert [r.kind for r in report.rewrites] == ["attention", "attention"]
    assert not [h for h in report.hotspots if h.kind == "attention"]


def test_a_learnable_bias_is_rewritten_where_determinism_is_not_asked():
    report = check(alibi_causal, *_qkv(), random_tensor((3,), torch.float32), backward=True,
                   **SUMMED_GRADIENT_FP32)
    assert [r.kind for r in report.rewrites] == ["attention", "attention"]
