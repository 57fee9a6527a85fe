"""Elementwise fusion through torch.compile: numerics against eager, the report, the rewritten graph."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from support import DEVICE, check, compare, fused_kernel_count, missed, random_tensor, rewrites

import fusepass


def gelu_bias_sigmoid(x, b):
    return F.gelu(x * 0.5 + b) * torch.sigmoid(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_chain_forward_and_backward(dtype):
    x, b = random_tensor((37, 53), dtype), random_tensor((53,), dtype)
    # b's gradient sums 37 rounded rows: half precision accumulates a few ulps more than one op.
    tol = {} if dtype == torch.float32 else dict(rtol=2e-2, atol=6e-2)
    report = check(gelu_bias_sigmoid, x, b, backward=True, **tol)
    (forward,) = rewrites(report, phase="forward")
    assert forward.ops == ("aten.mul", "aten.add", "aten.gelu", "aten.sigmoid", "aten.mul")
    assert forward.location == f"tests/elementwise/test_fusion.py:{_line_of('F.gelu(x * 0.5 + b)')}"
    assert forward.bytes_fused < forward.bytes_unfused
    assert rewrites(report, kind="reduction", phase="backward")  # b's gradient summed in the kernel


def test_broadcasting_of_every_kind():
    x = random_tensor((4, 1, 5), torch.float32)
    y = random_tensor((3, 5), torch.float32)
    z = random_tensor((4, 3, 1), torch.float32)
    check(lambda x, y, z: torch.relu(x * y + z) - y, x, y, z)


def test_strided_and_expanded_inputs():
    x = random_tensor((9, 14), torch.float32)
    y = random_tensor((14, 9), torch.float32)
    v = random_tensor((9, 1), torch.float32)
    report = check(lambda x, y, v: torch.tanh(x[:, ::2] + 1) * y.t()[:, 1::2] + v.expand(9, 7), x, y, v)
    assert len(rewrites(report)) == 1


def test_views_inside_a_chain():
    x = random_tensor((6, 20), torch.float32)
    w = random_tensor((6, 4, 5), torch.float32)
    b = random_tensor((5, 6), torch.float32)

    def fn(x, w, b):
        y = torch.sigmoid(x * 2).view(6, 4, 5) + w  # a split view of an intermediate
        z = torch.exp(y).permute(2, 1, 0) * b.unsqueeze(1)  # a permute, a broadcast
        return z[:, 1:, ::2] - 1  # slices of an intermediate

    check(fn, x, w, b, backward=True)
    with torch.no_grad():  # no values saved for backward: one iteration space, one kernel
        report = check(fn, x, w, b)
    assert len(rewrites(report)) == 1


def test_a_merging_view_moves_past_the_unary_ops_that_read_it():
    """A view merging a computed value's dims, read by a chain of unary ops: the ops join the group that computes the
    value, the view after them."""
    x = random_tensor((6, 4, 5), torch.float32)
    report = check(lambda x: (torch.sin(x) * 2).reshape(6, 20).cos() + 1, x)
    (rewrite,) = rewrites(report)
    assert rewrite.ops == ("aten.sin", "aten.mul", "aten.cos", "aten.add")


def test_views_of_views_returned_or_read_compute_what_eager_does():
    """A view of a view is taken of what the first views; one the graph returns stays a view, an input's too."""
    x = random_tensor((4, 6), torch.float32).requires_grad_()

    def fn(x):
        y = torch.sigmoid(x * 2)
        return y.view(2, 2, 6).view(4, 6), x.view(2, 12).view(4, 6), torch.tanh(y.view(24).view(4, 6)) + 1

    check(fn, x, backward=True)
    with torch.no_grad():
        check(fn, x)


def test_a_logit_softcaps_backward_divides_in_the_kernel_before_it():
    """Gemma 2's final softcap, tanh(logits / cap) · cap on an LM head's logits viewed to (batch, time, vocab): its
    backward's tanh gradient is fused, then flattened for the matmul and divided by the cap, which joins the kernel
    rather than running alone over the vocabulary."""
    h = random_tensor((2, 29, 16), torch.bfloat16).requires_grad_()
    w = random_tensor((97, 16), torch.bfloat16).requires_grad_()

    def softcapped(h, w):
        logits = F.linear(h, w)  # its backward flattens the gradient and reads it transposed too
        return torch.tanh(logits / 30.0) * 30.0

    report = check(softcapped, h, w, backward=True)
    graph = report.graphs["backward"].graph
    assert not [n for n in graph.nodes if n.target == torch.ops.aten.div.Tensor]
    (backward,) = rewrites(report, phase="backward")
    assert "aten.div" in backward.ops
    # one compile called at other lengths (symbolic sizes from the second): the gradients still eager's
    compiled = torch.compile(softcapped, backend=fusepass.backend(strict=True))
    for length in (29, 37, 45):
        h = random_tensor((2, length, 16), torch.bfloat16).requires_grad_()
        dy = random_tensor((2, length, 97), torch.bfloat16)
        got = torch.autograd.grad(compiled(h, w), (h, w), dy)
        want = torch.autograd.grad(softcapped(h, w), (h, w), dy)
        wide = [x.detach().double().requires_grad_() for x in (h, w)]
        # judged against float64 with eager's own distance as the bar: cuBLAS rounds the matmul of the kernel's
        # float32 gradient otherwise than of eager's, rounded to bfloat16 between ops
        compare(list(got), list(want), lambda: list(torch.autograd.grad(softcapped(*wide), wide, dy.double())),
                low=True)


