"""On a GPU: attention calls whose tensors repeat an earlier call's replay its launches as a CUDA graph
(`fusepass.runtime.replay`), and compute what the same kernels launched one by one compute, bit for bit, on
every call's values: forward and backward, a cached block map dropped from its cache meanwhile (held by the
graphs that read it), a map built per call, dropout (a new seed per call, read by the kernels from its tensor)."""
from __future__ import annotations

import math

import pytest
import torch

import fusepass
from fusepass.flash import blockmap
from fusepass.runtime.replay import attention_replays

# per-op replays: what a graph's ops do call by call, which a whole-graph replay does not run
pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need the GPU"),
              pytest.mark.usefixtures("graphs_off")]


def window(q, k, v):
    n = q.shape[-2]
    i = torch.arange(n, device=q.device)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = s.masked_fill((i[None, :] > i[:, None]) | (i[:, None] - i[None, :] >= 100), float("-inf"))
    return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v


def documents(q, k, v, doc):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = s.masked_fill(doc[:, None] != doc[None, :], float("-inf"))
    return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v


def dropped(q, k, v):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return torch.nn.functional.dropout(torch.softmax(s.float(), dim=-1), p=0.3).to(q.dtype) @ v


def _inputs(n=333, d=64):
    q, k, v = (torch.randn(2, 3, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    return q, k, v


def _step(fn, q, k, v, grad, *extra):
    out = fn(q, k, v, *extra)
    return (out, *torch.autograd.grad(out, (q, k, v), grad))


def _copy_into(results, step):
    """A call's results copied out, none of its tensors left alive (a loop variable holding one would move the
    next call's allocations, and with them its replay keys)."""
    for result, t in zip(results, step):
        result.copy_(t)


@pytest.mark.parametrize("case", ["window", "documents"])
def test_replayed_calls_compute_what_launched_calls_compute(case):
    fn, extra = (window, ()) if case == "window" else (documents, (torch.arange(333, device="cuda") // 50,))
    replayed = torch.compile(fn, backend=fusepass.backend(strict=True))
    # another code object: Dynamo keeps one backend's graphs per function, and would recompile on each switch
    launched = torch.compile(lambda *args: fn(*args), backend=fusepass.backend(strict=True, replay=False))
    q, k, v = _inputs()
    grad = torch.randn(2, 3, 333, 64, device="cuda", dtype=torch.bfloat16)
    calls = 6
    values = [[torch.randn_like(t) for t in (q, k, v, grad)] for _ in range(calls)]
    results = [[torch.empty_like(t) for t in (q, q, k, v)] for _ in range(calls)]  # out, dq, dk, dv

    def set_values(call):
        with torch.no_grad():  # new values in the same tensors: the launches' arguments repeat
            for t, value in zip((q, k, v, grad), values[call]):
                t.copy_(value)

    # The replayed calls one after another, nothing else allocated between them: each starts from the same
    # free memory, so its outputs land where the last call's did.
    blockmap._cache.clear()  # the maps cached from here on are the replayed function's
    replayed_by_call = []
    for call in range(calls):
        set_values(call)
        if call == calls - 1:  # the graphs read cached maps their cache drops: the graphs hold them
            held = {id(t) for replay in attention_replays._replays.values() for t in replay.held}
            # each cached map is read by a kernel: its rows lists (forward, dQ) or its cols lists (dK/dV)
            assert all(id(m.rows.index) in held or id(m.cols.index) in held for m in blockmap._cache.values()), \
                replayed_by_call
            blockmap._cache.clear()
        replayed_before = attention_replays.replayed
        _copy_into(results[call], _step(replayed, q, k, v, grad, *extra))
        replayed_by_call.append(attention_replays.replayed - replayed_before)
    for call in range(calls):
        set_values(call)
        for got, expected in zip(results[call], _step(launched, q, k, v, grad, *extra)):
            assert torch.equal(got, expected), f"call {call}"
    # the forward's and the backward's sequences (a map built per call is written into the op's outputs)
    assert replayed_by_call[:2] == [0, 0] and replayed_by_call[-1] == 2, replayed_by_call


def test_a_replayed_output_is_not_written_by_the_next_call():
    compiled = torch.compile(window, backend=fusepass.backend(strict=True))
    q, k, v = _inputs()
    with torch.no_grad():
        for _ in range(3):
            compiled(q, k, v)
        kept = compiled(q, k, v)
        copy = kept.clone()
        q.copy_(torch.randn_like(q))
        compiled(q, k, v)
        compiled(q, k, v)
    assert torch.equal(kept, copy)


def test_dropout_draws_anew_on_every_call():
    compiled = torch.compile(dropped, backend=fusepass.backend(strict=True))
    q, k, v = _inputs()
    with torch.no_grad():
        outs = [compiled(q, k, v) for _ in range(4)]
    assert not any(torch.equal(a, b) for a, b in zip(outs, outs[1:]))
