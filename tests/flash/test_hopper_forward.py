"""The sm_90 forward (`fusepass.flash.hopper_forward`): its output, lse and log_sum against float64 at the layouts it
serves (contiguous, by position, a fused projection's slices, shared K/V heads), where it runs under torch.compile
(the report names it; with a backward in half precision, the exact weights and the output's residual the Triton
backward reads), and where it does not (the Triton kernel runs).
The kernel runs asynchronous products and TMA rings: on an sm_90 GPU only; elsewhere `serves` says no."""
from __future__ import annotations

import math

import pytest
import torch
from hopper_layouts import causal_attention, laid_out, scores64
from support import DEVICE, check, last_attention

import fusepass
from fusepass.flash import hopper_forward
from fusepass.report.records import KERNEL

on_hopper = pytest.mark.skipif(not hopper_forward.available(torch.device(DEVICE)),
                               reason="the sm_90 kernel needs an sm_90 GPU and Gluon")


def _reference(q, k, v, causal):
    """softmax(q kᵀ / √D [causal]) v and each row's log-sum-exp, in float64, K/V heads repeated for their groups."""
    s = scores64(q, k, causal)
    return torch.softmax(s, -1) @ v.double().repeat_interleave(q.shape[1] // k.shape[1], 1), torch.logsumexp(s, -1)


@on_hopper
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "plain"])
@pytest.mark.parametrize("layout,heads,kv_heads", [("bhnd", 3, 3), ("bnhd", 4, 2), ("qkv", 4, 1)])
@pytest.mark.parametrize("d,n,dtype", [(64, 384, torch.bfloat16), (128, 256, torch.float16), (128, 640, torch.bfloat16)])
@pytest.mark.parametrize("persistent", [False, True], ids=["an-item-a-program", "persistent"])
def test_the_kernel_computes_the_attention(causal, layout, heads, kv_heads, d, n, dtype, persistent, monkeypatch):
    monkeypatch.setattr(hopper_forward, "PERSISTENT_UP_TO", n if persistent else 0)
    # a persistent grid of 3 programs, each walking several items (an odd count of q blocks at 384 and 640: a pair
    # of causal items that spans two heads)
    monkeypatch.setattr(hopper_forward, "_multiprocessors", lambda device: 3)
    q, k, v, out = laid_out(layout, 2, heads, kv_heads, n, d, dtype)
    lse = torch.empty(q.shape[:3], device=DEVICE)
    log_sum, fallback = torch.empty_like(lse), torch.ones(q.shape[:3], device=DEVICE, dtype=torch.int8)
    assert hopper_forward.serves(q, k, v, causal)
    hopper_forward.hopper_forward(q, k, v, out, lse, log_sum, fallback, 1 / math.sqrt(d), causal)
    expected, expected_lse = _reference(q, k, v, causal)
    # SDPA's own distance from float64, in the same dtype, is the bar
    group = heads // kv_heads
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), is_causal=causal)
    bar = ((sdpa.double() - expected).norm() / expected.norm()).item()
    assert ((out.double() - expected).norm() / expected.norm()).item() <= 1.5 * bar + 1e-4
    torch.testing.assert_close(lse.double(), expected_lse, rtol=1e-4, atol=1e-4)
    # log_sum is the log of the row's sum relative to its max: lse - log_sum is the row's largest score
    torch.testing.assert_close((lse - log_sum).double(), scores64(q, k, causal).amax(-1), rtol=1e-4, atol=1e-4)
    if causal:
        assert not fallback.any()


@on_hopper
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "plain"])
@pytest.mark.parametrize("d,n", [(64, 640), (128, 384)])
def test_a_persistent_grid_writes_what_a_program_an_item_writes(causal, d, n, monkeypatch):
    """The training form (exact weights, the output's residual) and the statistics, bit for bit, whether each program
    computes one item or walks several (3 programs here)."""
    q, k, v, _ = laid_out("bnhd", 2, 4, 2, n, d, torch.bfloat16)
    monkeypatch.setattr(hopper_forward, "_multiprocessors", lambda device: 3)
    written = []
    for persistent in (False, True):
        monkeypatch.setattr(hopper_forward, "PERSISTENT_UP_TO", n if persistent else 0)
        out, residual = torch.empty_like(q), torch.empty_like(q)
        lse, log_sum = (torch.empty(q.shape[:3], device=DEVICE) for _ in range(2))
        hopper_forward.hopper_forward(q, k, v, out, lse, log_sum, None, 1 / math.sqrt(d), causal, residual)
        written.append((out, residual, lse, log_sum))
    for one, walked in zip(*written):
        assert torch.equal(one, walked)


@on_hopper
def test_the_kernel_is_exact_at_large_scores():
    """The weights are exp2((s - m) · c), m the row's max product: no row to recompute however large the scores
    (the Triton kernel's fused form recomputes rows past 2^24)."""
    q, k, v, out = laid_out("bhnd", 1, 2, 2, 256, 64, torch.bfloat16)
    q, k = q * 3000, k * 3000  # scores near 1e8
    lse, log_sum = (torch.empty(q.shape[:3], device=DEVICE) for _ in range(2))
    hopper_forward.hopper_forward(q, k, v, out, lse, log_sum, None, 1 / 8, False)
    expected, _ = _reference(q, k, v, False)
    assert torch.isfinite(out).all()
    assert ((out.double() - expected).norm() / expected.norm()).item() < 1e-2


