"""Attention under symbolic sizes: planned again at each concrete size, forward and backward exact."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from support import DEVICE, random_tensor, rewrites

import fusepass
from fusepass.report.records import KNOWN_CONTENTS


def padded_gqa(q, k, v, keep):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    n = q.shape[-2]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~(causal & keep[:, None, None, :]), float("-inf"))
    return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v


def inputs(n: int):
    q = random_tensor((2, 4, n, 16), torch.float32).requires_grad_()
    k, v = (random_tensor((2, 2, n, 16), torch.float32).requires_grad_() for _ in range(2))
    keep = torch.ones(2, n, dtype=torch.bool, device=DEVICE)
    keep[1, : n // 3] = False
    return q, k, v, keep


def check_sizes(compiled, sizes):
    for n in sizes:
        q, k, v, keep = inputs(n)
        out, expected = compiled(q, k, v, keep), padded_gqa(q, k, v, keep)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4, equal_nan=True)
        grad = torch.randn_like(out)
        actual = torch.autograd.grad(out, (q, k, v), grad)
        wanted = torch.autograd.grad(expected, (q, k, v), grad)
        for a, e in zip(actual, wanted):
            torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4, equal_nan=True)


def check_lengths(compiled, eager, lengths, batch: int = 2):
    """`compiled` computes what `eager` does of q, k, v [batch, 2, n, 16] at each length n, forward and backward."""
    for n in lengths:
        q, k, v = (random_tensor((batch, 2, n, 16), torch.float32).requires_grad_() for _ in range(3))
        out, expected = compiled(q, k, v), eager(q, k, v)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
        grad = torch.randn_like(out)
        for a, e in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(expected, (q, k, v), grad)):
            torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)


def test_symbolic_sizes_are_rewritten_and_exact():
    fusepass.reset()
    check_sizes(torch.compile(padded_gqa, backend=fusepass.backend(strict=True), dynamic=True), (21, 37))
    (rewrite,) = rewrites(fusepass.reports()[0], kind="attention", phase="forward")
    assert "symbolic" in rewrite.detail["sizes"] and "gqa" in rewrite.features
    assert len(fusepass.reports()) == 1  # one compile served both sizes


def test_a_recompile_for_a_new_size_keeps_the_rewrite():
    fusepass.reset()
    check_sizes(torch.compile(padded_gqa, backend="fusepass"), (21, 37, 29))  # the second compile is dynamic
    for report in fusepass.reports():
        assert rewrites(report, kind="attention", phase="forward")
        assert not [h for h in report.hotspots if h.kind == "attention"]


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "through autograd"])
def test_dropout_under_symbolic_sizes_drops_a_fraction_p_and_its_backward_the_same(monkeypatch, direct):
    """Each length's plan draws its seed in the forward, and the backward reads the mask the forward drew (what the
    forward kept), a second backward through one forward too: with V = I the output is the dropped probabilities,
    whose gradients follow from that same mask (as tests/attention/forms/test_dropout.py checks the static op)."""
    from fusepass.attention import dynamic, kept_forwards

    if not direct:
        monkeypatch.setattr(dynamic, "direct_plan", lambda module: None)
    fusepass.reset()
    p = 0.25
    with torch._functorch.config.patch(donated_buffer=False):  # else AOTAutograd refuses a second backward
        compiled = torch.compile(lambda q, k, v: F.dropout(torch.softmax(q @ k.transpose(-1, -2) * 0.25, dim=-1), p=p,
                                                           training=True) @ v,
                                 backend=fusepass.backend(strict=True), dynamic=True)
        for n in (24, 31):
            q, k = (random_tensor((2, 2, n, n), torch.float32).requires_grad_() for _ in range(2))
            eye = torch.eye(n, device=DEVICE).expand(2, 2, n, n).contiguous().requires_grad_()
            out = compiled(q, k, eye)
            grad = torch.randn_like(out)
            dq, dk, dv = torch.autograd.grad(out, (q, k, eye), grad, retain_graph=True)
            for first, second in zip((dq, dk, dv), torch.autograd.grad(out, (q, k, eye), grad)):
                torch.testing.assert_close(first, second, rtol=0, atol=0)
            probs = torch.softmax(q @ k.transpose(-1, -2) * 0.25, dim=-1).detach()
            dropped = out == 0
            assert abs(dropped.float().mean().item() - p) < 0.06, n
            torch.testing.assert_close(out[~dropped], (probs / (1 - p))[~dropped], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(dv, out.transpose(-1, -2) @ grad, rtol=1e-5, atol=1e-5)
            d_probs = grad * out / probs  # the gradient reaching P through the kept, rescaled entries
            d_scores = probs * (d_probs - (d_probs * probs).sum(-1, keepdim=True)) * 0.25
            torch.testing.assert_close(dq, d_scores @ k.detach(), rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(dk, d_scores.transpose(-1, -2) @ q.detach(), rtol=1e-4, atol=1e-5)
    assert not kept_forwards._forwards  # what the forwards kept left with their graphs
    (report,) = fusepass.reports()
    (rewrite,) = rewrites(report, kind="attention", phase="forward")
    assert "dropout" in rewrite.features and "symbolic" in rewrite.detail["sizes"]


def windowed(window: int):
    def attention(q, k, v):
        i = torch.arange(q.shape[-2], device=q.device)
        s = (q @ k.transpose(-1, -2)).masked_fill(i[:, None] - i[None, :] >= window, float("-inf"))
        return torch.softmax(s, dim=-1) @ v
    return attention


def test_an_int_made_symbolic_is_planned_at_each_value():
    """A closure's int that changed between calls: Dynamo recompiles with it symbolic, and the attention is
    planned again at each value it takes, as at each size, forward and backward exact."""
    q = random_tensor((1, 2, 19, 16), torch.float32).requires_grad_()
    for window in (4, 7, 9):
        fusepass.reset()
        out = torch.compile(windowed(window), backend="fusepass")(q, q, q)
        expected = windowed(window)(q, q, q)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        grad = torch.randn_like(out)
        torch.testing.assert_close(torch.autograd.grad(out, q, grad)[0], torch.autograd.grad(expected, q, grad)[0],
                                   rtol=1e-4, atol=1e-4)
        if window == 7:  # the recompile with the window symbolic (9 runs that graph: no new report)
            (rewrite,) = rewrites(fusepass.last_report(), kind="attention", phase="forward")
            assert rewrite.detail["sizes"].startswith("symbolic")


def scaled(scale: float):
    def attention(q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2) * scale, dim=-1) @ v
    return attention


def test_a_symbolic_float_is_declined_with_the_reason():
    q = random_tensor((1, 2, 19, 16), torch.float32)
    with torch._dynamo.config.patch(specialize_float=False):
        for scale in (0.25, 0.5):
            fusepass.reset()
            out = torch.compile(scaled(scale), backend="fusepass")(q, q, q)
            torch.testing.assert_close(out, scaled(scale)(q, q, q), rtol=1e-5, atol=1e-5)
    (hotspot,) = [h for h in fusepass.last_report().hotspots if h.kind == "attention"]
    assert "symbolic" in hotspot.reason and "dynamic=False" in hotspot.reason


def unmasked(q, k, v):
    return torch.softmax((q * 0.3) @ k.transpose(-1, -2), dim=-1) @ v


def test_unmasked_attention_reading_no_size_trains_under_symbolic_sizes():
    """An attention that reads no size (no mask, no position) passes the dynamic op an empty list of sizes,
    whose gradient torch wants as a list: the backward failed and the graph ran unfused (strict: raised)."""
    fusepass.reset()
    compiled = torch.compile(unmasked, backend=fusepass.backend(strict=True))
    check_lengths(compiled, unmasked, (13, 21, 37), batch=1)  # the second size recompiles with symbolic sizes
    assert any("symbolic" in r.detail.get("sizes", "")
               for r in rewrites(fusepass.last_report(), kind="attention", phase="forward"))


class CausalBlock(torch.nn.Module):
    """nanoGPT's attention: q, k, v split from one projection and viewed into heads, its causal mask a
    registered `tril` buffer sliced to the length (the scores scaled by `scale` more: another attention)."""

    def __init__(self, d=32, heads=2, longest=64, scale=1.0, window=None):
        super().__init__()
        self.heads, self.scale = heads, scale
        self.qkv = torch.nn.Linear(d, 3 * d)
        mask = torch.tril(torch.ones(longest, longest)) if window is None else \
            torch.tril(torch.triu(torch.ones(longest, longest), -window))  # a sliding window's band
        self.register_buffer("bias", mask.view(1, 1, longest, longest))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
        s = (q @ k.transpose(-2, -1)) * (self.scale / math.sqrt(k.size(-1)))
        s = F.softmax(s.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf")), dim=-1)
        return (s @ v).transpose(1, 2).reshape(b, t, c)


def _train_at(compiled, model, t):
    """A training step of `model` on [2, t, 32] inputs: `compiled`'s output and gradients are eager's."""
    x = random_tensor((2, t, 32), torch.float32).requires_grad_()
    out, expected = compiled(x), model(x)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    grad = torch.randn_like(out)
    params = (x, *model.parameters())
    for a, e in zip(torch.autograd.grad(out, params, grad), torch.autograd.grad(expected, params, grad)):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)


def _new_specs(earlier):
    from fusepass.attention import dynamic

    return [spec for name, spec in dynamic._specs.items() if name not in earlier]


def test_a_viewed_projection_is_fused_at_every_length_planned_at_run_time():
    """The op plans each new length below autograd's dispatch, where views were not tracked: the layout
    analysis took the heads' view for a copy at the length Dynamo first saw symbolic, and that length ran
    unfused (eager's result, so only the count of fused calls saw it)."""
    from fusepass.attention import dynamic, kept_forwards

    fusepass.reset()
    block = CausalBlock().to(DEVICE)
    compiled = torch.compile(block, backend=fusepass.backend(strict=True))  # strict: a length not fused raises
    earlier = set(dynamic._specs.keys())
    for t in (24, 37, 29, 37):  # the second length recompiles with symbolic sizes, planned at 37 and 29
        _train_at(compiled, block, t)
    (spec,) = _new_specs(earlier)
    assert sorted(key[0][0][1] for key in spec.plans) == [29, 37]  # q's length
    assert all(plan.direct is not None for plan in spec.plans.values())  # the op on the projection's splits
    assert not [h for report in fusepass.reports() for h in report.hotspots if h.kind == "attention"]


def test_a_length_whose_plan_does_not_fuse_is_reported():
    from fusepass.attention import dynamic, kept_forwards

    fusepass.reset()
    earlier = set(dynamic._specs.keys())
    compiled = torch.compile(lambda q, k, v: unmasked(q, k, v), backend="fusepass")
    for n in (13, 21):  # 21 compiles with symbolic sizes
        q = random_tensor((1, 2, n, 16), torch.float32)
        compiled(q, q, q)
    (spec,) = [spec for name, spec in dynamic._specs.items() if name not in earlier]
    spec.static_rewrite = lambda gm, ctx: gm  # a plan that rewrites nothing
    q = random_tensor((1, 2, 30, 16), torch.float32)
    with pytest.warns(RuntimeWarning, match="not rewritten at sizes"):
        torch.testing.assert_close(compiled(q, q, q), unmasked(q, q, q), rtol=1e-4, atol=1e-4)
    (hotspot,) = [h for h in fusepass.last_report().hotspots if h.kind == "attention"]
    assert "not rewritten at sizes" in hotspot.reason


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "through autograd"])
def test_the_backward_reads_what_the_forward_kept(monkeypatch, direct):
    """One fused forward per training step: the backward takes what the forward kept (named by the token the op
    returns: the static op's outputs where the plan is that op alone, else the plan's autograd graph) rather
    than running it again, and nothing stays kept after it, or after a forward whose output is dropped
    undifferentiated. A second backward through one forward reads it again (a forward run again would draw another
    dropout mask)."""
    import gc

    from fusepass.attention import call, dynamic, kept_forwards

    if not direct:
        monkeypatch.setattr(dynamic, "direct_plan", lambda module: None)
    forwards = []
    forward = call.AttentionCall.forward
    monkeypatch.setattr(call.AttentionCall, "forward", lambda self, *a: forwards.append(1) or forward(self, *a))
    fusepass.reset()
    earlier = set(dynamic._specs.keys())
    compiled = torch.compile(lambda *args: padded_gqa(*args), backend=fusepass.backend(strict=True), dynamic=True)
    q, k, v, keep = inputs(27)
    grad = None
    for _ in range(2):  # a plan's first call and a later one
        forwards.clear()
        out = compiled(q, k, v, keep)
        grad = torch.randn_like(out)
        actual = torch.autograd.grad(out, (q, k, v), grad)
        assert len(forwards) == 1 and not kept_forwards._forwards
    (spec,) = [spec for name, spec in dynamic._specs.items() if name not in earlier]
    assert all((plan.direct is not None) == direct for plan in spec.plans.values())
    wanted = torch.autograd.grad(padded_gqa(q, k, v, keep), (q, k, v), grad)
    for a, e in zip(actual, wanted):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4, equal_nan=True)

    out = compiled(q, k, v, keep)
    assert len(kept_forwards._forwards) == 1
    del out
    gc.collect()
    assert not kept_forwards._forwards

    with torch._functorch.config.patch(donated_buffer=False):  # else AOTAutograd refuses a second backward
        retaining = torch.compile(lambda *args: padded_gqa(*args), backend=fusepass.backend(strict=True),
                                  dynamic=True)
        out = retaining(q, k, v, keep)
        forwards.clear()
        first = torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)
        second = torch.autograd.grad(out, (q, k, v), grad)
        assert not forwards
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def _shared_mask_layers(q, k, v):
    """Hugging Face's eager masks: one additive causal mask, built once from arange and a traced constant, read by
    every layer."""
    position = torch.arange(q.size(-2), device=q.device)
    allowed = position[None, :] <= position[:, None]
    mask = torch.where(allowed, torch.tensor(0.0, device=q.device), torch.finfo(q.dtype).min)[None, None]
    for _ in range(2):
        q = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)) + mask, dim=-1) @ v
    return q