def test_zero_dim_tensors_and_scalars():
    x = random_tensor((5, 7), torch.bfloat16)
    s = torch.tensor(1.5)  # a host scalar beside device tensors is passed by value
    check(lambda x, s: (x * s + 2.0) / (s - 0.25), x, s)


def test_integer_and_bool_tensors():
    i = random_tensor((5, 7), torch.int64, low=-20, high=20)
    j = random_tensor((5, 7), torch.int32, low=1, high=9)
    b = random_tensor((5, 7), torch.bool)
    c = random_tensor((5, 7), torch.bool)
    check(lambda i, j: ((i * 3 + 1) % j, (i // j) - (i >> 1)), i, j)
    check(lambda b, c: ((b & c) | ~b, torch.logical_xor(b, c).int() + 1), b, c)


def test_mixed_dtypes():
    x = random_tensor((8, 9), torch.bfloat16)
    y = random_tensor((8, 9), torch.float32)
    i = random_tensor((8, 9), torch.int32, low=-4, high=4)
    check(lambda x, y, i: (x * 2 + y) * i + (x > 0).float(), x, y, i)


def test_intermediates_used_elsewhere_become_outputs():
    x = random_tensor((16, 8), torch.float32)
    w = random_tensor((8, 8), torch.float32)

    def fn(x, w):
        a = torch.relu(x * 3 - 1)
        return (a + 1) * 2, a @ w

    report = check(fn, x, w)
    (rewrite,) = rewrites(report)
    graph = report.graphs["forward"].graph
    launcher = next(n for n in graph.nodes if type(n.target).__name__ == "PointwiseLauncher")
    assert len(launcher.meta["val"]) == 2  # a (read by the matmul) and the result


def test_a_path_through_an_outside_op_keeps_groups_apart():
    x = random_tensor((16, 16), torch.float32)

    def fn(x):
        a = torch.sigmoid(x) * 2
        m = a @ x  # a → mm → b: a and b in one kernel would need the mm inside it
        return torch.tanh(a + m) + a

    report = check(fn, x)
    graph = report.graphs["forward"].graph
    mm = next(n for n in graph.nodes if n.target == torch.ops.aten.mm.default)
    assert type(mm.args[0].args[0].target).__name__ == "PointwiseLauncher"
    assert fused_kernel_count(report) == 2


def test_siblings_reading_one_tensor_share_a_kernel():
    g, u = (random_tensor((37, 19), torch.float32).requires_grad_() for _ in range(2))

    report = check(lambda g, u: F.silu(g) * u, g, u, backward=True)
    # Both gradients read g and the incoming gradient: one kernel reads them once and writes both.
    assert fused_kernel_count(report, "backward") == 1
    (launcher,) = [n for n in report.graphs["backward"].graph.nodes
                   if type(n.target).__name__ == "PointwiseLauncher"]
    assert len(launcher.meta["val"]) == 2


def test_siblings_of_other_shapes_or_joined_by_a_path_stay_apart():
    x = random_tensor((16, 16), torch.float32)

    def fn(x):
        a = torch.sigmoid(x) * 2
        b = torch.tanh(x[0]) * 3  # writes [16]: another iteration space than a's
        c = torch.exp(x) - (a @ x)  # a → mm → c
        return a, b, c * 2 + 1

    report = check(fn, x)
    assert fused_kernel_count(report) == 3


class MLP(nn.Module):
    def __init__(self, d=24, hidden=40):
        super().__init__()
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x), approximate="tanh")) * 0.5


class SwiGLU(nn.Module):
    def __init__(self, d=24, hidden=36):
        super().__init__()
        self.gate = nn.Linear(d, hidden, bias=False)
        self.up = nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


