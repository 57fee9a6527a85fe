"""Gradients lent out of a replay's memory pool (runtime/lent_outputs.py), on this machine's memory, through a
function whose backward stands in for a replayed one (it writes its gradient in a pool and lends it): the parameter's
`.grad` reads the pool until the next replay; held then (by the parameter, or by the caller past `zero_grad`, or as
`torch.autograd.grad` handed it out), it gets memory of its own with its values, its version kept; dropped, it costs
nothing; a `detach` of it kept elsewhere reads as an error. The trees' pools and training steps:
test_whole_graphs_cuda.py."""
from __future__ import annotations

import weakref

import pytest
import torch
from support import DEVICE

from fusepass.runtime import lent_outputs

DEVICE_INDEX = 0


@pytest.fixture(autouse=True)
def _nothing_lent(monkeypatch):
    monkeypatch.setattr(lent_outputs, "LEND_GRADIENTS", True)
    lent_outputs.reclaim(DEVICE_INDEX)
    yield
    lent_outputs.reclaim(DEVICE_INDEX)


@pytest.fixture
def moves(monkeypatch) -> list:
    moved = []
    move = lent_outputs._move
    monkeypatch.setattr(lent_outputs, "_move", lambda grad: moved.append(grad.shape) or move(grad))
    return moved


class Replayed(torch.autograd.Function):
    """w * x, whose backward writes w's gradient (x, summed over rows) in `pool` and lends it from there."""

    @staticmethod
    def forward(ctx, w, x, pool):
        ctx.x, ctx.pool, ctx.leaf = x, pool, weakref.ref(w)
        return w * x

    @staticmethod
    def backward(ctx, grad):
        ctx.pool[2:2 + ctx.x.shape[-1]].copy_((grad * ctx.x).sum(0))
        gradient = ctx.pool[2:2 + ctx.x.shape[-1]]
        lent, = lent_outputs.lend([gradient], {0: ctx.leaf}, DEVICE_INDEX)
        return lent, None, None


def _step(w, pool, rows=3):
    x = torch.randn(rows, w.shape[0], device=DEVICE)
    Replayed.apply(w, x, pool).sum().backward()
    return x.sum(0)


def test_a_kept_gradient_reads_the_pool_until_the_next_replay_then_memory_of_its_own(moves):
    pool = torch.zeros(16, device=DEVICE)
    w = torch.ones(11, device=DEVICE, requires_grad=True)
    expected = _step(w, pool)
    assert w.grad.data_ptr() == pool[2:].data_ptr()  # lent: AccumulateGrad took it, no copy
    torch.testing.assert_close(w.grad, expected)
    version = w.grad._version
    lent_outputs.reclaim(DEVICE_INDEX)  # the next forward's replay
    pool.fill_(-1)
    torch.testing.assert_close(w.grad, expected)
    assert w.grad.data_ptr() != pool[2:].data_ptr() and w.grad._version == version and moves == [w.shape]


def test_a_gradient_kept_past_zero_grad_keeps_its_values(moves):
    pool = torch.zeros(16, device=DEVICE)
    w = torch.ones(11, device=DEVICE, requires_grad=True)
    expected = _step(w, pool)
    kept = w.grad  # kept by the caller (logged, clipped, compared) past its `zero_grad()`
    w.grad = None
    lent_outputs.reclaim(DEVICE_INDEX)
    pool.fill_(-1)
    torch.testing.assert_close(kept, expected)
    assert moves == [w.shape]


def test_a_gradient_handed_out_by_autograd_grad_keeps_its_values(moves):
    pool = torch.zeros(16, device=DEVICE)
    w = torch.ones(11, device=DEVICE, requires_grad=True)
    x = torch.randn(3, 11, device=DEVICE)
    kept, = torch.autograd.grad(Replayed.apply(w, x, pool).sum(), w)  # no AccumulateGrad: the lent tensor itself
    assert kept.data_ptr() == pool[2:].data_ptr()
    lent_outputs.reclaim(DEVICE_INDEX)
    pool.fill_(-1)
    torch.testing.assert_close(kept, x.sum(0))
    assert moves == [w.shape] and w.grad is None


def test_gradients_set_to_none_before_the_next_replay_are_not_copied(moves):
    pool = torch.zeros(16, device=DEVICE)
    w = torch.ones(13, device=DEVICE, requires_grad=True)
    for _ in range(3):
        _step(w, pool)
        w.grad = None  # as `zero_grad()` does, after the optimizer's step
        lent_outputs.reclaim(DEVICE_INDEX)
    assert moves == []


def test_accumulated_gradients_add_up_in_their_own_memory(moves):
    pool = torch.zeros(16, device=DEVICE)
    w = torch.ones(7, device=DEVICE, requires_grad=True)
    expected = _step(w, pool)
    lent_outputs.reclaim(DEVICE_INDEX)
    expected = expected + _step(w, pool, rows=5)
    torch.testing.assert_close(w.grad, expected)


@pytest.mark.skipif(DEVICE == "cpu", reason="a storage's access error is set by CUDA builds' bindings only")
def test_a_detach_of_a_kept_gradient_reads_as_an_error_after_the_next_replay():
    pool = torch.zeros(16, device=DEVICE)
    w = torch.ones(9, device=DEVICE, requires_grad=True)
    _step(w, pool)
    kept = w.grad.detach()
    lent_outputs.reclaim(DEVICE_INDEX)
    assert torch.isfinite(w.grad).all()  # the parameter's own still reads
    with pytest.raises(RuntimeError, match="clone it to keep it"):
        kept.sum()


@pytest.mark.parametrize("leaf", ["none", "dead", "other shape", "not a leaf"])
def test_a_gradient_of_no_known_parameter_is_copied(leaf):
    pool = torch.randn(16, device=DEVICE)
    w = torch.ones(16, device=DEVICE, requires_grad=True)
    leaves = {"none": {}, "dead": {0: weakref.ref(torch.ones(1))}, "other shape": {0: weakref.ref(w[:4])},
              "not a leaf": {0: weakref.ref(w * 2)}}[leaf]
    handed, = lent_outputs.lend([pool], leaves, DEVICE_INDEX)
    assert handed.data_ptr() != pool.data_ptr() and torch.equal(handed, pool)


def test_gradients_are_copied_while_lending_is_off(monkeypatch):
    monkeypatch.setattr(lent_outputs, "LEND_GRADIENTS", False)
    pool = torch.randn(16, device=DEVICE)
    w = torch.ones(16, device=DEVICE, requires_grad=True)
    handed, = lent_outputs.lend([pool], {0: weakref.ref(w)}, DEVICE_INDEX)
    assert handed.data_ptr() != pool.data_ptr() and torch.equal(handed, pool)
