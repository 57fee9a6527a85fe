"""SDPA in place of the fused kernels, where it computes the captured function and the running GPU times it
faster (`attention.sdpa_floor`): which attentions may take it (the mask checked element by element), both
ways computing eager's function forward and backward, and the report saying which ran, with both times.

The timing is replaced here (the interpreter's times decide nothing); the check of the function is not."""
from __future__ import annotations

import gc
import math
import re

import pytest
import torch
import torch.nn.functional as F
import triton
from support import DEVICE, check, last_attention, random_tensor, sm90_backward_stand_in

import fusepass
from fusepass.attention import kept_forwards, sdpa_floor
from fusepass.attention.sdpa_floor import SdpaRun, causal_band
from fusepass.flash import hopper_backward, hopper_forward
from fusepass.report.records import SDPA

# what a graph's ops do call by call, which a whole-graph replay does not run
pytestmark = pytest.mark.usefixtures("graphs_off")

B, H, T, D = 2, 3, 37, 16


@pytest.fixture
def times(monkeypatch):
    """Sets the times the decision reads, (SDPA's, the fused kernels') in ms: SDPA faster unless changed."""
    measured = {"sdpa": 1.0, "fused": 2.0, "steps run": False}

    def timed(sdpa_step, fused_step):
        if measured["steps run"]:  # what a GPU times, run once
            sdpa_step()
            fused_step()
        return measured["sdpa"], measured["fused"]

    monkeypatch.setattr(sdpa_floor, "can_time", lambda device: True)
    monkeypatch.setattr(sdpa_floor, "timed", timed)
    monkeypatch.setattr(sdpa_floor, "_decisions", {})
    return measured


@pytest.fixture
def sdpa_calls(monkeypatch) -> list[bool]:
    """Records each SDPA run's `is_causal`."""
    calls: list[bool] = []
    attend = SdpaRun.attend
    monkeypatch.setattr(SdpaRun, "attend", lambda self, *qkv: calls.append(self.causal) or attend(self, *qkv))
    return calls


def scores(q, k):
    return q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])


def plain(q, k, v):
    return torch.softmax(scores(q, k), dim=-1) @ v


def causal(q, k, v):
    n = q.shape[-2]
    keep = torch.arange(n, device=q.device)[None, :] <= torch.arange(n, device=q.device)[:, None]
    return torch.softmax(scores(q, k).masked_fill(~keep, float("-inf")), dim=-1) @ v


def causal_additive(q, k, v):  # a mask added as -inf, upcast softmax
    i = torch.arange(q.shape[-2], device=q.device)
    bias = torch.where(i[None, :] <= i[:, None], 0.0, float("-inf"))
    return torch.softmax((scores(q, k) + bias).float(), dim=-1).to(v.dtype) @ v


def subsequent_mask(q, k, v):  # nn.Transformer's causal mask, added
    n = q.shape[-2]
    return plain_with(q, k, v, torch.triu(torch.full((n, n), float("-inf"), device=q.device), diagonal=1))


def plain_with(q, k, v, bias):
    return torch.softmax(scores(q, k) + bias, dim=-1) @ v


class TrilBuffer(torch.nn.Module):  # nanoGPT: a registered tril buffer, sliced and compared
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones(64, 64, device=DEVICE)).view(1, 1, 64, 64))

    def forward(self, q, k, v):
        n = q.shape[-2]
        att = scores(q, k).masked_fill(self.bias[:, :, :n, :n] == 0, float("-inf"))
        return torch.softmax(att, dim=-1) @ v


def gqa(q, k, v):  # Llama's repeat_kv: K and V heads repeated for groups of query heads
    k, v = (x[:, :, None].expand(-1, -1, 3, -1, -1).reshape(B, 3, T, D) for x in (k, v))
    return causal(q, k, v)


def one_projection(x, weight):  # GPT-2: Q, K and V split from one projection, the output's heads merged
    q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in (x @ weight).split(H * D, dim=2))
    return causal(q, k, v).transpose(1, 2).contiguous().view(B, T, H * D)


