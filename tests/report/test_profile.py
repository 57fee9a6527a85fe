"""FUSEPASS_PROFILE=1: measured times beside the estimates (CUDA only; the timer is injected here)."""
from __future__ import annotations

import pytest
import torch
from support import random_tensor, rewrites

import fusepass
from fusepass.report import profile
from fusepass.report.records import Rewrite


def chain(x):
    return torch.exp(x * 2) + 1


def test_measure_keeps_both_times_with_an_injected_timer():
    record = Rewrite(kind="elementwise", phase="forward", location="?", ops=(), bytes_unfused=0, bytes_fused=0)
    ran = []
    times = iter([0.5, 2.0])
    profile.measure(record, lambda: ran.append("fused"), lambda: ran.append("unfused"),
                    timer=lambda fn: (fn(), next(times))[1])
    assert ran == ["fused", "unfused"]
    assert (record.measured_fused_ms, record.measured_unfused_ms, record.measured_speedup) == (0.5, 2.0, 4.0)


def test_the_first_call_is_measured(monkeypatch):
    monkeypatch.setenv("FUSEPASS_PROFILE", "1")
    monkeypatch.setattr(profile, "can_profile", lambda device: True)  # CUDA's path, on the CPU
    calls = []

    def timer(fn):
        out = fn()
        calls.append(type(out).__name__)
        return 0.25 if len(calls) == 1 else 1.0

    monkeypatch.setattr(profile, "median_ms", timer)
    fusepass.reset()
    x = random_tensor((16, 16), torch.float32)
    f = torch.compile(chain, backend="fusepass")
    f(x)
    f(x)  # later calls are not measured
    (record,) = rewrites(fusepass.last_report())
    assert len(calls) == 2 and (record.measured_fused_ms, record.measured_unfused_ms) == (0.25, 1.0)
    assert "measured 1 ms -> 250 us (4.00x)" in str(fusepass.last_report())


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-only machine's behaviour")
def test_on_the_cpu_one_notice_says_profiling_needs_cuda(monkeypatch):
    monkeypatch.setenv("FUSEPASS_PROFILE", "1")
    fusepass.reset()
    torch.compile(chain, backend="fusepass")(random_tensor((16, 16), torch.float32))
    report = fusepass.last_report()
    assert [n for n in report.notices if "FUSEPASS_PROFILE" in n] == [
        "FUSEPASS_PROFILE=1: profiling needs CUDA; nothing was measured"]
    assert rewrites(report)[0].measured_fused_ms is None


def causal(q, k, v):  # heads folded into the batch: the op's output has another shape than bmm's
    b, h, n, d = q.shape
    s = torch.bmm(q.reshape(b * h, n, d), k.reshape(b * h, n, d).transpose(1, 2))
    s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=q.device).tril(), -1e9)
    return torch.bmm(torch.softmax(s, dim=-1), v.reshape(b * h, n, d))


def test_attention_forward_and_backward_are_measured(monkeypatch):
    monkeypatch.setenv("FUSEPASS_PROFILE", "1")
    monkeypatch.setattr(profile, "can_profile", lambda device: True)
    times = iter([0.5, 3.0, 1.0, 7.0])  # fused forward, unfused forward, fused backward, unfused fwd+bwd

    def timer(fn):
        fn()
        return next(times)

    monkeypatch.setattr(profile, "median_ms", timer)
    fusepass.reset()
    q, k, v = (random_tensor((1, 2, 19, 16), torch.float32).requires_grad_() for _ in range(3))
    out = torch.compile(causal, backend="fusepass")(q, k, v)
    out.sum().backward()
    forward, backward = rewrites(fusepass.last_report(), kind="attention")
    assert (forward.measured_fused_ms, forward.measured_unfused_ms) == (0.5, 3.0)
    assert (backward.measured_fused_ms, backward.measured_unfused_ms) == (1.0, 4.0)  # 7 - 3: the forward
    torch.testing.assert_close(out, causal(q, k, v))
