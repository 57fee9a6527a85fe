"""What a replay repeats is determined by its key: every attention call's launches (kernel, grid, arguments,
keywords) are traced, and where two calls have the same key (`LaunchReplays.key`: the pointers, shapes, strides
and dtypes of the tensors the op names, the pointers of those it allocated for the call, and its host values)
their traces must be equal. On any machine: the
launches run (the interpreter on the CPU), nothing is captured; `tests/kernels/test_replay.py` covers the
capture policy, `test_replay.py` the graphs on the GPU.

The CPU's allocator does not give a call's outputs the last call's addresses as the GPU's does, so keys and
traces are compared with pointers renamed: a pointer into a tensor the key names by that tensor's place in the
key (and its offset), any other (a temporary, a cached map) by its order of appearance in the trace; a pointer
into one of the compiled function's inputs that the key does not name fails."""
from __future__ import annotations

import math

import pytest
import torch
from support import DEVICE, SUMMED_GRADIENT_FP32, assert_close, random_tensor

import fusepass
from fusepass.attention import call as attention_call
from fusepass.flash import blockmap
from fusepass.flash import distance_table, config as flash_config
from fusepass.runtime.replay import LaunchReplays

# what a graph's ops do call by call, which a whole-graph replay does not run
pytestmark = pytest.mark.usefixtures("graphs_off")


class TracedReplays(LaunchReplays):
    """Runs every call's launches, tracing them; from its second call on, a key must trace alike."""

    def __init__(self):
        super().__init__()
        self.traces: dict = {}
        self.compared = 0
        self.trace: list | None = None
        self.named: list[torch.Tensor] = []
        self.others: dict[int, int] = {}
        self.inputs: list[torch.Tensor] = []  # the compiled function's: a launch reading one must name it
        self.unnamed: set[int] = set()  # pointers the traces did not find in their keys' tensors

    @staticmethod
    def can_replay(t):
        return True

    def pointer(self, t: torch.Tensor) -> tuple:
        p = t.data_ptr()
        for i, named in enumerate(self.named):
            base = named.untyped_storage().data_ptr()
            if base <= p < base + max(named.untyped_storage().nbytes(), 1):
                return "named", i, p - named.data_ptr()
        for t in self.inputs:
            base = t.untyped_storage().data_ptr()
            assert not base <= p < base + t.untyped_storage().nbytes(), "a launch reads an input the key does not name"
        return "other", self.others.setdefault(p, len(self.others))

    def described(self, value):
        """A launch argument as a value: tensors by what a launch takes from them, pointers renamed."""
        if isinstance(value, torch.Tensor):
            return self.pointer(value), value.shape, value.stride(), value.dtype
        if isinstance(value, (tuple, list)):
            return tuple(self.described(v) for v in value)
        if isinstance(getattr(value, "base", None), torch.Tensor):  # a TMA descriptor
            return self.described(value.base), tuple(value.shape), tuple(value.strides), tuple(value.block_shape)
        if callable(value):
            return id(value)
        return value

    def assert_unread(self, t: torch.Tensor) -> None:
        """That no launch wrote `t` (a call's result) through a pointer its key does not name."""
        base = t.untyped_storage().data_ptr()
        assert not any(base <= p < base + t.untyped_storage().nbytes() for p in self.unnamed), \
            "a launch writes a result the key does not name"

    def run(self, tensors, values, launches, allocated=()):
        self.named, self.others, self.trace = [*tensors, *allocated], {}, []
        # As LaunchReplays.key: the tensors the caller allocated for the call by their pointers alone.
        key = values, self.described(tuple(tensors)), tuple(self.pointer(t) for t in allocated)
        launches()
        trace, self.trace = self.trace, None
        self.unnamed |= set(self.others)
        # A key's first call does what later ones find done (a cached map built, kernels compiled): what a
        # replay repeats is the second call's launches, captured then.
        if key not in self.traces:
            self.traces[key] = None
        elif self.traces[key] is None:
            self.traces[key] = trace
        else:
            assert trace == self.traces[key], "two calls with one key launched differently"
            self.compared += 1