def qkv(heads: int = H, dtype: torch.dtype = torch.float32, length: int = T) -> list[torch.Tensor]:
    return [random_tensor((B, heads, length, D), dtype) for _ in range(3)]


def ran(report) -> list[str]:
    (record,) = [r for r in report.rewrites if r.kind == "attention" and r.phase == "forward"]
    return list(record.detail.get(SDPA, {}).values())


@pytest.mark.parametrize("fn, causal_call", [(plain, False), (causal, True), (causal_additive, True),
                                             (subsequent_mask, True), (TrilBuffer(), True)],
                         ids=["plain", "causal", "additive", "subsequent_mask", "tril_buffer"])
def test_sdpa_runs_where_it_computes_the_attention_and_is_faster(times, sdpa_calls, fn, causal_call):
    report = check(fn, *qkv(), backward=True)
    assert sdpa_calls == [causal_call]
    (said,) = ran(report)
    assert said.startswith(f"SDPA ran ({'causal' if causal_call else 'unmasked'}; forward and backward")
    assert "1 ms in SDPA, 2 ms fused" in said
    assert f"at [{B}, {H}, {T}, {D}] float32: SDPA ran" in " ".join(str(report).split())
    assert not kept_forwards._forwards  # the kept graph left with the backward


def test_shared_kv_heads_and_one_projections_gradient_buffer(times, sdpa_calls):
    times["steps run"] = True  # the timed steps themselves: SDPA's and the fused kernels'
    check(gqa, random_tensor((B, 3, T, D), torch.float32), *qkv(heads=1)[1:], backward=True)
    assert sdpa_calls[-1] and last_attention().sdpa.gqa
    sdpa_calls.clear()
    # Weights of a trained model's size: with U(-3, 3) the scores' spread is ~200 and most rows put all their weight
    # on one key, where SDPA's float32 backward (a row term summed apart from dp) was 5x eager's distance on the GPU.
    report = check(one_projection, random_tensor((B, T, 24), torch.float32),
                   random_tensor((24, 3 * H * D), torch.float32, low=-0.5, high=0.5), backward=True)
    assert sdpa_calls[-1] and last_attention().spec.out_by_position
    assert last_attention().spec.gradient_owners == (0, 0, 0)
    assert ran(report)[0].startswith("SDPA ran")


def test_a_kernel_failing_while_timed_runs_the_replaced_ops(times, monkeypatch):
    """The floor's timing runs the fused kernels: one that fails there warns and the replaced ops run, as a kernel
    failing in a call does (it raised out of the model's forward)."""
    from fusepass.flash import backward as flash_backward

    def failing(*args, **kwargs):
        raise RuntimeError("backward kernel failed")

    times["steps run"] = True
    monkeypatch.setattr(flash_backward, "backward_launches", failing)
    with pytest.warns(RuntimeWarning, match="backward kernel failed"):
        check(causal, *qkv(), backward=True)


def test_the_timed_steps_leave_the_users_random_stream_alone(times):
    """The decision's random operands come from fusepass's own generator: after a compiled first call the user's
    stream draws what it would after eager's (and no other thread's CUDA graph capture, which holds the default
    generator, refuses the draws)."""
    times["steps run"] = True
    compiled = torch.compile(plain, backend="fusepass")
    q, k, v = qkv()
    state = torch.cuda.get_rng_state if DEVICE == "cuda" else torch.get_rng_state
    before = state()
    compiled(q, k, v)
    assert last_attention().sdpa is not None
    assert torch.equal(state(), before)


def test_the_fused_kernels_run_where_sdpa_is_slower(times, sdpa_calls):
    times["sdpa"] = 3.0
    report = check(causal, *qkv(), backward=True)
    assert not sdpa_calls
    assert ran(report) == ["the fused kernels ran (causal; forward and backward measured 3 ms in SDPA, 2 ms fused)"]


def window(q, k, v):
    i = torch.arange(q.shape[-2], device=q.device)
    keep = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < 8)
    return torch.softmax(scores(q, k).masked_fill(~keep, float("-inf")), dim=-1) @ v