@pytest.mark.parametrize("block", [MLP, SwiGLU])
def test_small_models_forward_and_backward(block):
    torch.manual_seed(0)
    model = block().to(DEVICE)
    x = random_tensor((3, 11, 24), torch.float32)
    copy = block().to(DEVICE)
    copy.load_state_dict(model.state_dict())
    compiled = torch.compile(copy, backend="fusepass")
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected, actual = model(x1), compiled(x2)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(expected)
    expected.backward(grad)
    actual.backward(grad)
    torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-5, msg=name)
    report = fusepass.last_report()
    assert rewrites(report, phase="forward")
    if block is SwiGLU:  # silu(gate) * up: its backward is a chain too
        assert rewrites(report, phase="backward")


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_no_grad_and_inference_mode(mode):
    x, b = random_tensor((10, 12), torch.float32), random_tensor((12,), torch.float32)
    with mode():
        report = check(gelu_bias_sigmoid, x, b)
    assert len(rewrites(report)) == 1


def test_dynamic_shapes_reuse_the_kernel():
    from fusepass.elementwise import kernel as pointwise

    fn = torch.compile(gelu_bias_sigmoid, backend="fusepass", dynamic=True)
    before = set(pointwise._kernels)  # other tests' (the same program at sizes its blocks divide: unmasked)
    for rows in (5, 9, 17):
        x, b = random_tensor((rows, 13), torch.float32), random_tensor((13,), torch.float32)
        torch.testing.assert_close(fn(x, b), gelu_bias_sigmoid(x, b), rtol=1e-5, atol=1e-5)
    names = [key[0] for key in pointwise._kernels if key not in before]
    assert len(names) == len(set(names))  # one program per kernel: new sizes made no new kernel


def test_identical_groups_share_one_kernel():
    from fusepass.elementwise import kernel as pointwise

    x, y = random_tensor((7, 9), torch.float32), random_tensor((7, 9), torch.float32)
    before = len(pointwise._kernels)
    report = check(lambda x, y: (torch.exp(x * 2) + 1, torch.exp(y * 2) + 1), x, y)
    assert fused_kernel_count(report) == 2
    assert len(pointwise._kernels) - before <= 1


def test_untranslatable_pointwise_op_is_a_hotspot():
    x = random_tensor((6, 7), torch.float32)
    report = check(lambda x: torch.special.xlog1py(x * 2, x + 1) * 3, x)
    (hotspot,) = missed(report)
    assert hotspot.ops == ("aten.special_xlog1py",)
    assert "no Triton translation" in hotspot.reason
    assert hotspot.location.endswith("test_fusion.py:" + str(_line_of("torch.special.xlog1py(x * 2")))
    assert hotspot.bytes == 3 * 6 * 7 * 4


def _line_of(text: str) -> int:
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if text in line and "def " not in line)


def test_digamma_trains_fused_its_gradient_polygamma_of_order_one():
    # A Beta distribution's entropy takes digamma forward; its gradient is polygamma(1, x).
    x = random_tensor((6, 7), torch.float32, low=0.2, high=5).requires_grad_()
    report = check(lambda x: torch.digamma(x * 2) * x, x, backward=True)
    assert not missed(report)
    assert rewrites(report, phase="backward")


def test_polygamma_of_another_order_is_a_hotspot_with_its_reason():
    x = random_tensor((6, 7), torch.float32, low=0.2, high=5)
    report = check(lambda x: torch.polygamma(2, x * 2) * 3, x)
    (hotspot,) = missed(report)
    assert hotspot.ops == ("aten.polygamma",)
    assert hotspot.reason == "no Triton translation for aten.polygamma.default: order 2 (only 1)"


def test_host_scalar_arithmetic_of_a_device_graph_is_no_hotspot():
    """A 0-d tensor computed on the host (Gemma's normalizer, ``torch.tensor(w ** 0.5, dtype=...)``) in a graph
    on a device: nothing to fuse and nothing a kernel waits on; the device's ops are still declined by device."""
    from fusepass.elementwise.partition import partition

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(8, device="meta")
    scale = graph.placeholder("scale")
    scale.meta["val"] = torch.empty((), dtype=torch.float64)
    half = graph.call_function(torch.ops.aten.mul.Tensor, (scale, 0.5))
    half.meta["val"] = torch.empty((), dtype=torch.float64)
    on_host = graph.call_function(torch.ops.aten.mul.Tensor, (x, 2.0))
    on_host.meta["val"] = torch.empty(8)
    graph.output((half, on_host))
    _, declined = partition(graph, torch.device("meta"))
    assert [(d.node, d.reason) for d in declined] == [(on_host, "runs on cpu")]
