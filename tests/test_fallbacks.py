"""Nothing falls back unseen: a rewrite that does not run is a hotspot, never a rewrite; Dynamo's own control flow
passes through; a kernel failing on any call, not only the first, hands its work to the ops it replaced."""
from __future__ import annotations

import pytest
import torch
import torch._dynamo.exc
import torch.nn.functional as F
from support import assert_close, check, missed, random_tensor, rewrites

import fusepass
from fusepass import pipeline
from fusepass.elementwise import kernel as pointwise


def attention(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) * 0.25, dim=-1) @ v


def test_a_restart_of_dynamos_analysis_passes_through(monkeypatch):
    capture, calls = pipeline.capture, []

    def restarting(gm, inputs):
        calls.append(1)
        if len(calls) == 1:
            raise torch._dynamo.exc.TensorifyScalarRestartAnalysis("planted")
        return capture(gm, inputs)

    monkeypatch.setattr(pipeline, "capture", restarting)
    fusepass.reset()
    x = random_tensor((6, 5), torch.float32)
    assert_close(torch.compile(lambda x: torch.exp(x) * 2 + 1, backend="fusepass")(x), torch.exp(x) * 2 + 1)
    assert len(calls) == 2  # Dynamo analysed the frame again
    (report,) = fusepass.reports()  # the abandoned compile's report is gone
    assert rewrites(report) and not missed(report)


def test_a_graph_run_unfused_lists_its_rewrites_as_hotspots(monkeypatch):
    def failing(*args, **kwargs):
        raise RuntimeError("planted")

    monkeypatch.setattr(pipeline, "aot_module_simplified", failing)
    q, k, v = (random_tensor((2, 2, 9, 16), torch.float32) for _ in range(3))
    with pytest.warns(RuntimeWarning, match="autograd failed"):
        report = check(attention, q, k, v)
    assert not report.rewrites
    (unfused,) = [h for h in report.hotspots if h.kind == "attention"]
    assert "the graph runs unfused (autograd failed)" in unfused.reason and unfused.bytes > 0


def test_abs_max_backward_runs_its_kernels():
    """The backward of max compares scalars with a tile (isnan, eq, logical_or): Triton's interpreter typed the
    scalars' comparison as float, which ``&`` with a bool tile rejected."""
    x = random_tensor((37, 5), torch.float32)
    report = check(lambda y: y.abs().max(), x, backward=True)
    assert rewrites(report, phase="backward") and not missed(report)


def chain(x, b):
    return F.gelu(x * 0.5 + b) * torch.sigmoid(x)


def test_a_kernel_failing_on_a_later_call_falls_back(monkeypatch):
    fusepass.reset()
    compiled = torch.compile(chain, backend="fusepass", dynamic=True)
    x, b = random_tensor((6, 5), torch.float32), random_tensor((5,), torch.float32)
    assert_close(compiled(x, b), chain(x, b))
    report = fusepass.last_report()
    assert len(rewrites(report)) == 1
    # A new shape needs a new kernel variant; its compile fails.
    monkeypatch.setattr(pointwise, "kernel_source", lambda *args: "@triton.jit\ndef broken(:\n")
    monkeypatch.setattr(pointwise, "_kernels", {})
    x, b = random_tensor((3, 17), torch.float32), random_tensor((17,), torch.float32)
    with pytest.warns(RuntimeWarning, match="running it unfused"):
        assert_close(compiled(x, b), chain(x, b))
    assert_close(compiled(x, b), chain(x, b))  # and on from then
    assert not rewrites(report)
    (hotspot,) = missed(report)
    assert hotspot.kind == "elementwise" and "failed" in hotspot.reason


def test_a_failure_under_triton_s_jit_cache_hook_names_the_hook(monkeypatch):
    """Triton serializes a kernel's constexpr arguments for its JIT cache hook before each compile, which the attention
    kernels' score functions fail: a failure while the hook is set says so, in the warning and the hotspot."""
    import triton

    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", lambda **kwargs: False)
    monkeypatch.setattr(pointwise, "kernel_source", lambda *args: "@triton.jit\ndef broken(:\n")
    monkeypatch.setattr(pointwise, "_kernels", {})
    fusepass.reset()
    x, b = random_tensor((6, 5), torch.float32), random_tensor((5,), torch.float32)
    with pytest.warns(RuntimeWarning, match=r"jit_cache_hook is set.*compilation.listener"):
        assert_close(torch.compile(chain, backend="fusepass")(x, b), chain(x, b))
    (hotspot,) = missed(fusepass.last_report())
    assert "jit_cache_hook is set" in hotspot.reason
