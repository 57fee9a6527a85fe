"""Random programs of pointwise ops, trained: fusepass's forward and backward match eager's on inputs of mixed
dtypes and layouts (transposed, sliced, broadcast), with casts, comparisons and row reductions in between."""
from __future__ import annotations

import contextlib
from unittest import mock

import torch
import torch._dynamo
import torch.nn.functional as F
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from support import DEVICE, LowPrecisionSeen, check, compare, pointwise_program

import fusepass
from fusepass.elementwise import reduction, row_kernel


def cast(dtype: torch.dtype):
    """`x.to(dtype)`; in the float64 reference (`support.check`) the cast rounds to `dtype` and stays float64, so
    that the reference rounds where the program asks, not at every op after it as eager half precision does."""
    def to(x: torch.Tensor) -> torch.Tensor:
        return x.to(dtype).double() if x.dtype == torch.float64 else x.to(dtype)

    return to


def row_loss(label_smoothing: float, per_row: bool):
    """A cross-entropy over each row's values as logits (fp32, as models compute it), one row in five ignored
    (-100); per row ("none") subtracted from the row, or the mean added to every value: a loss's log-softmax, its
    target's pick and their backward between pointwise ops."""
    def loss(x):
        rows = x.reshape(-1, x.shape[-1])
        position = torch.arange(rows.shape[0], device=x.device)
        targets = torch.where(position % 5 == 4, -100, position * 3 % x.shape[-1])
        value = F.cross_entropy(rows.float(), targets, reduction="none" if per_row else "mean",
                                label_smoothing=label_smoothing).to(x.dtype)
        return x - value.reshape(x.shape[:-1] + (1,)) if per_row else x * 0.5 + value

    return loss


# Each op keeps its values in a range where float64, float32 and half precision agree to their own rounding:
# arguments of exp, log, pow and reciprocals are bounded, as a real model's are.
UNARY = [
    torch.tanh, torch.sigmoid, torch.relu, F.silu, F.mish, F.softplus, F.hardswish, F.elu,
    lambda x: F.gelu(x, approximate="tanh"), F.gelu, lambda x: F.leaky_relu(x, 0.2),
    lambda x: torch.clamp(x, -1.5, 2.0), lambda x: torch.exp(torch.clamp(x, max=3.0)),
    lambda x: torch.log1p(x.abs()), lambda x: torch.rsqrt(x * x + 1.0), lambda x: (x * x + 0.5) ** 0.75,
    cast(torch.float32), cast(torch.bfloat16), lambda x: x * 3.0 - 0.25,
    lambda x: torch.where(x > 0.3, x, x.sin()), lambda x: torch.square(x).clamp(max=4.0), torch.atan, torch.asinh,
    torch.abs, lambda x: F.celu(x, 0.5), lambda x: torch.erfc(x), torch.sinc,
    lambda x: torch.lgamma(x.abs() + 0.5), lambda x: torch.digamma(x.abs() + 0.5),
    # Row reductions between them: a max subtracted (a softmax's), a mean of squares (a norm's), a row sum, a
    # layer norm, softmaxes (written out before the partition for training).
    lambda x: x - x.amax(-1, keepdim=True), lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1.0),
    lambda x: x.sum(-1, keepdim=True) * 0.125 - x, lambda x: F.layer_norm(x, x.shape[-1:]) + x,
    lambda x: torch.softmax(x, -1) * 4.0 - x, lambda x: torch.log_softmax(x.float(), -1).to(x.dtype) * 0.5,
    row_loss(0.0, per_row=True), row_loss(0.1, per_row=False),
    # Pieces placed along a dim (rotary embeddings' rotate_half; their backward's slice_backward); along the one
    # before the last where there is one (a broadcast row has none).
    lambda x: torch.cat((-x[..., 4:], x[..., :4]), dim=-1),
    lambda x: torch.cat((x[..., 3:, :], x[..., :3, :] * 0.5), dim=-2) if x.dim() > 1 else x * 0.5,
    # Rows merged around a unary op and split back (a loss's flatten, a matmul's view): the views move past the op
    # in the forward and in the backward (elementwise/views.py).
    lambda x: torch.tanh(x.reshape(-1, x.shape[-1]) * 0.5).reshape(x.shape),
]
BINARY = [
    torch.add, torch.sub, torch.mul, torch.maximum, torch.minimum,
    lambda a, b: a / (b.abs() + 1.0), lambda a, b: torch.where(a > b, a, 0.5 * b),
    lambda a, b: a * torch.sigmoid(b), lambda a, b: torch.lerp(a, b.to(a.dtype), 0.25),
    lambda a, b: a + (b > 0).to(a.dtype), torch.atan2, torch.logaddexp, lambda a, b: torch.xlogy(a, b.abs() + 0.5),
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPE = (5, 7, 9)
# How an input of SHAPE (or broadcast to it) is laid out: contiguous, a transposed copy, a slice with a
# storage offset and strides, a row or a column to broadcast.
LAYOUTS = ["contiguous", "transposed", "sliced", "row", "column"]


def layout_input(layout: str, dtype: torch.dtype) -> torch.Tensor:
    if layout == "transposed":
        return torch.randn(SHAPE[0], SHAPE[2], SHAPE[1], device=DEVICE).to(dtype).transpose(1, 2)
    if layout == "sliced":
        return torch.randn(SHAPE[0] + 1, SHAPE[1], 2 * SHAPE[2], device=DEVICE).to(dtype)[1:, :, ::2]
    if layout == "row":
        return torch.randn(SHAPE[2], device=DEVICE).to(dtype)
    if layout == "column":
        return torch.randn(SHAPE[0], SHAPE[1], 1, device=DEVICE).to(dtype)
    return torch.randn(SHAPE, device=DEVICE).to(dtype)


@contextlib.contextmanager
def rows_walked(walked: bool):
    """Rows walked in chunks of 4, the long rows' kernels at the programs' width of 9 (a last chunk part empty),
    or held whole."""
    if not walked:
        yield
        return
    with mock.patch.object(reduction, "PERSISTENT_MAX", 4), mock.patch.object(row_kernel, "LOOP_BLOCK", 4):
        yield


steps = st.lists(st.tuples(st.booleans(), st.integers(0, 99), st.integers(0, 99), st.integers(0, 99)),
                 min_size=2, max_size=8)


def build(program: list[tuple[bool, int, int, int]], n_inputs: int):
    values = pointwise_program(program, n_inputs, UNARY, BINARY)

    def fn(*inputs):
        # The last value made to span SHAPE (as the first input does), and one intermediate, whose gradient
        # flows back through the last one's too.
        last, intermediate = values(*inputs)
        return last + inputs[0], intermediate

    return fn


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program=steps, layouts=st.lists(st.sampled_from(LAYOUTS), min_size=1, max_size=2),
       dtypes=st.lists(st.sampled_from(DTYPES), min_size=2, max_size=3), walked=st.booleans(),
       seed=st.integers(0, 2**16))