def test_a_mask_built_once_for_every_layer_is_computed_from_the_positions_at_each_length():
    """Each layer's module builds the mask again from the sizes: each length's plan then computes it from the
    positions (a causal mask, its map cached), where it had read it as a bias tensor, its sizes in the source."""
    from fusepass.attention import call

    compiled = torch.compile(_shared_mask_layers, backend=fusepass.backend(strict=True))
    before = set(call._calls)
    check_lengths(compiled, _shared_mask_layers, (37, 29, 23))
    planned = [call._calls[name] for name in set(call._calls) - before]
    assert planned and {tuple(c.spec.lifted.features) for c in planned} == {("causal",)}
    assert len({c.mod.keep for c in planned}) == 1  # one source at every length: its kernels compiled once


def _sized_forms(form: str, n: int):
    """(the attention, its inputs at length n, those a gradient flows to) of forms whose score chain reads tensors
    at strides and bounds that follow the length."""
    from attention.forms.test_additive_bias import learned_bias
    from attention.forms.test_documents import packed_documents
    from attention.forms.test_t5_relative_bias import t5_attention

    q, k, v = (random_tensor((2, 2, n, 16), torch.float32).requires_grad_() for _ in range(3))
    if form == "distance_table":  # T5's learned relative position bias, read through a distance table
        table = random_tensor((16, 2), torch.float32).requires_grad_()
        return t5_attention, (q, k, v, table), (q, k, v, table)
    if form == "documents":  # ids compared at query and key (a separable keep), with causal
        ids = (torch.arange(n, device=DEVICE) // 5).expand(2, n).contiguous()
        return packed_documents, (q, k, v, ids), (q, k, v)
    bias = random_tensor((1, 2, 48, 48), torch.float32).requires_grad_()  # a learned bias sliced to the length
    return learned_bias, (q, k, v, bias), (q, k, v, bias)


@pytest.mark.parametrize("form", ["padding", "distance_table", "documents", "learned_bias"])
def test_the_sizes_a_plan_reads_are_run_time_values_one_source_at_every_length(form):
    """A score input's strides and bounds, a distance table's offsets: each length's plan passes them at run time, so
    every plan has one source (the flash kernels compile once) and computes eager's values at its own length."""
    from fusepass.attention import call

    before = set(call._calls)
    if form == "padding":
        check_sizes(torch.compile(padded_gqa, backend=fusepass.backend(strict=True), dynamic=True), (21, 37, 29))
    else:
        compiled = torch.compile(_sized_forms(form, 8)[0], backend=fusepass.backend(strict=True), dynamic=True)
        for n in (21, 37, 29):
            fn, inputs, learning = _sized_forms(form, n)
            out, expected = compiled(*inputs), fn(*inputs)
            torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
            grad = torch.randn_like(out)
            for a, e in zip(torch.autograd.grad(out, learning, grad), torch.autograd.grad(expected, learning, grad)):
                torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)
    planned = [call._calls[name] for name in set(call._calls) - before]
    assert len(planned) >= 3 and all(c.spec.lifted.sizes for c in planned)
    assert len({c.spec.lifted.source for c in planned}) == 1
    assert len({c.spec.lifted.sizes for c in planned}) >= 3  # each length its own