@pytest.fixture
def traced(monkeypatch):
    replays = TracedReplays()
    monkeypatch.setattr(attention_call, "attention_replays", replays)
    for module in (flash_config, blockmap, distance_table):  # where attention kernels are launched
        launch = module.launch

        def tracing(kernel, grid, *args, launch=launch, **keywords):
            if replays.trace is not None:
                replays.trace.append((id(kernel), grid, replays.described(args),
                                      replays.described(tuple(sorted(keywords.items())))))
            return launch(kernel, grid, *args, **keywords)

        monkeypatch.setattr(module, "launch", tracing)
    return replays


def window(q, k, v):
    i = torch.arange(q.shape[-2], device=q.device)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = s.masked_fill((i[None, :] > i[:, None]) | (i[:, None] - i[None, :] >= 16), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def documents(q, k, v, segments):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = s.masked_fill(segments[:, None, :, None] != segments[:, None, None, :], float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def alibi_learned(q, k, v, slopes):
    i = torch.arange(q.shape[-2], device=q.device)
    s = q @ k.transpose(-1, -2) * 0.25 - slopes[:, None, None] * (i[:, None] - i[None, :]).abs()
    return torch.softmax(s, dim=-1) @ v


def t5_table(q, k, v, table):
    i = torch.arange(q.shape[-2], device=q.device)
    distance = (i[None, :] - i[:, None]).clamp(-8, 8) + 8
    return torch.softmax(q @ k.transpose(-1, -2) + table[:, distance], dim=-1) @ v


def _extra(case, b, h, n):
    if case == "documents":
        return [torch.sort(torch.randint(0, 3, (b, n), device=DEVICE), dim=-1).values]
    if case == "alibi_learned":
        return [torch.rand(h, device=DEVICE).requires_grad_()]
    if case == "t5_table":
        return [torch.randn(h, 17, device=DEVICE)]
    return []


# A key's first call (which builds what later ones find built), its second (whose trace a replay repeats), and a
# third, traced and compared with the second.
CALLS = 3


@pytest.mark.parametrize("case", ["window", "documents", "alibi_learned", "t5_table"])
def test_calls_with_one_key_launch_alike(traced, case):
    fn = globals()[case]
    b, h, n, d = 2, 3, 37, 16
    q, k, v = (random_tensor((b, h, n, d), torch.float32).requires_grad_() for _ in range(3))
    extra = _extra(case, b, h, n)
    grad = torch.randn(b, h, n, d, device=DEVICE)
    traced.inputs = [q, k, v, grad, *extra]
    compiled = torch.compile(fn, backend=fusepass.backend(strict=True))
    wrt = (q, k, v, *(x for x in extra if x.requires_grad))
    assigned = [t for t in (q, k, v, grad, *extra) if t.is_floating_point()]
    values = [[torch.randn_like(t) for t in assigned] for _ in range(CALLS)]

    def set_values(call):
        with torch.no_grad():  # new values in the same tensors
            for t, value in zip(assigned, values[call]):
                t.copy_(value)

    # The compiled calls one after another (nothing else allocating between them: the same addresses), then
    # eager's on the same values.
    results = []
    for call in range(CALLS):
        set_values(call)
        traced.unnamed = set()
        out = compiled(q, k, v, *extra)
        gradients = torch.autograd.grad(out, wrt, grad)
        for t in (out, *gradients):
            traced.assert_unread(t)
        results.append([t.clone() for t in gradients])
        del out, gradients
    for call in range(CALLS):
        set_values(call)
        assert_close(results[call], torch.autograd.grad(fn(q, k, v, *extra), wrt, grad), **SUMMED_GRADIENT_FP32)
    assert traced.compared >= 2  # forward and backward met their keys again