# fuzz-2026-12-05-1130: a broadcast row's gradient summed by ATen (walked rows), its cast read in a fused group
@example(program=[(False, 72, 57, 67), (False, 69, 39, 87), (False, 72, 57, 67), (False, 9, 62, 16)], layouts=["row"],
         dtypes=[torch.bfloat16, torch.float16, torch.bfloat16], walked=True, seed=6719)
def test_random_pointwise_training_matches_eager(program, layouts, dtypes, walked, seed):
    torch.manual_seed(seed)
    torch._dynamo.reset()  # each program is a new graph of one code object
    inputs = [layout_input("contiguous", dtypes[0])] + [
        layout_input(layout, dtype) for layout, dtype in zip(layouts, dtypes[1:])]
    with rows_walked(walked):
        check(build(program, len(inputs)), *inputs, backward=True)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program=steps, seed=st.integers(0, 2**16))
def test_random_pointwise_training_under_symbolic_sizes(program, seed):
    """One compile with symbolic sizes (`dynamic=True`) serves three lengths, forward and backward, each as eager
    computes it (float32 inputs: a bfloat16 cast in the program rounds alike in both)."""
    values = pointwise_program(program, 2, UNARY, BINARY)

    def fn(a, b):
        return tuple(t.float() for t in values(a, b))

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=fusepass.backend(strict=True), dynamic=True)  # no silent fallback
    for length in (37, 53, 129):
        torch.manual_seed(seed + length)
        inputs = [torch.randn(3, length, device=DEVICE), torch.randn(length, device=DEVICE)]

        def run(function, dtype=torch.float32):
            xs = [x.to(dtype).requires_grad_() for x in inputs]
            outputs = function(*xs)
            weights = [torch.randn_like(o, generator=torch.Generator(o.device).manual_seed(seed)) for o in outputs]
            grads = torch.autograd.grad(outputs, xs, [w.to(o.dtype) for w, o in zip(weights, outputs)],
                                        allow_unused=True)
            # an input the outputs do not read: no gradient on one side, zeros on the other if any
            return list(outputs) + [g if g is not None else torch.zeros_like(x) for g, x in zip(grads, xs)]

        with LowPrecisionSeen() as seen:
            expected = run(fn)
        compare(run(compiled), expected, lambda: run(fn, torch.float64), seen.seen, rtol=1e-4, atol=1e-4)
