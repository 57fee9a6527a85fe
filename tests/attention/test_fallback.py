"""An attention kernel that fails at run time: the replaced ops take over, exact forward and backward, with a
warning and a hotspot; ``strict`` raises instead."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from support import DEVICE, SUMMED_GRADIENT_FP32, check, missed, random_tensor, rewrites

import fusepass
from fusepass.attention import call

# Scores of a few units in fp32: rounding differences of 1e-7 grow through exp to about 1e-5.
FP32 = dict(rtol=1e-4, atol=1e-4)


def alibi_causal(q, k, v, slopes):
    n = q.shape[-2]
    distance = torch.arange(n, device=q.device)[None, :] - torch.arange(n, device=q.device)[:, None]
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + slopes[:, None, None] * distance
    s = s.masked_fill(distance > 0, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def _explode(*args, **kwargs):
    raise RuntimeError("planted kernel failure")


@pytest.fixture(autouse=True)
def _no_compiles_ahead(monkeypatch):
    """The failures here warn while the kernels they replace would still be compiling ahead, on threads that
    may swap the process's warning filters (`finish_compiles_ahead`)."""
    monkeypatch.setattr(call, "_compile_ahead", lambda *args: None)


def _inputs():
    q, k, v = (random_tensor((2, 3, 29, 16), torch.float32) for _ in range(3))
    return q, k, v, random_tensor((3,), torch.float32)


@pytest.mark.parametrize("kernel", ["flash_attention_forward", "flash_attention_backward"])
def test_a_failing_kernel_runs_the_replaced_ops(monkeypatch, kernel):
    monkeypatch.setattr(call, kernel, _explode)
    with pytest.warns(RuntimeWarning, match="planted kernel failure"):
        report = check(alibi_causal, *_inputs(), backward=True, **SUMMED_GRADIENT_FP32)  # the slopes learn too
    assert not rewrites(report, kind="attention")  # it runs unfused from then on: a hotspot, not a rewrite
    (hotspot,) = [h for h in report.hotspots if h.kind == "attention"]
    phase = "forward" if kernel == "flash_attention_forward" else "backward"
    assert hotspot.phase == phase
    assert f"attention {phase} kernel failed" in hotspot.reason and "planted" in hotspot.reason


def shared_relative_bias(q, k, v, table):
    """Two attentions reading one relative-position bias, gathered once from a learnable table (T5 passes its
    first layer's bias down): the kernels read the table; the replaced ops, the shared bias."""
    n = q.shape[-2]
    i = torch.arange(n, device=q.device)
    bias = F.embedding((i[None, :] - i[:, None]).clamp(-3, 3) + 3, table).permute(2, 0, 1)
    for _ in range(2):
        q = torch.softmax(q @ k.transpose(-1, -2) + bias, dim=-1) @ v
    return q


@pytest.mark.parametrize("kernel", ["flash_attention_forward", "flash_attention_backward"])
def test_a_failing_kernel_with_a_shared_learnable_bias_keeps_its_gradient(monkeypatch, kernel):
    monkeypatch.setattr(call, kernel, _explode)
    q, k, v, _ = _inputs()
    with pytest.warns(RuntimeWarning, match="planted kernel failure"):
        check(shared_relative_bias, q, k, v, random_tensor((7, 3), torch.float32), backward=True,
              **SUMMED_GRADIENT_FP32)


def test_strict_raises_the_kernels_error(monkeypatch):
    monkeypatch.setattr(call, "flash_attention_forward", _explode)
    with pytest.raises(RuntimeError, match="planted kernel failure"):
        torch.compile(alibi_causal, backend=fusepass.backend(strict=True))(*_inputs())


def dropout_attention(q, k, v):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return F.dropout(torch.softmax(s, dim=-1), p=0.25, training=True) @ v


def test_dropout_fallback_draws_the_same_elements_forward_and_backward(monkeypatch):
    monkeypatch.setattr(call, "flash_attention_forward", _explode)
    n = 24
    q, k = (random_tensor((2, 3, n, n), torch.float32).requires_grad_() for _ in range(2))
    eye = torch.eye(n, device=DEVICE).expand(2, 3, n, n).contiguous().requires_grad_()
    with pytest.warns(RuntimeWarning, match="planted"):
        out = torch.compile(dropout_attention, backend="fusepass")(q, k, eye)  # V = I: out is the dropped P
    grad = torch.randn_like(out)
    (dv,) = torch.autograd.grad(out, (eye,), grad)
    torch.testing.assert_close(dv, out.transpose(-1, -2) @ grad, **FP32)


def test_dropout_backward_failure_after_the_kernels_forward_is_an_error(monkeypatch):
    monkeypatch.setattr(call, "flash_attention_backward", _explode)
    q, k, v = (random_tensor((2, 3, 24, 16), torch.float32).requires_grad_() for _ in range(3))
    out = torch.compile(dropout_attention, backend="fusepass")(q, k, v)
    with pytest.raises(RuntimeError, match="no gradient consistent with that forward"):
        out.sum().backward()


def plain(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) * 0.25, dim=-1) @ v


def test_a_kernel_failing_at_a_new_dynamic_size_is_in_the_compiles_report(monkeypatch):
    fusepass.reset()
    # the fused kernels, not SDPA where it times faster on a GPU: the planted failure is theirs
    compiled = torch.compile(plain, backend=fusepass.backend(sdpa=False), dynamic=True)
    q = random_tensor((1, 2, 9, 16), torch.float32)
    compiled(q, q, q)
    (report,) = fusepass.reports()
    monkeypatch.setattr(call, "flash_attention_forward", _explode)
    q = random_tensor((1, 2, 13, 16), torch.float32)
    with pytest.warns(RuntimeWarning, match="planted kernel failure"):
        torch.testing.assert_close(compiled(q, q, q), plain(q, q, q), **FP32)
    (hotspot,) = [h for h in report.hotspots if h.kind == "attention"]
    assert "attention forward kernel failed" in hotspot.reason


def test_strict_raises_on_every_call(monkeypatch):
    monkeypatch.setattr(call, "flash_attention_forward", _explode)
    compiled = torch.compile(plain, backend=fusepass.backend(strict=True, sdpa=False))
    q = random_tensor((1, 2, 9, 16), torch.float32)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="planted kernel failure"):
            compiled(q, q, q)


def float_scale(q, k, v, scale):
    return torch.softmax(q @ k.transpose(-1, -2) * scale, dim=-1) @ v


def test_a_symbolic_float_in_the_scores_is_declined_with_its_reason():
    fusepass.reset()
    compiled = torch.compile(float_scale, backend="fusepass", dynamic=True)
    q = random_tensor((1, 2, 9, 16), torch.float32)
    torch.testing.assert_close(compiled(q, q, q, 0.25), float_scale(q, q, q, 0.25), **FP32)
    report = fusepass.last_report()
    assert not rewrites(report, kind="attention")
    (hotspot,) = [h for h in report.hotspots if h.kind == "attention"]
    assert "a float Dynamo made symbolic" in hotspot.reason
    assert not [h for h in report.hotspots if h.kind == "fallback"]


def scaled_output_in_place(q, k, v):
    out = torch.softmax(q @ k.transpose(-1, -2) * 0.25, dim=-1) @ v
    out.mul_(2)
    return out


def test_the_attention_output_updated_in_place():
    report = check(scaled_output_in_place, *_inputs()[:3], backward=True, **FP32)
    assert rewrites(report, kind="attention") and not missed(report)
