"""What the attention forms' tests share: small fp32 inputs, and the two checks every family makes of a form.

`check_fused`: the form computes eager's outputs and input gradients under fusepass, and its one attention is
rewritten in the forward and in the backward with exactly the family's features. `check_declined`: the twin is
not rewritten, and the report's attention hotspot says why (pointing into the twin's file).
"""
from __future__ import annotations

import inspect
import os

import torch
from support import check, random_tensor, rewrites

import fusepass

# Scores of a few units in fp32: rounding differences of 1e-7 grow through exp to about 1e-5.
FP32 = dict(rtol=1e-4, atol=1e-4)
B, H = 2, 2


def qkv(n: int, d: int = 16, nk: int | None = None, heads: int = H, kv_heads: int | None = None,
        batch: int = B) -> list[torch.Tensor]:
    """Q [batch, heads, n, d], and K and V [batch, kv_heads, nk, d], uniform in [-3, 3]."""
    kv = (batch, kv_heads or heads, nk or n, d)
    return [random_tensor((batch, heads, n, d), torch.float32), random_tensor(kv, torch.float32),
            random_tensor(kv, torch.float32)]


def features(report: fusepass.Report, phase: str) -> list[list[str]]:
    """The sorted features of each attention rewrite of `phase`."""
    return [sorted(r.features) for r in rewrites(report, kind="attention", phase=phase)]


def check_fused(fn, *inputs, expected: tuple[str, ...], **tol: float) -> fusepass.Report:
    """`fn` computes eager's outputs and gradients under fusepass; its attention is fused, forward and backward,
    reporting exactly `expected`."""
    report = check(fn, *inputs, backward=True, **{**FP32, **tol})
    found = {phase: features(report, phase) for phase in ("forward", "backward")}
    hotspots = [h.reason for h in report.hotspots]
    assert all(len(f) == 1 for f in found.values()), f"not one attention rewrite per phase: {found}, {hotspots}"
    wrong = {phase: f[0] for phase, f in found.items() if f != [sorted(expected)]}
    assert not wrong, f"reported {wrong}, expected {sorted(expected)}; hotspots {hotspots}"
    return report


def attention_hotspots(report: fusepass.Report) -> list:
    return [h for h in report.hotspots if h.kind == "attention"]


def check_declined(fn, *inputs, reason: str, exact: bool = True, **tol: float) -> fusepass.Report:
    """`fn`'s attention is left as written (and, where `exact`, still computes eager's values and gradients):
    no attention rewrite, and a hotspot at `fn`'s file whose reason contains `reason`."""
    if exact:
        report = check(fn, *inputs, backward=True, **{**FP32, **tol})
    else:  # random (dropout): nothing to compare values with
        fusepass.reset()
        torch.compile(fn, backend="fusepass", fullgraph=True)(*inputs)
        report = fusepass.last_report()
    assert not rewrites(report, kind="attention")
    reasons = [h.reason for h in attention_hotspots(report)]
    assert any(reason in r for r in reasons), reasons
    source = os.path.basename(inspect.getsourcefile(fn if inspect.isfunction(fn) else type(fn)))
    locations = [h.location for h in attention_hotspots(report)]
    assert all(source in location for location in locations), locations
    return report


__all__ = ["B", "FP32", "H", "attention_hotspots", "check_declined", "check_fused", "features", "qkv",
           "random_tensor"]
