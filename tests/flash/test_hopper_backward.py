"""The sm_90 backward (`fusepass.flash.hopper_backward`): dQ, dK and dV after the sm_90 forward's training form against
float64, at SDPA's distance, at the layouts it serves (contiguous, by position, a fused projection's slices, shared K/V
heads); where a compiled training step runs it (the report names it), a sliding window's and a padding mask's after
the Triton forward too, and document ids' walking the block map's lists; what it does not serve; and its statistics
kernel (Triton, on any device). The kernel runs asynchronous products, TMA rings and TMA reductions: on an sm_90 GPU only; elsewhere `serves` says no."""
from __future__ import annotations

import math

import pytest
import torch
from hopper_layouts import causal_attention, laid_out, scores64
from support import DEVICE, check, compare, last_attention

import fusepass
from fusepass.flash import hopper_backward, hopper_forward
from fusepass.report.records import KERNEL

on_hopper = pytest.mark.skipif(not hopper_backward.available(torch.device(DEVICE)),
                               reason="the sm_90 kernel needs an sm_90 GPU and Gluon")


def _reference(q, k, v, do, causal):
    """(dq, dk, dv) of softmax(q kᵀ / √D [causal]) v in float64, K/V heads repeated for their groups (their
    gradients summed back)."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = torch.softmax(scores64(q64, k64, causal), -1) @ v64.repeat_interleave(q.shape[1] // k.shape[1], 1)
    return torch.autograd.grad(out, (q64, k64, v64), do.double())


def _training_forward(q, k, v, out, causal):
    """The sm_90 forward as a training step runs it (its exact weights, the output's residual): lse, log_sum and
    the residual."""
    lse = torch.empty(q.shape[:3], device=DEVICE)
    log_sum, residual = torch.empty_like(lse), torch.empty_like(out)
    hopper_forward.hopper_forward(q, k, v, out, lse, log_sum, None, 1 / math.sqrt(q.shape[3]), causal, residual)
    return lse, log_sum, residual


def _distance(got, expected):
    return ((got.double() - expected).norm() / expected.norm()).item()


@on_hopper
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "plain"])
@pytest.mark.parametrize("layout,heads,kv_heads", [("bhnd", 3, 3), ("bnhd", 4, 2), ("qkv", 4, 1)])
@pytest.mark.parametrize("n,dtype", [(256, torch.float16), (384, torch.bfloat16), (640, torch.bfloat16)])
@pytest.mark.parametrize("d", [64, 128])
def test_the_kernel_computes_the_gradients(causal, layout, heads, kv_heads, n, dtype, d):
    q, k, v, out = laid_out(layout, 2, heads, kv_heads, n, d, dtype)
    lse, log_sum, residual = _training_forward(q, k, v, out, causal)
    do = torch.randn(out.shape, device=DEVICE, dtype=dtype)
    assert hopper_backward.serves(do, q, k, v, causal)
    # gradients laid out as the inputs (a fused projection's share one buffer)
    grads = tuple(torch.empty_strided(t.shape, t.stride(), dtype=dtype, device=DEVICE) for t in (q, k, v))
    hopper_backward.hopper_backward(do, q, k, v, out, lse, log_sum, 1 / math.sqrt(d), causal, grads, residual)
    expected = _reference(q, k, v, do, causal)
    # SDPA's own distance from float64, in the same dtype, is the bar (the Triton backward's is within 15 % of it:
    # bench/results/gluon-backward-*).
    group = heads // kv_heads
    qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, enable_gqa=group > 1)
    bars = torch.autograd.grad(sdpa, (qs, ks, vs), do)
    for name, got, bar, e in zip("qkv", grads, bars, expected):
        assert _distance(got, e) <= 1.5 * _distance(bar, e) + 1e-4, (name, _distance(got, e), _distance(bar, e))


@on_hopper
@pytest.mark.parametrize("n", [256, 384])  # a second call at another length compiles again
def test_a_compiled_training_step_runs_it(n):
    """Eager's gradients for every weight (`check`), and the report names the kernel of each phase (heads of 128)."""
    x = torch.randn(2, n, 256, device=DEVICE, dtype=torch.bfloat16)
    weights = [torch.randn(256, 256, device=DEVICE, dtype=torch.bfloat16) * 0.06 for _ in range(3)]

    def attention(x, wq, wk, wv):
        return causal_attention(x, wq, wk, wv, heads=2)
    report = check(attention, x, *weights, backward=True, backend=fusepass.backend(sdpa=False))
    unfused = last_attention().unfused
    assert list(unfused.forward_record.detail.get(KERNEL, {}).values()) == [hopper_forward.DESCRIBED]
    assert list(unfused.backward_record.detail.get(KERNEL, {}).values()) == [hopper_backward.DESCRIBED]
    assert "backward ran the sm_90" in str(report)


def _beside_the_triton_backward(monkeypatch, switch, attention, qkv, do, mask_inputs=(), on=True, off=False):
    """`attention(q, k, v, *mask_inputs)` compiled twice, with the sm_90 backward's `switch` `on` (the report names
    the kernel) and `off` (the Triton backward after the same forward): each gradient within 1.5 times the Triton
    backward's distance from float64, NaN where float64's is."""
    wide = [t.detach().double().requires_grad_() for t in qkv]
    expected = torch.autograd.grad(attention(*wide, *mask_inputs), wide, do.double())
    grads = {}
    for served in (True, False):
        monkeypatch.setattr(hopper_backward, switch, on if served else off)
        fusepass.reset()
        torch._dynamo.reset()
        leaves = [t.detach().requires_grad_() for t in qkv]  # the layouts' strides kept
        compiled = torch.compile(attention, backend=fusepass.backend(sdpa=False))
        grads[served] = torch.autograd.grad(compiled(*leaves, *mask_inputs), leaves, do)
        ran = list(last_attention().unfused.backward_record.detail.get(KERNEL, {}).values())
        assert ran == ([hopper_backward.DESCRIBED] if served else [])
    for name, got, bar, e in zip("qkv", grads[True], grads[False], expected):
        assert torch.equal(got.isnan(), e.isnan()), name
        finite = ~e.isnan()
        got, bar, e = got[finite], bar[finite], e[finite]
        assert _distance(got, e) <= 1.5 * _distance(bar, e) + 1e-4, (name, _distance(got, e), _distance(bar, e))


def _projected(masked, heads):
    """`masked(q, k, v, *mask_inputs)` over 256 features in `heads` heads, from their projections."""
    def attention(x, wq, wk, wv, *mask_inputs):
        b, n, _ = x.shape
        q, k, v = ((x @ w).view(b, n, heads, 256 // heads).transpose(1, 2) for w in (wq, wk, wv))
        return masked(q, k, v, *mask_inputs).transpose(1, 2).reshape(b, n, 256)
    return attention


def _a_training_step_runs_it_after_the_triton_forward(attention, batch, mask_inputs_at):
    """The Triton forward's training form, then the kernel: eager's gradients for every weight (`check`), the report
    naming the kernel of the backward alone; then one compile called at two lengths (symbolic sizes), every input's
    gradient still at eager's distance. `mask_inputs_at(n)`: what the mask reads at length n."""
    weights = [torch.randn(256, 256, device=DEVICE, dtype=torch.bfloat16) * 0.06 for _ in range(3)]
    x = torch.randn(batch, 384, 256, device=DEVICE, dtype=torch.bfloat16)
    check(attention, x, *weights, *mask_inputs_at(384), backward=True, backend=fusepass.backend(sdpa=False))
    unfused = last_attention().unfused
    assert KERNEL not in unfused.forward_record.detail
    assert list(unfused.backward_record.detail.get(KERNEL, {}).values()) == [hopper_backward.DESCRIBED]
    compiled = torch.compile(attention, backend=fusepass.backend(sdpa=False))
    for n in (384, 512):
        inputs = [torch.randn(batch, n, 256, device=DEVICE, dtype=torch.bfloat16), *weights]
        mask_inputs = mask_inputs_at(n)
        leaves = [t.detach().requires_grad_() for t in inputs]
        dy = torch.randn(batch, n, 256, device=DEVICE, dtype=torch.bfloat16)
        got = torch.autograd.grad(compiled(*leaves, *mask_inputs), leaves, dy)
        want = torch.autograd.grad(attention(*leaves, *mask_inputs), leaves, dy)
        wide = [t.detach().double().requires_grad_() for t in inputs]
        compare(list(got), list(want),
                lambda: list(torch.autograd.grad(attention(*wide, *mask_inputs), wide, dy.double())), low=True)
    assert list(last_attention().unfused.backward_record.detail.get(KERNEL, {}).values()) == \
        [hopper_backward.DESCRIBED]


def _repeated(k, v, group):
    """K and V heads repeated for the query heads sharing them."""
    return (k, v) if group == 1 else tuple(t.repeat_interleave(group, 1) for t in (k, v))


def _windowed(q, k, v, window):
    """softmax(q kᵀ / √D) v in a causal window of `window` keys, K and V heads repeated for their groups."""
    k, v = _repeated(k, v, q.shape[1] // k.shape[1])
    i = torch.arange(q.shape[2], device=q.device)
    keep = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)
    s = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~keep, float("-inf"))
    return torch.softmax(s, -1) @ v


@on_hopper
@pytest.mark.parametrize("window", [2, 63, 65, 130, 383])  # a band ending in a block's first or last row, or 1 short
@pytest.mark.parametrize("layout,heads,kv_heads", [("bhnd", 3, 3), ("bnhd", 4, 2), ("qkv", 4, 1)])
@pytest.mark.parametrize("d", [64, 128])
def test_a_windows_gradients_are_as_far_from_float64_as_the_triton_backwards(window, layout, heads, kv_heads, d,
                                                                            monkeypatch):
    """The kernel over a window's band (`WINDOWS`) after the Triton forward, at the layouts it serves."""
    q, k, v, _ = laid_out(layout, 2, heads, kv_heads, 384, d, torch.bfloat16)
    do = torch.randn(2, heads, 384, d, device=DEVICE, dtype=torch.bfloat16)
    _beside_the_triton_backward(monkeypatch, "WINDOWS", lambda q, k, v: _windowed(q, k, v, window), (q, k, v), do)


@on_hopper
def test_a_sliding_windows_training_step_runs_it_after_the_triton_forward(monkeypatch):
    """A window's band (`WINDOWS`), the kernel over the band's q blocks."""
    monkeypatch.setattr(hopper_backward, "WINDOWS", True)
    _a_training_step_runs_it_after_the_triton_forward(
        _projected(lambda q, k, v: _windowed(q, k, v, 100), heads=2), 2, lambda n: ())


def _padded(q, k, v, lengths):
    """softmax(q kᵀ / √D) v over each batch's first `lengths[b]` keys, K and V heads repeated for their groups."""
    k, v = _repeated(k, v, q.shape[1] // k.shape[1])
    keep = torch.arange(k.shape[2], device=q.device)[None, :] < lengths[:, None]
    s = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~keep[:, None, None, :], float("-inf"))
    return torch.softmax(s, -1) @ v


@on_hopper
@pytest.mark.parametrize("lengths", [(384, 200), (1, 129), (0, 300), (128, 256)],
                         ids=["long", "one-key", "no-key", "on-block-edges"])
@pytest.mark.parametrize("layout,heads,kv_heads", [("bhnd", 3, 3), ("bnhd", 4, 2), ("qkv", 4, 1)])
@pytest.mark.parametrize("d", [64, 128])
def test_a_key_masks_gradients_are_as_far_from_float64_as_the_triton_backwards(lengths, layout, heads, kv_heads, d,
                                                                              monkeypatch):
    """The kernel on a padding mask (`KEY_MASKS`) after the Triton forward, skipping the kv blocks that keep no key, at
    the layouts it serves; a batch keeping no key has eager's gradients there: dV NaN (its weights are), dQ and dK 0
    (masked_fill passes no gradient to a masked score), its blocks walked all the same."""
    q, k, v, _ = laid_out(layout, 2, heads, kv_heads, 384, d, torch.bfloat16)
    do = torch.randn(2, heads, 384, d, device=DEVICE, dtype=torch.bfloat16)
    _beside_the_triton_backward(monkeypatch, "KEY_MASKS", _padded, (q, k, v), do,
                                (torch.tensor(lengths, device=DEVICE),))


@on_hopper
def test_a_padded_training_step_runs_it_after_the_triton_forward(monkeypatch):
    """A padding mask (`KEY_MASKS`)."""
    monkeypatch.setattr(hopper_backward, "KEY_MASKS", True)
    _a_training_step_runs_it_after_the_triton_forward(
        _projected(_padded, heads=2), 3, lambda n: (torch.randint(1, n + 1, (3,), device=DEVICE),))


def _documents(q, k, v, ids, equal=True, causal=False):
    """softmax(q kᵀ / √D) v over the keys whose id equals the query's (differs from it where not `equal`), and with
    `causal` at its position or before it (packed documents), K and V heads repeated for their groups."""
    k, v = _repeated(k, v, q.shape[1] // k.shape[1])
    other = ids[:, None, :, None] != ids[:, None, None, :]
    dropped = other if equal else ~other
    if causal:
        i = torch.arange(q.shape[2], device=q.device)
        dropped = dropped | (i[None, :] > i[:, None])
    s = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(dropped, float("-inf"))
    return torch.softmax(s, -1) @ v


def _ids(kind, n):
    """Two batches' ids: documents of random lengths in order (their ends off the blocks' edges), tokens of three
    documents interleaved, or batch 0 one document and batch 1 in order."""
    if kind == "sorted":
        return torch.sort(torch.randint(0, 5, (2, n), device=DEVICE), -1).values * 7919
    if kind == "interleaved":
        return torch.randint(0, 3, (2, n), device=DEVICE) + 2**35  # (ids past 2^32: both halves compared)
    ids = torch.sort(torch.randint(-3, 3, (2, n), device=DEVICE), -1).values
    ids[0] = 1
    return ids


# (head dim, joined with a causal mask) for every document form the kernel computes
EVERY_DOCUMENT_FORM = frozenset((d, causal) for d in hopper_forward.HEAD_DIMS for causal in (False, True))


@on_hopper
@pytest.mark.parametrize("equal,kind,causal", [
    (True, "sorted", False), (True, "interleaved", False), (True, "one", False), (False, "interleaved", False),
    (False, "one", False), (True, "sorted", True), (True, "interleaved", True)],
    ids=["sorted", "interleaved", "one-document", "other-documents", "other-documents-of-one", "packed",
         "packed-interleaved"])
@pytest.mark.parametrize("layout,heads,kv_heads", [("bhnd", 3, 3), ("bnhd", 4, 2), ("qkv", 4, 1)])
@pytest.mark.parametrize("d", [64, 128])
def test_document_ids_gradients_are_as_far_from_float64_as_the_triton_backwards(equal, kind, causal, layout, heads,
                                                                               kv_heads, d, monkeypatch):
    """The kernel on document ids (every form `DOCUMENTS` may name), alone or with a causal mask (packed), after the
    Triton forward, walking the block map's lists, at the layouts it serves; a batch whose rows keep no key (other
    documents of one) has eager's gradients there: dV NaN, dQ and dK 0."""
    q, k, v, _ = laid_out(layout, 2, heads, kv_heads, 384, d, torch.bfloat16)
    do = torch.randn(2, heads, 384, d, device=DEVICE, dtype=torch.bfloat16)
    _beside_the_triton_backward(monkeypatch, "DOCUMENTS",
                                lambda q, k, v, ids: _documents(q, k, v, ids, equal, causal), (q, k, v), do,
                                (_ids(kind, 384),), EVERY_DOCUMENT_FORM, frozenset())


@on_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["documents", "packed-causal"])
def test_a_packed_documents_training_step_runs_it_after_the_triton_forward(causal, monkeypatch):
    """Document ids (every form `DOCUMENTS` may name), alone or with a causal mask."""
    monkeypatch.setattr(hopper_backward, "DOCUMENTS", EVERY_DOCUMENT_FORM)
    _a_training_step_runs_it_after_the_triton_forward(
        _projected(lambda q, k, v, ids: _documents(q, k, v, ids, causal=causal), heads=2), 2,
        lambda n: (_ids("sorted", n),))


def test_it_serves_only_what_it_computes():
    """What the sm_90 forward does not serve (head dim 96, a length no block divides), and a dO of another dtype
    or not rows of one matrix: the Triton kernels'."""
    q, k, v = (torch.randn(1, 2, 256, 128, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
    do = torch.randn_like(q)
    assert not hopper_backward.serves(*(t[..., :96] for t in (do, q, k, v)), True)
    assert not hopper_backward.serves(do[:, :, :200], q[:, :, :200], k[:, :, :200], v[:, :, :200], False)
    assert not hopper_backward.serves(do.float(), q, k, v, False)
    assert not hopper_backward.serves(do.transpose(2, 3).contiguous().transpose(2, 3), q, k, v, False)
    assert hopper_backward.serves(do, q, k, v, True) == hopper_backward.available(q.device)
    assert not hopper_backward.serves(do, q, k, v, False, 100)  # a window is a causal band
    assert not hopper_backward.serves(do, q, k, v, True, None, True)  # a key mask alone, after the Triton forward
    assert not hopper_backward.serves(do, q, k, v, True, 100, False, True)  # document ids in no window
    # document ids alone at head dim 128; packed ones (within a causal mask), and any at 64, the Triton backward's
    assert hopper_backward.serves(do, q, k, v, False, None, False, True) == hopper_backward.available(q.device)
    assert not hopper_backward.serves(do, q, k, v, True, None, False, True)
    assert not hopper_backward.serves(*(t[..., :64] for t in (do, q, k, v)), False, None, False, True)


@pytest.mark.parametrize("with_ids", [False, True], ids=["stats", "stats-and-ids"])
def test_the_stats_kernel_takes_each_rows_offset_scale_and_term(with_ids):
    """Per query row the weights' exponent offset (the whole shift of a tame row, its max · log2(e) past that: a
    negative log_sum), 1 / l and delta / l with delta = rowsum(dO · (O + residual)), the Triton backward's row term
    (`backward.row_delta`), at a length no block divides; with document ids, each row's id in two int32 halves (ids
    past 2^32 and negative ones among them)."""
    out = torch.randn(2, 3, 100, 64, device=DEVICE, dtype=torch.bfloat16)
    do = torch.randn_like(out)
    residual = torch.randn_like(out) * 1e-3
    lse = torch.randn(out.shape[:3], device=DEVICE) * 10
    log_sum = torch.rand(out.shape[:3], device=DEVICE) * torch.where(torch.rand(out.shape[:3], device=DEVICE) < 0.3,
                                                                      -1.0, 1.0)
    n_stats = hopper_backward.STATS_WITH_IDS if with_ids else hopper_backward.STATS
    ids = torch.randint(-2**40, 2**40, (2, 100), device=DEVICE) if with_ids else None
    stats = torch.full((2 * 3 * n_stats, 100), float("nan"), device=DEVICE)
    hopper_backward._stats_kernel[(2, 3, 2)](out, residual, do, lse, log_sum, stats, ids, out.stride(), do.stride(),
                                             100, 100, HEAD_DIM=64, BLOCK_M=hopper_backward.STATS_BLOCK,
                                             N_STATS=n_stats)
    stats = stats.view(2, 3, n_stats, 100)
    delta = (do.double() * (out.double() + residual.double())).sum(-1)
    torch.testing.assert_close(stats[:, :, 0], torch.where(log_sum < 0, -lse * math.log2(math.e), -lse))
    torch.testing.assert_close(stats[:, :, 1], log_sum.abs())
    torch.testing.assert_close(stats[:, :, 2].double(), delta * log_sum.abs().double(), rtol=1e-4, atol=1e-3)
    if with_ids:
        halves = stats[:, :, 3:5].contiguous().view(torch.int32).to(torch.int64)
        assert torch.equal((halves[:, :, 0] & 0xFFFFFFFF) | (halves[:, :, 1] << 32), ids[:, None].expand(2, 3, 100))
