"""Unaligned matmuls padded where the GPU's kernel for them is slow: the same products, a rewrite in the report."""
from __future__ import annotations

import pytest
import torch
from support import random_tensor, rewrites

import fusepass
from fusepass.matmul import pad


@pytest.mark.parametrize("shapes", [((13, 7), (7, 11)), ((5, 13, 7), (5, 7, 9))])
@pytest.mark.parametrize("bias", [None, "row", "full"])
@pytest.mark.parametrize("transposed", [False, True])
def test_padded_products_are_the_products(shapes, bias, transposed):
    """Column-major operands (a weight gradient's) are padded in their own order, and stay column-major."""
    a, b = (random_tensor(s, torch.float32) for s in shapes)
    if transposed:
        a, b = (x.mT.contiguous().mT for x in (a, b))
        assert pad._padded(a, 3, 1).stride(-2) == 1
    if bias is not None and a.dim() == 3:
        pytest.skip("bmm takes no bias")
    m, n = a.shape[-2], b.shape[-1]
    c = None if bias is None else random_tensor((n,) if bias == "row" else (m, n), torch.float32)
    expected = torch.addmm(c, a, b) if c is not None else a @ b
    got = pad.padded_matmul(c, a, b, (3, 1, 5))
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected)


def test_timed_operands_have_the_graphs_strides():
    """cuBLAS picks its kernel by the strides too: the LM head's weight gradient reads a transposed operand whose
    leading dimension is unaligned, slow where the same values contiguous are fast."""
    transposed = torch.empty(8, 13).t()
    broadcast = torch.empty(7).expand(5, 7)
    for t in (transposed, broadcast):
        timed = pad.random_like(t)
        assert (timed.shape, timed.stride(), timed.dtype) == (t.shape, t.stride(), t.dtype)


def mlp(x, w1, b1, w2):
    return torch.relu(x @ w1.t() + b1) @ w2.t()


def test_a_slow_unaligned_matmul_is_padded_forward_and_backward(monkeypatch):
    """Where the running device's timing says the padded form is faster (here: said, on the CPU), every matmul of
    the forward and backward graphs with an unaligned dim runs padded, with eager's results and gradients."""
    monkeypatch.setattr(pad, "_padding", lambda node, a, b: tuple(pad._aligned(d, torch.float16) - d for d in
                                                                   (a.shape[-2], a.shape[-1], b.shape[-1])))
    monkeypatch.setattr(pad, "_measured", lambda *args: (1.0, 0.5))
    x = random_tensor((13, 7), torch.float32).requires_grad_()
    w1, b1, w2 = (random_tensor(s, torch.float32).requires_grad_() for s in ((11, 7), (11,), (5, 11)))
    fusepass.reset()
    out = torch.compile(mlp, backend="fusepass")(x, w1, b1, w2)
    expected = mlp(x, w1, b1, w2)
    torch.testing.assert_close(out, expected)
    grads = torch.autograd.grad(out.sum(), (x, w1, b1, w2))
    for g, e in zip(grads, torch.autograd.grad(expected.sum(), (x, w1, b1, w2))):
        torch.testing.assert_close(g, e)
    report = fusepass.last_report()
    forward, backward = rewrites(report, "matmul", "forward"), rewrites(report, "matmul", "backward")
    assert forward and backward
    assert forward[0].detail["padded"] and forward[0].measured_fused_ms == 0.5
