"""Compiled functions dropped leave nothing behind: attention specs, generated kernels and their modules live as
long as the graphs that call them."""
from __future__ import annotations

import gc

import torch
from support import random_tensor

import fusepass
from fusepass.attention import call, dynamic
from fusepass.codegen import modules


def _counts() -> tuple[int, int]:
    """Attention specs and dynamic attention specs alive (with them their graphs and reports). Pointwise kernels
    are not counted: Triton keeps each function it ran (in the interpreter and on the GPU alike)."""
    gc.collect()
    return len(call._calls), len(dynamic._specs)


def test_dropped_compiles_release_specs_kernels_and_modules():
    torch._dynamo.reset()
    before = _counts()
    earlier = set(call._calls)  # (specs of earlier tests may go meanwhile, with the generated modules that hold them)
    q, k, v = (random_tensor((1, 2, 9, 16), torch.float32) for _ in range(3))
    for i in range(6):  # six distinct functions, each an attention and a chain of its own
        def attention(q, k, v, scale=0.1 * (i + 1)):
            return torch.softmax(q @ k.transpose(-1, -2) * scale, dim=-1) @ v * (i + 2) - 1

        torch.compile(attention, backend="fusepass", dynamic=False)(q, k, v)
    torch.compile(lambda q, k, v: torch.softmax(q @ k.transpose(-1, -2), -1) @ v, backend="fusepass",
                  dynamic=True)(q, k, v)
    grown = _counts()
    assert len(set(call._calls) - earlier) >= 6 and grown[1] == before[1] + 1
    fusepass.reset()
    torch._dynamo.reset()
    assert _counts()[1] == before[1] and set(call._calls) <= earlier  # (_counts collects garbage first)


def test_generated_modules_are_bounded():
    for i in range(modules.LOADED + 3):
        modules.load_module(f"VALUE = {i}\n")
    assert len(modules._loaded) == modules.LOADED


def test_a_dynamic_attention_keeps_a_bounded_number_of_plans():
    def attention(q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2) * 0.25, dim=-1) @ v

    compiled = torch.compile(attention, backend="fusepass", dynamic=True)
    for n in range(3, 3 + dynamic.PLANS + 4):
        x = random_tensor((1, 1, n, 16), torch.float32)
        torch.testing.assert_close(compiled(x, x, x), attention(x, x, x), rtol=1e-4, atol=1e-4)
    assert max(len(spec.plans) for spec in dynamic._specs.values()) == dynamic.PLANS