def prefix(q, k, v):  # a mask of the key positions alone
    keep = torch.arange(k.shape[-2], device=q.device) < 30
    return torch.softmax(scores(q, k).masked_fill(~keep, float("-inf")), dim=-1) @ v


@pytest.mark.parametrize("fn", [window, prefix], ids=["window", "prefix"])
def test_a_mask_of_positions_other_than_causal_is_not_sdpas(times, sdpa_calls, fn):
    report = check(fn, *qkv(), backward=True)
    assert last_attention().sdpa is not None  # a mask of positions: checked at the shape
    assert not sdpa_calls and not ran(report)


@triton.jit
def _band_of_5(b, h, q_idx, kv_idx, aux):
    return (kv_idx <= q_idx) & (q_idx - kv_idx < 5)


@triton.jit
def _diagonal(b, h, q_idx, kv_idx, aux):
    return kv_idx == q_idx


@triton.jit
def _causal(b, h, q_idx, kv_idx, aux):
    return kv_idx <= q_idx


@triton.jit
def _everything(b, h, q_idx, kv_idx, aux):
    return (kv_idx >= 0) & (q_idx >= 0)


@triton.jit
def _band_with_a_sink(b, h, q_idx, kv_idx, aux):  # the first key kept by every query too
    return ((kv_idx <= q_idx) & (q_idx - kv_idx < 5)) | (kv_idx == 0)


@triton.jit
def _every_other(b, h, q_idx, kv_idx, aux):  # as many keys in the last row as a band of 19, not a band
    return (kv_idx <= q_idx) & ((q_idx - kv_idx) % 2 == 0)


@pytest.mark.parametrize("keep, width", [(_band_of_5, 5), (_diagonal, 1), (_causal, None), (_everything, None),
                                         (_band_with_a_sink, None), (_every_other, None)],
                         ids=["band", "diagonal", "causal", "everything", "sink", "every-other"])
def test_a_sliding_windows_band_is_found_element_by_element(keep, width):
    assert causal_band(keep, (), 37, 37, torch.device(DEVICE)) == width


@triton.jit
def _band_of_aux(b, h, q_idx, kv_idx, aux):  # aux: (the width,)
    return (kv_idx <= q_idx) & (q_idx - kv_idx < aux[0])


@pytest.mark.parametrize("width", [63, 64, 65, 129])
def test_a_band_across_the_check_kernels_programs(width):
    """At 130 positions the check runs over 3 × 3 programs: the band's edges cross them."""
    assert causal_band(_band_of_aux, (width,), 130, 130, torch.device(DEVICE)) == width


def test_a_sliding_windows_band_takes_the_sm90_backward_where_it_serves(times, monkeypatch):
    """A mask checked to be a window's band at the shape sends the backward to the sm_90 kernel with the band's
    width (here a stand-in that fails: the replaced ops run, with a warning, and compute eager's gradients)."""
    monkeypatch.setattr(hopper_backward, "WINDOWS", True)
    monkeypatch.setattr(hopper_backward, "available", lambda device: True)
    monkeypatch.setattr(hopper_forward, "serves", lambda *args: True)
    assert sm90_backward_stand_in(monkeypatch, window, *qkv(dtype=torch.float16))["window"] == 8


def finite_fill(q, k, v):  # a row's scores near the fill would weigh it: not SDPA's -inf
    n = q.shape[-2]
    keep = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    return torch.softmax(scores(q, k).masked_fill(~keep, -1e9), dim=-1) @ v


