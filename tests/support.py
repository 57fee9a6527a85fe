"""Shared checks: run a function eagerly and under fusepass, compare outputs and gradients."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

import fusepass

TOLERANCES = {
    torch.float64: dict(rtol=1e-9, atol=1e-9),
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
}


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    return TOLERANCES.get(dtype, dict(rtol=0, atol=0))


def _clone(x: object, requires_grad: bool) -> object:
    if isinstance(x, torch.Tensor):
        y = x.detach().clone()
        if requires_grad and x.is_floating_point():
            y.requires_grad_(True)
        return y
    return x


def assert_close(actual: object, expected: object, **tol: float) -> None:
    if isinstance(expected, (tuple, list)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            assert_close(a, e, **tol)
        return
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
        assert actual.shape == expected.shape, (actual.shape, expected.shape)
        t = tol or tolerance(expected.dtype)
        torch.testing.assert_close(actual, expected, equal_nan=True, **t)
        return
    assert actual == expected


def check(fn: Callable[..., object], *inputs: object, backward: bool = False,
          backend: object = "fusepass", **tol: float) -> fusepass.Report:
    """``fn`` under fusepass computes what it computes eagerly, forward and (optionally) backward."""
    fusepass.reset()
    eager_inputs = [_clone(x, backward) for x in inputs]
    fused_inputs = [_clone(x, backward) for x in inputs]
    expected = fn(*eager_inputs)
    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    actual = compiled(*fused_inputs)
    assert_close(actual, expected, **tol)
    if backward:
        outs = expected if isinstance(expected, (tuple, list)) else (expected,)
        grads = [torch.randn_like(o) for o in outs if o.requires_grad]
        torch.autograd.backward([o for o in outs if o.requires_grad], grads)
        fused_outs = actual if isinstance(actual, (tuple, list)) else (actual,)
        torch.autograd.backward([o for o in fused_outs if o.requires_grad], grads)
        for e, a in zip(eager_inputs, fused_inputs):
            if isinstance(e, torch.Tensor) and e.requires_grad:
                assert_close(a.grad, e.grad, **tol)
    report = fusepass.last_report()
    assert report is not None
    return report


def rewrites(report: fusepass.Report, kind: str = "elementwise", phase: str | None = None) -> list:
    return [r for r in report.rewrites if r.kind == kind and (phase is None or r.phase == phase)]


def fused_kernel_count(report: fusepass.Report, phase: str = "forward") -> int:
    graph = report.graphs[phase].graph
    return sum(1 for n in graph.nodes if n.op == "call_function" and type(n.target).__name__ == "PointwiseLauncher")


def random_tensor(shape: Sequence[int], dtype: torch.dtype, device: str = "cpu", low: float = -3,
                  high: float = 3) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape, device=device) > 0.5
    if not dtype.is_floating_point:
        return torch.randint(int(low), int(high) + 1, shape, device=device, dtype=dtype)
    return (torch.rand(shape, device=device, dtype=torch.float64) * (high - low) + low).to(dtype)
