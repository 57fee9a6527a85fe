"""Threads: compiled functions called and compiled from several threads at once give each thread its own right
result, and leave the process able to compile."""
from __future__ import annotations

import threading

import pytest
import torch
from support import random_tensor

import fusepass


def causal(q, k, v):
    n = q.shape[-2]
    i = torch.arange(n, device=q.device)
    s = (q @ k.transpose(-1, -2) / 4).masked_fill(i[None, :] > i[:, None], float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def _in_threads(work, arguments) -> list:
    errors = []

    def run(*args):
        try:
            work(*args)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=args) for args in arguments]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def test_a_dynamic_attention_planned_at_new_lengths_from_two_threads():
    compiled = torch.compile(causal, backend="fusepass", dynamic=True)
    x = random_tensor((1, 2, 20, 16), torch.float32)
    compiled(x, x, x)

    def call(n):
        q, k, v = (random_tensor((1, 2, n, 16), torch.float32) for _ in range(3))
        torch.testing.assert_close(compiled(q, k, v), causal(q, k, v), rtol=1e-4, atol=1e-4)

    assert not _in_threads(call, [(33,), (50,), (41,)])
    assert not torch.fx._symbolic_trace.is_fx_tracing()
    fresh = torch.compile(lambda x: x * 2 + 1, backend="fusepass")  # the process still compiles
    torch.testing.assert_close(fresh(x), x * 2 + 1)


@pytest.mark.filterwarnings("error::RuntimeWarning")  # a kernel that failed and fell back is a failure here
def test_kernels_launched_from_two_threads_at_once():
    compiled = torch.compile(causal, backend="fusepass")
    gelu = torch.compile(lambda x, b: torch.nn.functional.gelu(x * 0.5 + b) * torch.sigmoid(x), backend="fusepass")
    inputs = [[random_tensor((2, 2, 24, 16), torch.float32).requires_grad_() for _ in range(3)] for _ in range(2)]
    for q, k, v in inputs:  # compiled once before the threads race
        compiled(q, k, v)
    # gelu too: on torch 2.11 a compile in one thread (AOTAutograd's trace sets FX's process-global tracing flag)
    # makes Dynamo refuse to run a compiled function in another, whatever the backend
    gelu(inputs[0][0].detach().flatten(0, 1), inputs[0][2].detach()[0, 0, 0])

    def call(q, k, v):
        for _ in range(3):
            out = compiled(q, k, v)
            (dq,) = torch.autograd.grad(out.sum(), (q,))
            ref_q = q.detach().requires_grad_()
            expected = causal(ref_q, k, v)
            (ref_dq,) = torch.autograd.grad(expected.sum(), (ref_q,))
            torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(dq, ref_dq, rtol=1e-4, atol=1e-4)
            x, b = q.detach().flatten(0, 1), v.detach()[0, 0, 0]
            torch.testing.assert_close(gelu(x, b), torch.nn.functional.gelu(x * 0.5 + b) * torch.sigmoid(x))

    assert not _in_threads(call, inputs)


def test_two_threads_compile_different_functions():
    x = random_tensor((1, 2, 17, 16), torch.float32)

    def compile_and_run(scale):
        f = torch.compile(lambda q, k, v: torch.softmax(q @ k.transpose(-1, -2) * scale, -1) @ v,
                          backend="fusepass", dynamic=False)
        torch.testing.assert_close(f(x, x, x), torch.softmax(x @ x.transpose(-1, -2) * scale, -1) @ x,
                                   rtol=1e-4, atol=1e-4)

    fusepass.reset()
    assert not _in_threads(compile_and_run, [(0.25,), (0.5,)])
