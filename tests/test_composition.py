"""fusepass among the rest of PyTorch: autocast, no_grad and inference_mode, gradients to some inputs only,
double backward, graph breaks, parameters and buffers as masks, unusual inputs (non-contiguous, empty, one tensor
as Q, K and V), in-place ops in user code, and DistributedDataParallel."""
from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from support import DEVICE, check, random_tensor, relative_error, rewrites

import fusepass

FP32 = dict(rtol=1e-4, atol=1e-4)


def causal(q, k, v):
    n = q.shape[-2]
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).tril().logical_not(), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


class Block(nn.Module):
    """Attention and an MLP, as a transformer block writes them."""

    def __init__(self, width: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.qkv(self.norm(x)).chunk(3, dim=-1))
        x = x + causal(q, k, v).transpose(1, 2).reshape(b, n, c)
        return x + self.down(F.gelu(self.up(x)))


def _step(model: nn.Module, x: torch.Tensor, dtype: torch.dtype | None):
    model.zero_grad(set_to_none=True)
    with torch.autocast(DEVICE, dtype=dtype, enabled=dtype is not None):
        out = model(x)
    out.float().square().mean().backward()
    return out, {n.removeprefix("_orig_mod."): p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_block_under_autocast(dtype):
    torch.manual_seed(0)
    model = Block().to(DEVICE)
    x = random_tensor((2, 19, 32), torch.float32)
    fusepass.reset()
    out, grads = _step(torch.compile(model, backend=fusepass.backend(strict=True)), x, dtype)
    eager, eager_grads = _step(model, x, dtype)
    reference, reference_grads = _step(model.double(), x.double(), None)
    assert out.dtype == eager.dtype
    assert relative_error(out, reference) <= 2 * relative_error(eager, reference) + 2e-3
    for name, grad in grads.items():
        assert grad is not None, name
        assert relative_error(grad, reference_grads[name]) <= \
            2 * relative_error(eager_grads[name], reference_grads[name]) + 5e-3, name
    assert rewrites(fusepass.last_report(), "attention", "backward")


def test_no_grad_and_inference_mode():
    q, k, v = (random_tensor((2, 2, 13, 16), torch.float32).requires_grad_() for _ in range(3))
    compiled = torch.compile(causal, backend="fusepass")
    for mode in (torch.no_grad, torch.inference_mode):
        fusepass.reset()
        with mode():
            out = compiled(q, k, v)
        assert not out.requires_grad
        torch.testing.assert_close(out, causal(q, k, v).detach(), **FP32)
        assert rewrites(fusepass.last_report(), "attention", "forward")


@pytest.mark.parametrize("learns", ["q", "k", "v", "kv"])
def test_gradients_to_some_inputs_only(learns):
    q, k, v = (random_tensor((2, 2, 13, 16), torch.float32) for _ in range(3))
    fused = {n: t.clone().requires_grad_(n in learns) for n, t in zip("qkv", (q, k, v))}
    eager = {n: t.clone().requires_grad_(n in learns) for n, t in zip("qkv", (q, k, v))}
    torch.compile(causal, backend="fusepass")(*fused.values()).sum().backward()
    causal(*eager.values()).sum().backward()
    for n in "qkv":
        assert (fused[n].grad is None) == (n not in learns)
        if n in learns:
            torch.testing.assert_close(fused[n].grad, eager[n].grad, **FP32)


def test_double_backward_is_refused_clearly():
    q, k, v = (random_tensor((1, 2, 9, 16), torch.float32).requires_grad_() for _ in range(3))
    out = torch.compile(causal, backend="fusepass")(q, k, v)
    with pytest.raises(RuntimeError, match="double backward"):
        (dq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
        torch.autograd.grad(dq.sum(), k)


def broken_in_two(q, k, v):
    first = causal(q, k, v)
    torch._dynamo.graph_break()
    return causal(first, k, v)


def test_a_graph_break_gives_each_graph_its_report():
    q, k, v = (random_tensor((1, 2, 9, 16), torch.float32).requires_grad_() for _ in range(3))
    fusepass.reset()
    out = torch.compile(broken_in_two, backend="fusepass")(q, k, v)
    torch.testing.assert_close(out, broken_in_two(q, k, v), **FP32)
    out.sum().backward()
    graphs = fusepass.reports()
    assert len(graphs) == 2
    assert all(rewrites(r, "attention", "forward") and rewrites(r, "attention", "backward") for r in graphs)


class MaskedByItsBuffers(nn.Module):
    """A causal mask as a registered buffer and a learnable bias as a parameter."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.register_buffer("causal", torch.ones(n, n, dtype=torch.bool).tril())
        self.bias = nn.Parameter(torch.randn(2, n, n) * 0.1)

    def forward(self, q, k, v):
        s = q @ k.transpose(-1, -2) * 0.25 + self.bias
        return torch.softmax(s.masked_fill(~self.causal, float("-inf")), dim=-1) @ v


def test_parameters_and_buffers_as_masks_and_biases():
    torch.manual_seed(0)
    model = MaskedByItsBuffers(13).to(DEVICE)
    q, k, v = (random_tensor((2, 2, 13, 16), torch.float32) for _ in range(3))
    fusepass.reset()
    out = torch.compile(model, backend="fusepass")(q, k, v)
    out.square().sum().backward()
    fused_grad, model.bias.grad = model.bias.grad, None
    model(q, k, v).square().sum().backward()
    torch.testing.assert_close(fused_grad, model.bias.grad, rtol=1e-3, atol=1e-3)
    (rewrite,) = rewrites(fusepass.last_report(), "attention", "forward")
    assert "bias" in rewrite.features


def test_unusual_inputs():
    compiled = torch.compile(causal, backend="fusepass", dynamic=False)
    transposed = random_tensor((1, 9, 2, 16), torch.float32).transpose(1, 2)  # not contiguous
    torch.testing.assert_close(compiled(transposed, transposed, transposed),
                               causal(transposed, transposed, transposed), **FP32)
    empty = random_tensor((1, 2, 0, 16), torch.float32)
    fusepass.reset()
    assert compiled(empty, empty, empty).shape == (1, 2, 0, 16)
    (hotspot,) = fusepass.last_report().hotspots
    assert "empty attention" in hotspot.reason  # declined, not a kernel failure
    one = random_tensor((1, 2, 9, 16), torch.float32).requires_grad_()  # Q, K and V one tensor
    check(lambda x: causal(x, x, x), one.detach(), backward=True, **FP32)


def test_in_place_ops_in_user_code():
    def fn(x, b):
        y = x * 2
        y.add_(b)
        y.mul_(y.sigmoid())
        return y.clamp_(min=-1.0) * x

    report = check(fn, random_tensor((6, 5), torch.float32), random_tensor((5,), torch.float32), backward=True)
    assert rewrites(report, phase="forward")


DDP_SCRIPT = """
import os, sys, torch, torch.distributed as dist, torch.nn as nn
import fusepass
sys.path.insert(0, {tests!r})
from test_composition import Block

rank, device = int(sys.argv[1]), sys.argv[3]
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=rank, world_size=2)
torch.manual_seed(0)
model = Block().to(device)
reference = Block().to(device)
reference.load_state_dict(model.state_dict())
ddp = nn.parallel.DistributedDataParallel(model)
compiled = torch.compile(ddp, backend="fusepass")
torch.manual_seed(1 + rank)
x = torch.randn(2, 11, 32, device=device)
compiled(x).square().mean().backward()
# The reference: every rank's loss on one process, averaged as DDP averages gradients.
xs = [None, None]
dist.all_gather_object(xs, x)
sum(reference(xi).square().mean() for xi in xs).div(2).backward()
for (name, p), r in zip(model.named_parameters(), reference.parameters()):
    assert p.grad is not None, name
    torch.testing.assert_close(p.grad, r.grad, rtol=1e-4, atol=1e-5, msg=name)
report = fusepass.reports()
assert any(r.kind == "attention" and r.phase == "backward" for rep in report for r in rep.rewrites), report
print("rank", rank, "ok")
"""


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")
def test_distributed_data_parallel_over_two_processes(tmp_path):
    script = tmp_path / "ddp.py"
    script.write_text(textwrap.dedent(DDP_SCRIPT.format(tests=os.path.dirname(__file__))))
    # Both ranks on the one GPU where there is one (gloo reduces CUDA tensors too), else through the interpreter.
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    if DEVICE == "cpu":
        env["TRITON_INTERPRET"] = "1"
    port = str(29500 + os.getpid() % 1000)
    ranks = [subprocess.Popen([sys.executable, str(script), str(r), port, DEVICE], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    outputs = [p.communicate(timeout=600) for p in ranks]
    for p, (out, err) in zip(ranks, outputs):
        assert p.returncode == 0, err[-3000:]
        assert "ok" in out
