"""Random DAGs of pointwise ops (with matmuls in between, so groups must respect paths through them)
compiled by fusepass compute what they compute eagerly."""
from __future__ import annotations

import torch
import torch._dynamo
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import DEVICE, assert_close, pointwise_program

UNARY = [torch.tanh, torch.sigmoid, torch.relu, torch.neg, torch.abs, torch.sin, F.gelu,
         lambda x: x * 0.5, lambda x: x + 1.0, lambda x: torch.exp(torch.clamp(x, max=4.0)),
         lambda x: torch.cat((x[..., 2:], -x[..., :2]), dim=-1),
         # rows merged around unary ops and split back: the views move past the ops (elementwise/views.py)
         lambda x: torch.sigmoid(x.reshape(-1, x.shape[-1])).reshape(x.shape),
         lambda x: (x.reshape(-1, x.shape[-1]) * 3.0).cos().reshape(x.shape)]
BINARY = [torch.add, torch.mul, torch.sub, torch.maximum, lambda a, b: torch.where(a > b, a, b * 0.25),
          # the matmul is the one op no group may swallow
          lambda a, b: torch.broadcast_to(a, (2, 6, 6)) @ torch.broadcast_to(b, (2, 6, 6))]
SHAPES = [(2, 6, 6), (6, 6), (2, 1, 6), (6, 1), (1,)]

steps = st.lists(
    st.tuples(st.booleans(), st.integers(0, 99), st.integers(0, 99), st.integers(0, 99)),
    min_size=2, max_size=10)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program=steps, shapes=st.lists(st.sampled_from(SHAPES), min_size=2, max_size=3),
       seed=st.integers(0, 2**16))
def test_random_pointwise_dags_match_eager(program, shapes, seed):
    torch.manual_seed(seed)
    inputs = [torch.randn(s, dtype=torch.float32, device=DEVICE) for s in shapes]
    inputs[0] = inputs[0].expand(2, 6, 6)  # outputs always span the full shape
    fn = pointwise_program(program, len(inputs), UNARY, BINARY)
    torch._dynamo.reset()
    expected = fn(*inputs)
    actual = torch.compile(fn, backend="fusepass", fullgraph=True)(*inputs)
    assert_close(actual, expected, rtol=1e-4, atol=1e-4)