def unscaled(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v


def dropout(q, k, v):
    return F.dropout(torch.softmax(scores(q, k), dim=-1), p=0.25) @ v


def bottom_right(q, k, v):  # causal over unequal lengths, aligned at the end: not SDPA's is_causal
    i, j = torch.arange(q.shape[-2], device=q.device), torch.arange(k.shape[-2], device=q.device)
    keep = j[None, :] <= i[:, None] + (k.shape[-2] - q.shape[-2])
    return torch.softmax(scores(q, k).masked_fill(~keep, float("-inf")), dim=-1) @ v


@pytest.mark.parametrize("fn, inputs", [
    (finite_fill, lambda: qkv()),
    (plain_with, lambda: qkv() + [random_tensor((T, T), torch.float32)]),
    (unscaled, lambda: qkv()),
    (bottom_right, lambda: [random_tensor((B, H, 11, D), torch.float32)] + qkv()[1:]),
], ids=["finite_fill", "bias", "unscaled", "bottom_right"])
def test_attentions_no_sdpa_call_computes_are_not_offered_it(times, sdpa_calls, fn, inputs):
    check(fn, *inputs(), backward=True)
    assert last_attention().sdpa is None and not sdpa_calls


def test_dropout_is_not_offered_sdpa(times, sdpa_calls):
    torch.compile(dropout, backend="fusepass")(*(x.requires_grad_() for x in qkv())).sum().backward()
    assert last_attention().sdpa is None and not sdpa_calls


def test_each_class_of_shapes_timed_once_and_a_retained_graph_differentiated_twice(times, sdpa_calls):
    model = TrilBuffer()
    compiled = torch.compile(model, backend="fusepass", dynamic=False)
    for length in (T, 29, 45):  # 37 and 45 are one class (64 rounded up), 29 another
        q, k, v = (x.detach().requires_grad_() for x in qkv(length=length))
        out = compiled(q, k, v)
        grad = torch.randn_like(out)
        out.backward(grad, retain_graph=True)
        out.backward(grad)
        eager = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        expected = torch.autograd.grad(model(*eager), eager, grad)
        torch.testing.assert_close(out, model(*eager), rtol=1e-5, atol=1e-5)
        for x, e in zip((q, k, v), expected):
            torch.testing.assert_close(x.grad, 2 * e, rtol=1e-5, atol=1e-5)
        del out
        gc.collect()
        assert not kept_forwards._forwards
    assert sdpa_calls == [True, True, True]
    assert len(sdpa_floor._decisions) == 2
    said = " ".join(str(fusepass.last_report()).split())
    assert f"at [{B}, {H}, 45, {D}] float32: SDPA ran (causal; forward and backward measured at [{B}, {H}, {T}, {D}] " \
        "float32 1 ms in SDPA, 2 ms fused)" in said, said


def test_sizes_planned_at_run_time_say_what_ran_in_the_compiles_report(times, sdpa_calls):
    fusepass.reset()
    compiled = torch.compile(causal, backend="fusepass", dynamic=True)
    for length in (T, 45, 29):
        out = compiled(*(x.requires_grad_() for x in qkv(length=length)))
        out.sum().backward()
    assert sdpa_calls == [True, True, True]
    (report,) = fusepass.reports()
    (record,) = [r for r in report.rewrites if r.kind == "attention" and r.phase == "forward"]
    assert list(record.detail[SDPA]) == [f"[{B}, {H}, {n}, {D}] float32" for n in (T, 45, 29)]
    assert "measured at" in record.detail[SDPA][f"[{B}, {H}, 45, {D}] float32"]


def test_inference_keeps_no_graph(times, sdpa_calls):
    inputs = qkv()
    with torch.no_grad():
        out = torch.compile(causal, backend="fusepass")(*inputs)
    torch.testing.assert_close(out, causal(*inputs), rtol=1e-5, atol=1e-5)
    assert sdpa_calls == [True] and not kept_forwards._forwards


@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU the decision is timed")
def test_no_decision_without_a_gpu_to_time_on(sdpa_calls):
    fusepass.reset()
    report = check(causal, *qkv(), backward=True)
    assert not sdpa_calls and not ran(report)


@pytest.mark.skipif(DEVICE != "cuda", reason="the decision is timed on a GPU")
@pytest.mark.parametrize("fn", [causal, TrilBuffer()], ids=["causal", "tril_buffer"])
def test_on_the_gpu_the_decision_is_timed(fn):
    sdpa_floor._decisions.clear()
    report = check(fn, *qkv(dtype=torch.bfloat16, length=61), backward=True)
    (said,) = ran(report)
    assert re.fullmatch(r"(SDPA|the fused kernels) ran \(causal; forward and backward measured [\d.]+ ms in SDPA, "
                        r"[\d.]+ ms fused\)", said), said
