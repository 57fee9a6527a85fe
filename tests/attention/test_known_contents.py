"""Buffers read as the bands they hold (fusepass/attention/known_contents.py): the band found in a tensor, the mask
computed from the positions in its place, and the guard that catches a change of the buffer's contents."""
from __future__ import annotations

import math
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
from attention.forms.common import check_fused, qkv
from support import DEVICE, assert_close, rewrites

import fusepass
from fusepass.attention import known_contents
from fusepass.attention.known_contents import Band, ContentGuard, ContentsChanged, KnownInput, band_of
from fusepass.report.records import KNOWN_CONTENTS


def _diagonals(rows: int, cols: int) -> torch.Tensor:
    """col - row of each element."""
    return torch.arange(cols)[None, :] - torch.arange(rows)[:, None]


def _filled(band: Band) -> torch.Tensor:
    """The tensor `band` describes."""
    d = _diagonals(*band.shape[-2:])
    inside = torch.ones_like(d, dtype=torch.bool)
    if band.lo is not None:
        inside &= d >= band.lo
    if band.hi is not None:
        inside &= d <= band.hi
    inside_value, outside_value = (torch.tensor(x, dtype=band.dtype) for x in (band.inside, band.outside))
    return torch.where(inside, inside_value, outside_value).expand(band.shape)


@pytest.mark.parametrize("tensor, lo, hi", [
    (torch.tril(torch.ones(40, 40)).view(1, 1, 40, 40), None, 0),  # nanoGPT's
    (torch.tril(torch.ones(37, 37, dtype=torch.bool), diagonal=-2), -1, None),  # the main diagonal outside
    ((_diagonals(45, 45) <= 0) & (_diagonals(45, 45) > -7), -6, 0),  # a window
    (torch.triu(torch.ones(30, 53, dtype=torch.int64), diagonal=20).expand(3, 30, 53), None, 19),  # rectangular
    (torch.zeros(29, 29).masked_fill(_diagonals(29, 29) > 0, -math.inf).to(torch.bfloat16), None, 0),  # additive
])
def test_the_band_a_tensor_holds_is_found(tensor, lo, hi):
    band = band_of(tensor)
    assert band is not None and (band.lo, band.hi) == (lo, hi)
    assert torch.equal(_filled(band), tensor)


@pytest.mark.parametrize("tensor", [
    torch.rand(31, 31) > 0.5,
    torch.tril(torch.ones(33, 33)) + torch.tril(torch.ones(33, 33), diagonal=-4),  # three values
    ((_diagonals(35, 35) == 0) | (_diagonals(35, 35) == -3)).float(),  # two runs of diagonals
    torch.stack([torch.tril(torch.ones(19, 19)), torch.triu(torch.ones(19, 19))]),  # leading slices differ
    torch.tril(torch.ones(21, 21)).masked_fill(_diagonals(21, 21) == -2, math.nan),
    torch.ones(40),
    torch.ones(17, 23, dtype=torch.bool),  # one value throughout: read as it is
])
def test_a_tensor_that_holds_no_band_has_none(tensor):
    assert band_of(tensor) is None


