"""A padded matmul's operand made by a fused kernel is written padded by it (`matmul/pads_in_producers.py`): the
products and gradients are eager's, the copy is gone from the graph, and where the kernel cannot write it so (the
output read elsewhere too, a batched operand padded along M) the copy stays."""
from __future__ import annotations

import operator

import pytest
import torch
from support import broken_source, check, random_tensor, rewrites

import fusepass
from fusepass.elementwise import kernel as pointwise
from fusepass.elementwise.kernel import PointwiseLauncher
from fusepass.matmul import pad

STRICT = fusepass.backend(strict=True)  # a pass that fails raises


@pytest.fixture
def every_matmul_padded(monkeypatch):
    """Each matmul padded to half precision's alignment, as if the running GPU timed it faster so; recompiles at
    static sizes (a symbolic size is not padded)."""
    monkeypatch.setattr(pad, "_padding", lambda node, a, b: tuple(pad._aligned(d, torch.float16) - d for d in
                                                                   (a.shape[-2], a.shape[-1], b.shape[-1])) or None)
    monkeypatch.setattr(pad, "_measured", lambda *args: (1.0, 0.5))
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        yield


def written_padded(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The products' operands that a fused kernel wrote padded."""
    return [a for n in graph.nodes if n.target is pad.product_of_padded for a in n.args[1:3]
            if a.target is operator.getitem and isinstance(a.args[0].target, PointwiseLauncher)
            and a.args[1] >= len(a.args[0].target.lowered.outputs)]


def copies_of_fused(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The pads copying a fused kernel's output."""
    def source(x: torch.fx.Node) -> torch.fx.Node:
        while x.target in pad.VIEWS:
            x = x.args[0]
        return x

    return [n for n in graph.nodes if n.target is pad._padded and source(n.args[0]).target is operator.getitem]


def gelu_product(x, b, w):
    return torch.nn.functional.gelu(x * 2 + b) @ w


def layer_norm_product(x, w):
    return torch.nn.functional.layer_norm(x, x.shape[-1:]) @ w


@pytest.mark.parametrize("m, k", [(16, 13), (13, 16), (13, 13)])  # K padded, M padded, both
def test_a_fused_output_is_written_padded(every_matmul_padded, m, k):
    """GELU's output padded along K (its columns), M (its rows) or both."""
    x, b, w = random_tensor((m, k), torch.float32), random_tensor((k,), torch.float32), \
        random_tensor((k, 8), torch.float32)
    report = check(gelu_product, x, b, w, backend=STRICT)
    (graph,) = report.graphs.values()
    (operand,) = written_padded(graph.graph)
    assert tuple(operand.meta["val"].shape) == (pad._aligned(m, torch.float16), pad._aligned(k, torch.float16))
    assert not copies_of_fused(graph.graph)
    (record,) = [r for r in rewrites(report, "elementwise") if "written padded" in r.detail]
    assert record.detail["written padded"] == [
        f"{list(operand.meta['val'].shape)} for a matmul (+{(-m) % 8} rows, +{(-k) % 8} columns)"]


def test_a_gradient_is_written_padded_for_both_its_products(every_matmul_padded):
    """In gelu(x · w1 + b1) · w2's backward, GELU's backward (with b1's column sum) makes the gradient that
    dX = dH · w1ᵀ pads along K and dW1 = xᵀ · dH along N: one buffer, written by that kernel, serves both; every
    gradient is eager's. (In the forward, GELU's output is saved for the backward too: a copy pads it.)"""
    def mlp(x, w1, b1, w2):
        return torch.nn.functional.gelu(x @ w1 + b1) @ w2

    x, w1, b1, w2 = (random_tensor(s, torch.float32) for s in ((16, 13), (13, 21), (21,), (21, 8)))
    report = check(mlp, x, w1, b1, w2, backward=True, backend=STRICT)
    backward = report.graphs["backward"].graph
    assert not copies_of_fused(backward)
    products = [n for n in backward.nodes if n.target is pad.product_of_padded]
    (gradient,) = {a.args[0] if a.target is torch.ops.aten.t.default else a for n in products for a in n.args[1:3]
                   if a in written_padded(backward) or a.target is torch.ops.aten.t.default}
    assert tuple(gradient.meta["val"].shape) == (16, 24) and len(gradient.users) == 2
    assert copies_of_fused(report.graphs["forward"].graph)


def test_a_row_kernels_output_is_written_padded_at_a_second_shape(every_matmul_padded):
    """A LayerNorm (a row kernel) feeding a matmul, its rows padded; again at another row count (a recompile)."""
    w = random_tensor((19, 8), torch.float32)
    for rows in (13, 21):
        report = check(layer_norm_product, random_tensor((rows, 19), torch.float32), w, backend=STRICT)
        (graph,) = report.graphs.values()
        assert written_padded(graph.graph) and not copies_of_fused(graph.graph)


@pytest.mark.parametrize("case", ["gelu backward", "weight cast"])
def test_a_lone_op_is_a_kernel_that_writes_padded(every_matmul_padded, case):
    """An op alone (GELU's backward without a bias's sum; a weight cast to the activations' dtype, as autocast
    casts it, read transposed, in inference: a training forward saves the cast for the backward) becomes a kernel of
    its own where a padded matmul reads its value: it writes it padded."""
    if case == "gelu backward":
        def fn(x, w1, w2):
            return torch.nn.functional.gelu(x @ w1) @ w2

        inputs = [random_tensor(s, torch.float32) for s in ((16, 13), (13, 21), (21, 8))]
        phase = "backward"
    else:
        def fn(x, w):
            return x @ w.float().t()

        inputs = [random_tensor((8, 16), torch.float32), random_tensor((13, 16), torch.float64)]
        phase = "forward"
    report = check(fn, *inputs, backward=phase == "backward", backend=STRICT)
    graph = report.graphs[phase].graph
    (operand,) = set(written_padded(graph)) | {a.args[0] for n in graph.nodes if n.target is pad.product_of_padded
                                                for a in n.args[1:3] if a.target is torch.ops.aten.t.default
                                                and a.args[0].target is operator.getitem}
    assert len(operand.args[0].target.lowered.program.steps) == 1 and not copies_of_fused(graph)


def test_an_output_read_elsewhere_too_is_copied(every_matmul_padded):
    """GELU's output is also returned: the kernel writes it as eager lays it out, and the matmul pads a copy."""
    def both(x, b, w):
        y = torch.nn.functional.gelu(x * 2 + b)
        return y @ w, y

    report = check(both, random_tensor((13, 13), torch.float32), random_tensor((13,), torch.float32),
                   random_tensor((13, 8), torch.float32), backend=STRICT)
    graph = report.graphs["forward"].graph
    assert not written_padded(graph) and copies_of_fused(graph)


def test_a_batched_operand_whose_rows_do_not_lie_evenly_is_copied(every_matmul_padded):
    """bmm's [B, M, K] operand with M padded, made as [B·M, K] by the kernel: a batch's rows do not lie evenly in
    the padded buffer as one output, so it stays a copy; made as [B, M, K], or with only K padded, the kernel
    writes it."""
    def flat(x, w):
        return torch.bmm((torch.sigmoid(x) * 3).view(3, -1, x.shape[-1]), w)

    def batched(x, w):
        return torch.bmm(torch.sigmoid(x) * 3, w)

    for fn, x, k, written in [(flat, (39, 16), 16, False), (batched, (3, 13, 16), 16, True),
                              (flat, (48, 13), 13, True)]:
        report = check(fn, random_tensor(x, torch.float32), random_tensor((3, k, 8), torch.float32), backend=STRICT)
        (graph,) = report.graphs.values()
        assert bool(written_padded(graph.graph)) == written and bool(copies_of_fused(graph.graph)) != written


def test_a_failed_kernel_pads_its_own_ops_output(every_matmul_padded, monkeypatch):
    """A kernel that fails runs the group's own ops: their output is padded by a copy, and the product is eager's."""
    monkeypatch.setattr(pointwise, "kernel_source", broken_source)
    monkeypatch.setattr(pointwise, "_kernels", {})
    with pytest.warns(RuntimeWarning, match="running it unfused"):
        report = check(gelu_product, random_tensor((13, 13), torch.float32), random_tensor((13,), torch.float32),
                       random_tensor((13, 8), torch.float32))
    assert written_padded(report.graphs["forward"].graph)


def test_without_fusion_the_copy_stays(every_matmul_padded):
    x, b, w = random_tensor((13, 13), torch.float32), random_tensor((13,), torch.float32), \
        random_tensor((13, 8), torch.float32)
    report = check(gelu_product, x, b, w, backend=fusepass.backend(strict=True, elementwise=False))
    (graph,) = report.graphs.values()
    assert [n for n in graph.graph.nodes if n.target is pad._padded and n.args[0].target is torch.ops.aten.gelu.default]