class Stack(torch.nn.Module):
    """Layers of nanoGPT's block, each with its own `tril` buffer; the last one's scores scaled otherwise, or its
    buffer a sliding window's, as `other_last` says."""

    def __init__(self, layers: int = 3, other_last: str | None = None):
        super().__init__()
        last = {"scale": dict(scale=0.5), "window": dict(window=5), None: {}}[other_last]
        self.blocks = torch.nn.ModuleList(CausalBlock(**(last if i == layers - 1 else {})) for i in range(layers))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


def _planned(monkeypatch) -> list[int]:
    """Counts the plans made from now on."""
    from fusepass.attention import dynamic

    made: list[int] = []
    plan_static = dynamic.plan_static
    monkeypatch.setattr(dynamic, "plan_static", lambda *args: made.append(1) or plan_static(*args))
    return made


@pytest.mark.parametrize("other_last", [None, "scale", "window"], ids=["alike", "the last scaled", "a window last"])
def test_layers_alike_share_one_plan_per_new_length(monkeypatch, other_last):
    """A stack's layers cut out the same attention: a new length is planned once for all of them (each layer's own
    buffer guarded as its contents, each layer's gradients its own); a layer whose attention differs, apart."""
    from fusepass.attention import dynamic

    stack = Stack(other_last=other_last).to(DEVICE)
    compiled = torch.compile(stack, backend=fusepass.backend(strict=True))
    earlier = set(dynamic._specs.keys())
    made = _planned(monkeypatch)
    _train_at(compiled, stack, 24)
    made.clear()
    fusepass.reset()
    _train_at(compiled, stack, 37)  # recompiles with symbolic sizes: planned at the compile's sizes, then at 37
    assert len(made) == (4 if other_last else 2)
    specs = _new_specs(earlier)
    assert len(specs) == 3 and len({id(s.table) for s in specs}) == (2 if other_last else 1)
    records = [r for r in fusepass.last_report().rewrites if r.kind == "attention" and r.phase == "forward"]
    named = [list(r.detail[KNOWN_CONTENTS]) for r in records]  # each layer's record names its own buffer
    assert all(len(n) == 1 and "bias" in n[0] and str(i) in n[0] for i, n in enumerate(named)), named
    assert len({n[0] for n in named}) == 3
    names = [k.name for k in specs[0].known if k is not None]
    assert names and f"or one of the {1 if other_last else 2} alike in the other layers" in names[0]
    made.clear()
    _train_at(compiled, stack, 29)  # a second new length
    assert len(made) == (2 if other_last else 1)
    made.clear()
    _train_at(compiled, stack, 29)
    assert not made
    assert sorted(k[0][0][1] for k in specs[0].plans) == [29, 37]


