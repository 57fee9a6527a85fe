"""Unaligned matmuls padded where the GPU's kernel for them is slow: the same products, a rewrite in the report."""
from __future__ import annotations

import operator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import random_tensor, rewrites

import fusepass
from fusepass.elementwise.kernel import PointwiseLauncher
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


def lm_head_loss(x, w, targets):
    return torch.nn.functional.cross_entropy((x @ w.t()).flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("fused", [True, False])
def test_a_gradient_two_backward_matmuls_pad_alike_is_padded_once(monkeypatch, fused):
    """An LM head's backward reads the logits' gradient as dX = dY · W (its columns, K, padded) and dW = dYᵀ · X (the
    same columns as M): one padded copy serves both, the second product reading it transposed; the gradients are
    eager's. The weight's pad (K of dX, its rows) is a pad of its own. With the loss's backward fused, its kernel
    writes the gradient padded: no copy."""
    monkeypatch.setattr(pad, "_padding", lambda node, a, b: tuple(pad._aligned(d, torch.float16) - d for d in
                                                                   (a.shape[-2], a.shape[-1], b.shape[-1])) or None)
    monkeypatch.setattr(pad, "_measured", lambda *args: (1.0, 0.5))
    x = random_tensor((2, 8, 16), torch.float32).requires_grad_()
    w = random_tensor((37, 16), torch.float32).requires_grad_()
    targets = torch.randint(0, 37, (2, 8), device=x.device)
    fusepass.reset()
    compiled = torch.compile(lm_head_loss, backend=fusepass.backend(strict=True, elementwise=fused))
    loss = compiled(x, w, targets)
    expected = lm_head_loss(x, w, targets)
    torch.testing.assert_close(loss, expected)
    for got, want in zip(torch.autograd.grad(loss, (x, w)), torch.autograd.grad(expected, (x, w))):
        torch.testing.assert_close(got, want)
    report = fusepass.last_report()
    backward = report.graphs["backward"].graph
    products = [n for n in backward.nodes if n.target is pad.product_of_padded]
    assert len(products) == 2
    (shared,) = {p.args[1] if p.args[1].target is not torch.ops.aten.t.default else p.args[1].args[0]
                 for p in products}
    assert tuple(shared.meta["val"].shape) == (16, 40)  # the logits' gradient, its 37 columns padded to 40
    assert sorted(r.detail.get("shared pads", 0) for r in rewrites(report, "matmul", "backward")) == [1, 1]
    if fused:  # the loss backward's kernel's result
        assert shared.target is operator.getitem and isinstance(shared.args[0].target, PointwiseLauncher)
        (loss_backward,) = [r for r in rewrites(report, "reduction", "backward") if "written padded" in r.detail]
        assert loss_backward.detail["written padded"] == ["[16, 40] for a matmul (+0 rows, +3 columns)"]
    else:
        assert shared.target is pad._padded
    # a second call at another batch (a recompile): eager's gradients still
    x3 = random_tensor((3, 8, 16), torch.float32).requires_grad_()
    targets = torch.randint(0, 37, (3, 8), device=x.device)
    loss, expected = compiled(x3, w, targets), lm_head_loss(x3, w, targets)
    torch.testing.assert_close(loss, expected)
    for got, want in zip(torch.autograd.grad(loss, (x3, w)), torch.autograd.grad(expected, (x3, w))):
        torch.testing.assert_close(got, want)


def test_a_value_and_its_transpose_padded_along_the_same_dim_are_two_copies(monkeypatch):
    """x · w and x · wᵀ pad K: x's pad is shared, but w's rows and wᵀ's rows (w's columns) are two pads, each
    feeding its own product."""
    monkeypatch.setattr(pad, "_measured", lambda *args: (1.0, 0.5))
    monkeypatch.setattr(pad, "_padding", lambda node, a, b: (0, 3, 0))
    x, w = random_tensor((8, 13), torch.float32), random_tensor((13, 13), torch.float32)
    fusepass.reset()
    out = torch.compile(lambda x, w: x @ w + x @ w.t(), backend="fusepass")(x, w)
    torch.testing.assert_close(out, x @ w + x @ w.t())
    (graph,) = fusepass.last_report().graphs.values()
    pads = [n for n in graph.graph.nodes if n.target is pad._padded]
    assert sorted(len(n.users) for n in pads) == [1, 1, 2]


@pytest.mark.parametrize("bias", ["row", "full"])
def test_a_shared_pad_feeds_a_product_with_a_bias(monkeypatch, bias):
    """addmm and mm pad x's columns (K) and N alike: x padded once; the bias, spanning N (and M), padded as the
    product's own pads say."""
    monkeypatch.setattr(pad, "_measured", lambda *args: (1.0, 0.5))
    monkeypatch.setattr(pad, "_padding", lambda node, a, b: (3, 3, 5))
    x, w, v = random_tensor((8, 13), torch.float32), random_tensor((11, 13), torch.float32), \
        random_tensor((13, 11), torch.float32)
    c = random_tensor((11,) if bias == "row" else (8, 11), torch.float32)

    def fn(x, w, c, v):
        return torch.addmm(c, x, w.t()) * (x @ v)

    fusepass.reset()
    torch.testing.assert_close(torch.compile(fn, backend="fusepass")(x, w, c, v), fn(x, w, c, v))
    (graph,) = fusepass.last_report().graphs.values()
    assert [len(n.users) for n in graph.graph.nodes if n.target is pad._padded].count(2) == 1


products = st.lists(st.tuples(st.integers(0, 99), st.integers(0, 99), st.booleans(), st.booleans(), st.booleans(),
                              st.integers(0, 3)), min_size=2, max_size=6)
# What each product goes through: a lone op, a chain, a row reduction (a row kernel) or GELU (its backward alone)
AFTER = [lambda v: 0.3 * v, lambda v: torch.tanh(v) * 0.5 + 0.1, lambda v: torch.log_softmax(v, -1),
         torch.nn.functional.gelu]


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(program=products, n=st.sampled_from([5, 13]), seed=st.integers(0, 2**16))
def test_random_products_of_shared_and_transposed_values_padded_match_eager(monkeypatch, program, n, seed):
    """Chains of mm and addmm over values read again, transposed or not, each product through pointwise ops or a
    row reduction, every matmul padded (its shared pads, and operands their fused kernels write padded, among
    them): eager's results and every input's gradient."""
    monkeypatch.setattr(pad, "_padding", lambda node, a, b: tuple(pad._aligned(d, torch.float16) - d for d in
                                                                   (a.shape[-2], a.shape[-1], b.shape[-1])))
    monkeypatch.setattr(pad, "_measured", lambda *args: (1.0, 0.5))
    torch.manual_seed(seed)

    def fn(x, y, c):
        values = [x, y]
        for i, j, left_t, right_t, biased, after in program:
            a, b = values[i % len(values)], values[j % len(values)]
            a, b = a.t() if left_t else a, b.t() if right_t else b
            values.append(AFTER[after](torch.addmm(c, a, b) if biased else a @ b))
        return values[-1]

    # float64: a log-softmax's rounding, taken through the products after it, passes float32's tolerance
    inputs = [random_tensor((n, n), torch.float64).requires_grad_() for _ in range(2)]
    inputs.append(random_tensor((n,), torch.float64).requires_grad_())
    fusepass.reset()
    torch._dynamo.reset()
    out = torch.compile(fn, backend=fusepass.backend(strict=True))(*inputs)
    expected = fn(*inputs)
    torch.testing.assert_close(out, expected)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, inputs, grad, allow_unused=True)
    want = torch.autograd.grad(expected, inputs, grad, allow_unused=True)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if w is not None:
            torch.testing.assert_close(g, w)