class BufferAttention(torch.nn.Module):
    """nanoGPT's attention: Q, K, V from one projection, the causal mask a float buffer sliced and compared with 0."""

    def __init__(self, d: int = 32, heads: int = 2, longest: int = 48, mask: torch.Tensor | None = None) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(d, 3 * d)
        mask = torch.tril(torch.ones(longest, longest)) if mask is None else mask
        self.register_buffer("bias", mask.view(1, 1, longest, longest))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (y.view(b, t, self.heads, c // self.heads).transpose(1, 2) for y in self.qkv(x).split(c, 2))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        scores = scores.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        return (F.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(b, t, c)


def _step(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The output and the gradients of x and of every parameter, each of which must get one."""
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    out = model(x)
    out.pow(2).sum().backward()
    grads = [x.grad, *(p.grad for p in model.parameters())]
    assert all(g is not None for g in grads)
    return out.detach(), grads


def _same_step(compiled, model: torch.nn.Module, x: torch.Tensor) -> None:
    out, grads = _step(compiled, x)
    expected, expected_grads = _step(model, x)
    assert_close([out, *grads], [expected, *expected_grads], rtol=1e-4, atol=1e-4)


def _compiled(model: torch.nn.Module, **options) -> torch.nn.Module:
    fusepass.reset()
    torch._dynamo.reset()
    return torch.compile(model, backend=fusepass.backend(**options))


def _stepped_once(**options) -> tuple[torch.nn.Module, torch.nn.Module, torch.Tensor]:
    """A `BufferAttention`, compiled, and its input, after one step checked against eager."""
    torch.manual_seed(0)
    model = BufferAttention().to(DEVICE)
    compiled = _compiled(model, **options)
    x = torch.randn(2, 37, 32, device=DEVICE)
    _same_step(compiled, model, x)
    return model, compiled, x


def _attention_features(phase: str = "forward") -> list[tuple[str, ...]]:
    return [tuple(r.features) for report in fusepass.reports() for r in rewrites(report, "attention", phase)]


def test_a_buffer_mask_is_computed_from_the_positions():
    torch.manual_seed(0)
    model = BufferAttention().to(DEVICE)
    _same_step(_compiled(model, strict=True), model, torch.randn(2, 37, 32, device=DEVICE))
    assert _attention_features("forward") == _attention_features("backward") == [("causal",)]
    report = fusepass.last_report()
    detail = rewrites(report, "attention", "forward")[0].detail
    assert detail[KNOWN_CONTENTS] == {"L['self']._buffers['bias']": "1.0 where col - row <= 0, else 0.0"}
    assert "L['self']._buffers['bias'] computed from the positions (1.0 where col - row <= 0, else 0.0; its " \
        "contents checked on each call)" in " ".join(str(report).split())


def test_a_window_buffer_is_a_window():
    d = _diagonals(48, 48)
    model = BufferAttention(mask=((d <= 0) & (d > -9)).float()).to(DEVICE)
    _same_step(_compiled(model, strict=True), model, torch.randn(2, 41, 32, device=DEVICE))
    assert _attention_features() == [("window",)]


class AdditiveBuffer(torch.nn.Module):
    """A causal mask held as what is added to the scores: 0 where a key is seen, -inf elsewhere."""

    def __init__(self, longest: int = 40) -> None:
        super().__init__()
        self.register_buffer("mask", torch.zeros(longest, longest).masked_fill(_diagonals(longest, longest) > 0,
                                                                              -math.inf))

    def forward(self, q, k, v):
        n = q.size(-2)
        return F.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)) + self.mask[:n, :n], dim=-1) @ v


def test_an_additive_buffer_is_a_mask_computed_from_the_positions():
    check_fused(AdditiveBuffer().to(DEVICE), *qkv(29), expected=("causal",))


def test_a_buffer_that_holds_no_band_is_read():
    torch.manual_seed(0)
    keep = torch.rand(48, 48) > 0.3
    keep |= torch.eye(48, dtype=torch.bool)  # every row sees a key
    model = BufferAttention(mask=keep.float()).to(DEVICE)
    _same_step(_compiled(model, strict=True), model, torch.randn(2, 37, 32, device=DEVICE))
    assert _attention_features() == [("mask",)]


def test_a_mask_the_caller_passes_is_read():
    """The caller's tensors are not known when the graph compiles, however they were built."""
    def attention(q, k, v, causal):
        scores = (q @ k.transpose(-2, -1)).masked_fill(causal == 0, float("-inf"))
        return F.softmax(scores, dim=-1) @ v

    causal = torch.tril(torch.ones(23, 23, dtype=torch.bool, device=DEVICE))
    check_fused(attention, *qkv(23), causal, expected=("mask",))


def test_a_buffer_written_in_place_is_read_again():
    model, compiled, x = _stepped_once()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same contents written again: still the band, no fallback
        with torch.no_grad():
            model.bias.copy_(torch.tril(torch.ones(48, 48, device=DEVICE)))
        _same_step(compiled, model, x)
    with torch.no_grad():
        model.bias.fill_(1.0)  # no mask at all now
    with pytest.warns(RuntimeWarning, match="a buffer read as known contents changed"):
        _same_step(compiled, model, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        _same_step(compiled, model, x)
    report = fusepass.last_report()
    assert not rewrites(report, "attention")  # withdrawn
    assert any("L['self']._buffers['bias'] no longer holds what it held" in h.reason for h in report.hotspots)


def test_a_buffer_replaced_by_another_is_read_again():
    model, compiled, x = _stepped_once()
    model.bias = torch.tril(torch.ones(48, 48, device=DEVICE), diagonal=-1).view(1, 1, 48, 48)
    model.bias[..., 0, 0] = 1.0  # the first query still sees a key
    with pytest.warns(RuntimeWarning, match="a buffer read as known contents changed"):
        _same_step(compiled, model, x)


def test_strict_raises_where_a_buffer_changed():
    model = BufferAttention().to(DEVICE)
    compiled = _compiled(model, strict=True)
    x = torch.randn(2, 37, 32, device=DEVICE)
    compiled(x)
    with torch.no_grad():
        model.bias.fill_(1.0)
    with pytest.raises(ContentsChanged):
        compiled(x)


def test_new_lengths_read_the_buffer_as_its_band_and_guard_it():
    """Under symbolic lengths each length's plan reads the buffer of its call."""
    torch.manual_seed(0)
    model = BufferAttention().to(DEVICE)
    compiled = _compiled(model, strict=True)
    for length in (37, 29, 23):
        _same_step(compiled, model, torch.randn(2, length, 32, device=DEVICE))
    assert set(_attention_features()) == {("causal",)}
    with torch.no_grad():
        model.bias.fill_(1.0)
    with pytest.raises(ContentsChanged):  # a length planned before
        _step(compiled, torch.randn(2, 29, 32, device=DEVICE))


def test_a_buffer_made_in_inference_mode_is_read():
    """An inference tensor counts no versions, so no guard could see a write to it."""
    with torch.inference_mode():
        model = BufferAttention().to(DEVICE)
        compiled = _compiled(model, strict=True)
        x = torch.randn(2, 37, 32, device=DEVICE)
        assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    assert _attention_features() == [("mask",)]


def test_a_capture_takes_an_unseen_tensor_as_changed_unless_its_caller_checked_it(monkeypatch):
    """A CUDA graph's capture cannot read the device (GPT-2's whole-graph recording failed there): the tensor last
    checked, at its version, passes; another counts as changed (the replaced ops, which read it, are captured), but
    where a whole-graph recording checked the argument itself (`checked_by_caller`), whose copy the op may see."""
    tril = torch.tril(torch.ones(8, 8))
    guard = ContentGuard(0, KnownInput(weakref.ref(tril), "tril"), band_of(tril))
    copy = tril.clone()  # holds the band; comparing would say so, but a capture cannot compare
    monkeypatch.setattr(known_contents, "capturing", lambda device: True)
    guard.check([tril])
    with pytest.raises(ContentsChanged, match="cannot be compared with what it held when compiled while a CUDA"):
        guard.check([copy])
    with known_contents.checked_by_caller():
        guard.check([copy])
    with torch.no_grad():
        tril.add_(0)  # a write: a new version
    with pytest.raises(ContentsChanged):
        guard.check([tril])
    monkeypatch.setattr(known_contents, "capturing", lambda device: False)
    guard.check([tril])  # compared: still the band
    guard.check([copy])