def test_one_layers_buffer_written_takes_it_out_of_the_shared_plans():
    """The layer whose buffer no longer holds the band is planned again apart, reading its buffer as it is; the
    others keep the plans they share."""
    from fusepass.attention import dynamic

    stack = Stack().to(DEVICE)
    compiled = torch.compile(stack, backend=fusepass.backend())
    earlier = set(dynamic._specs.keys())
    for t in (24, 37):
        _train_at(compiled, stack, t)
    specs = _new_specs(earlier)
    shared = specs[0].table
    with torch.no_grad():
        stack.blocks[1].bias[..., 3, 1] = 0  # no longer the band: position 3 may not see position 1
    with pytest.warns(RuntimeWarning, match="no longer holds .* planned again apart from the layers alike"):
        _train_at(compiled, stack, 37)
    assert specs[0].table is shared and specs[2].table is shared and specs[1].table is not shared
    assert any("planned again apart" in h.reason for h in fusepass.last_report().hotspots)
    calls = [c for spec in specs for plan in spec.plans.values() for c in _calls_of(plan.module)]
    assert calls and not any(c.unfused.failed for c in calls)  # every layer's kernels still run
    _train_at(compiled, stack, 29)  # a new length: the layers alike plan it once, the other apart


def _calls_of(module):
    from fusepass.attention.call import call_named

    return [call_named(n.args[-1]) for n in module.graph.nodes if n.target is torch.ops.fusepass.attention.default]


def test_attentions_alike_but_of_other_sizes_keep_their_own_records():
    """Two attentions of one module's structure on one line, of other head dims: each planned and reported at its
    own sizes (the compile's records are shared only where the sizes are too)."""
    from fusepass.attention import dynamic

    def two(*qkvs):
        return [unmasked(*qkv) for qkv in (qkvs[:3], qkvs[3:])]

    earlier = set(dynamic._specs.keys())
    fusepass.reset()
    compiled = torch.compile(two, backend=fusepass.backend(strict=True), dynamic=True)
    inputs = [random_tensor((1, 2, 21, d), torch.float32) for d in (16, 16, 16, 32, 32, 32)]
    for out, expected in zip(compiled(*inputs), two(*inputs)):
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    specs = _new_specs(earlier)
    assert len(specs) == 2 and specs[0].table is not specs[1].table
    first, second = rewrites(fusepass.last_report(), kind="attention", phase="forward")
    assert first.bytes_fused < second.bytes_fused
