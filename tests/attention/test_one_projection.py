"""Q, K and V split from one projection, and Q or K scaled by a number before their product: the op reads the
projection itself and writes the three gradients into one buffer laid out as it (the split's backward would
concatenate three), and the score functions apply the scale (no pass of its own, forward or backward). Where the
views do not tile the projection, or overlap, each gradient has a buffer of its own, as before."""
from __future__ import annotations

import math

import pytest
import torch
from support import DEVICE, check, random_tensor, rewrites

import fusepass

B, T, H, D = 2, 21, 2, 16
C = H * D


def heads(t: torch.Tensor) -> torch.Tensor:
    return t.view(t.shape[0], t.shape[1], H, D).transpose(1, 2)


def attention(q, k, v, causal: bool = True):
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(D)
    if causal:
        n = q.size(-2)
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).tril().logical_not(),
                                    float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def split_qkv(x, w):  # nanoGPT
    q, k, v = (x @ w).split(C, dim=2)
    return attention(heads(q), heads(k), heads(v))


def chunk_qkv(x, w):
    q, k, v = (x @ w).chunk(3, dim=-1)
    return attention(heads(q), heads(k), heads(v))


def unbind_qkv(x, w):  # timm's ViT, its q scaled before the product
    qkv = (x @ w).reshape(x.shape[0], x.shape[1], 3, H, D).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)
    q = q * D ** -0.5
    return torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v


def split_kv(x, w):  # Q of its own, K and V from one projection (cross-attention's memory, MQA's kv)
    k, v = (x @ w[:, C:]).split(C, dim=2)
    return attention(heads(x @ w[:, :C]), heads(k), heads(v))


def ops_of(report: fusepass.Report, phase: str) -> set[str]:
    return {str(n.target) for n in report.graphs[phase].graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize("fn", [split_qkv, chunk_qkv, unbind_qkv, split_kv], ids=lambda f: f.__name__)
def test_one_projection_is_read_whole_and_its_gradient_written_once(fn):
    x = random_tensor((B, T, C), torch.float32)
    w = random_tensor((C, 3 * C), torch.float32) / math.sqrt(C)
    report = check(fn, x, w, backward=True)
    assert rewrites(report, "attention", "forward") and rewrites(report, "attention", "backward")
    (op,) = [n for n in report.graphs["forward"].graph.nodes if "fusepass.attention" in str(n.target)]
    q, k, v = op.args[:3]
    assert k is v and (q is k) == (fn is not split_kv), op.args[:3]
    backward = ops_of(report, "backward")
    assert not {"aten.cat.default", "aten.stack.default"} & backward, backward
    if fn is unbind_qkv:  # the scale is the scores'
        assert not {"aten.mul.Tensor", "aten.mul.Scalar"} & ops_of(report, "forward")


def gated(x, w):
    """A fourth part of the projection gates the output: the attention's views do not tile the projection."""
    q, k, v, gate = (x @ w).split(C, dim=2)
    return attention(heads(q), heads(k), heads(v)) * torch.sigmoid(heads(gate))


def one_tensor_three_times(x):
    """Q, K and V the same view: their gradients overlap, one buffer each, added."""
    return attention(heads(x), heads(x), heads(x), causal=False)


def tensor_scale(x, w, scale):
    """Q scaled by a tensor: not a number the score functions can take; the product stays (the scale is an integer
    tensor: a float one would learn, and its gradient, one sum of all of Q's, cancels to a few ulps, eager's too)."""
    q, k, v = (x @ w).split(C, dim=2)
    return attention(heads(q) * scale, heads(k), heads(v))


@pytest.mark.parametrize("case", ["gated", "one tensor three times", "tensor scale"])
def test_views_that_do_not_tile_one_source_keep_a_gradient_each(case):
    x = random_tensor((B, T, C), torch.float32)
    w = random_tensor((C, 3 * C), torch.float32) / math.sqrt(C)
    if case == "gated":
        report = check(gated, x, random_tensor((C, 4 * C), torch.float32) / math.sqrt(C), backward=True)
    elif case == "one tensor three times":
        report = check(one_tensor_three_times, x, backward=True)
    else:
        report = check(tensor_scale, x, w, torch.tensor(2, device=DEVICE), backward=True)
    assert rewrites(report, "attention", "backward")
    (op,) = [n for n in report.graphs["forward"].graph.nodes if "fusepass.attention" in str(n.target)]
    if case == "gated":  # read from the split's parts
        assert len({id(a) for a in op.args[:3]}) == 3
    if case == "tensor scale":
        assert "aten.mul.Tensor" in ops_of(report, "forward")


def test_a_failing_backward_kernel_gives_one_projection_its_whole_gradient(monkeypatch):
    """The replaced ops' gradients, where the kernel fails: the three parts added into the one buffer."""
    from fusepass.flash import backward as flash_backward

    def failing(*args, **kwargs):
        raise RuntimeError("backward kernel failed")

    monkeypatch.setattr(flash_backward, "backward_launches", failing)
    x = random_tensor((B, T, C), torch.float32)
    w = random_tensor((C, 3 * C), torch.float32) / math.sqrt(C)
    with pytest.warns(RuntimeWarning, match="backward kernel failed"):
        check(split_qkv, x, w, backward=True)


def grouped_projection(x, w):
    """K and V of fewer heads than Q, all three of one projection (GQA as packed-QKV models write it)."""
    q, k, v = (x @ w).split([C, C // 2, C // 2], dim=2)
    k, v = (t.view(t.shape[0], t.shape[1], H // 2, D).transpose(1, 2).repeat_interleave(2, dim=1) for t in (k, v))
    return attention(heads(q), k, v)


def test_grouped_heads_of_one_projection_write_one_gradient():
    x = random_tensor((B, T, C), torch.float32)
    report = check(grouped_projection, x, random_tensor((C, 2 * C), torch.float32) / math.sqrt(C), backward=True)
    (op,) = [n for n in report.graphs["forward"].graph.nodes if "fusepass.attention" in str(n.target)]
    assert op.args[0] is op.args[1] is op.args[2]
    assert "aten.cat.default" not in ops_of(report, "backward")
    assert "gqa" in rewrites(report, "attention", "forward")[0].features


def scaled_up(x, w):
    """Q multiplied by a number above 1 before the product: in half precision eager's product may overflow where
    the unscaled one does not, so the scale is not the scores' (the product stays)."""
    q, k, v = (x @ w).split(C, dim=2)
    return attention(heads(q) * 4.0, heads(k), heads(v))


def test_a_scale_that_grows_q_stays_a_product():
    x = random_tensor((B, T, C), torch.float32)
    report = check(scaled_up, x, random_tensor((C, 3 * C), torch.float32) / math.sqrt(C), backward=True)
    assert rewrites(report, "attention", "forward") and "aten.mul.Tensor" in ops_of(report, "forward")