@on_hopper
@pytest.mark.parametrize("n", [256, 384])  # a second call at another length compiles again
def test_a_compiled_attention_without_gradients_runs_it(n):
    x = torch.randn(2, n, 256, device=DEVICE, dtype=torch.bfloat16)
    weights = [torch.randn(256, 256, device=DEVICE, dtype=torch.bfloat16) * 0.06 for _ in range(3)]
    report = check(causal_attention, x, *weights, backend=fusepass.backend(sdpa=False))
    detail = last_attention().unfused.forward_record.detail
    assert list(detail.get(KERNEL, {}).values()) == [hopper_forward.DESCRIBED], detail
    assert "sm_90" in str(report)


@on_hopper
def test_a_training_forward_runs_it_with_the_exact_weights():
    """A half-precision forward with a backward keeps its output's residual and the weights the backward recomputes
    (`forward.keeps_residual`): the kernel writes both, and the gradients are eager's (`check`)."""
    x = torch.randn(2, 256, 256, device=DEVICE, dtype=torch.bfloat16)
    weights = [torch.randn(256, 256, device=DEVICE, dtype=torch.bfloat16) * 0.06 for _ in range(3)]
    check(causal_attention, x, *weights, backward=True, backend=fusepass.backend(sdpa=False))
    assert last_attention().keeps_residual()
    detail = last_attention().unfused.forward_record.detail
    assert list(detail.get(KERNEL, {}).values()) == [hopper_forward.DESCRIBED], detail


@pytest.mark.parametrize("layout", ["bhnd", "bnhd", "qkv"])
def test_each_head_is_a_block_of_rows_of_one_matrix(layout):
    """The kernel's addressing (`_Rows`): head (b, h)'s rows start at row (b·sb + h·sh) // sn and column
    (b·sb + h·sh) % sn of the matrix its descriptor covers. On any device: the matrix is a view."""
    for t in laid_out(layout, 2, 4, 2, 5, 16, torch.float16)[:3]:
        rows = hopper_forward._Rows.of(t)
        matrix = t.as_strided((rows.rows, rows.width), (t.stride(2), 1))
        sb, sh, sn, _ = t.stride()
        for b in range(t.shape[0]):
            for h in range(t.shape[1]):
                base = b * sb + h * sh
                row, col = base // sn, base % sn
                assert torch.equal(matrix[row:row + t.shape[2], col:col + t.shape[3]], t[b, h])


def test_it_serves_only_what_it_computes():
    """Lengths no tile divides, head dims other than 64 and 128, fp32, and any device but an sm_90 GPU: the Triton
    kernel's."""
    def tensors(n, d, dtype=torch.bfloat16):
        return [torch.randn(1, 2, n, d, device=DEVICE, dtype=dtype) for _ in range(3)]

    assert not hopper_forward.serves(*tensors(200, 64), False)
    assert not hopper_forward.serves(*tensors(256, 96), False)
    assert not hopper_forward.serves(*tensors(256, 64, torch.float32), False)
    q, k, v = tensors(256, 64)
    assert not hopper_forward.serves(q, k[:, :, :128], v[:, :, :128], True)  # causal over unequal lengths
    assert hopper_forward.serves(q, k, v, True) == hopper_forward.available(q.device)


def key_bias_attention(x, wq, wk, bk, wv):  # BERT's: a key projection with a bias, 4 heads of 64
    b, n, _ = x.shape
    q, k, v = ((x @ w + bias).view(b, n, 4, 64).transpose(1, 2) for w, bias in ((wq, 0), (wk, bk), (wv, 0)))
    return (torch.softmax(q @ k.transpose(-1, -2) / 8.0, -1) @ v).transpose(1, 2).reshape(b, n, 256)


@on_hopper
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_its_exact_weights_keep_a_key_bias_gradient_at_eagers_distance(dtype):
    """With a half-precision backward the kernel takes the Triton forward's exact weights and keeps the output's
    residual (tests/attention/test_row_term.py): a key bias's gradient, 0 in float64, as near 0 as eager's."""
    inputs = [torch.randn(2, 256, 256, device=DEVICE)] + [torch.randn(256, 256, device=DEVICE) * 0.06
                                                           for _ in range(2)]
    inputs += [torch.randn(256, device=DEVICE), torch.randn(256, 256, device=DEVICE) * 0.06]
    grad = torch.randn(2, 256, 256, device=DEVICE)

    def gradients(fn, dtype):
        xs = [x.detach().to(dtype).requires_grad_() for x in inputs]
        return torch.autograd.grad(fn(*xs), xs, grad.to(dtype))

    wide = gradients(key_bias_attention, torch.float64)
    eager = gradients(key_bias_attention, dtype)
    fused = gradients(torch.compile(key_bias_attention, backend=fusepass.backend(sdpa=False)), dtype)
    assert list(last_attention().unfused.forward_record.detail.get(KERNEL, {}).values()) == \
        [hopper_forward.DESCRIBED]
    scale = max(g.norm() for g in wide)
    ours, eagers = ((g[3].double() - wide[3]).norm() / scale for g in (fused, eager))
    assert ours <= 1.25 * eagers, (ours, eagers)
