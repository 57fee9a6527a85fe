"""Row reductions with the pointwise ops around them (norms, a softmax, log-sum-exp and cross-entropy losses):
eager, Inductor and fusepass side by side, forward and forward+backward, bf16.

    PYTHONPATH=. python bench/reductions.py [--cases rmsnorm,...]

Times are the kernels' on the device per call (torch.profiler: what a call costs where the host keeps ahead, as
in a model's step); the JSON keeps each call's do_bench median beside them. GB/s counts the fewest bytes a
forward must move: each input read once, each output written once.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from harness import device_ms, keep, median_ms, relative_error

import fusepass


def rmsnorm(x, w):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


def residual_rmsnorm(x, r, w):
    h = x + r
    return h, rmsnorm(h, w)


def layer_norm_by_hand(x, w, b):
    u = x.mean(-1, keepdim=True)
    s = (x - u).pow(2).mean(-1, keepdim=True)
    return w * ((x - u) / torch.sqrt(s + 1e-12)) + b


def softmax_by_hand(x):
    e = torch.exp(x - x.amax(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True)


def cross_entropy(logits, targets):
    return F.cross_entropy(logits.float(), targets)


def cross_entropy_bf16(logits, targets):  # nanoGPT's: the logits as the model gives them
    return F.cross_entropy(logits, targets)


def layer_norm(x, w, b):
    return F.layer_norm(x, x.shape[-1:], w, b)


def logsumexp_by_hand(x):
    xf = x.float()
    m = xf.amax(-1, keepdim=True)
    return (m + torch.log(torch.exp(xf - m).sum(-1, keepdim=True))).squeeze(-1)


@dataclass
class Case:
    name: str
    fn: Callable[..., object]
    shape: tuple[int, int]
    extra: int  # weights of the row's width it takes after x (rmsnorm's one, layernorm's two)
    residual: bool = False
    classes: bool = False  # takes a target class per row (a loss)

    def inputs(self) -> list[torch.Tensor]:
        """Its arguments on the GPU: x (and the residual) and the row's weights in bf16, needing gradients; the
        target classes."""
        m, n = self.shape
        made = [torch.randn(m, n, device="cuda", dtype=torch.bfloat16)]
        if self.residual:
            made.append(torch.randn(m, n, device="cuda", dtype=torch.bfloat16))
        made += [torch.randn(n, device="cuda", dtype=torch.bfloat16) for _ in range(self.extra)]
        made = [x.requires_grad_() for x in made]
        if self.classes:
            made.append(torch.randint(0, n, (m,), device="cuda"))
        return made


CASES = [
    Case("rmsnorm 16384x4096", rmsnorm, (16384, 4096), 1),
    Case("residual+rmsnorm 16384x4096", residual_rmsnorm, (16384, 4096), 1, residual=True),
    Case("layernorm 16384x1024", layer_norm, (16384, 1024), 2),
    Case("layernorm-by-hand 16384x1024", layer_norm_by_hand, (16384, 1024), 2),
    Case("softmax-by-hand 16384x1024", softmax_by_hand, (16384, 1024), 0),
    Case("cross-entropy 8192x50257", cross_entropy, (8192, 50257), 0, classes=True),
    Case("cross-entropy 4096x128256", cross_entropy, (4096, 128256), 0, classes=True),
    Case("cross-entropy-bf16 8192x50257", cross_entropy_bf16, (8192, 50257), 0, classes=True),
    Case("logsumexp-by-hand 4096x50257", logsumexp_by_hand, (4096, 50257), 0),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default=",".join(c.name.split()[0] for c in CASES))
    args = parser.parse_args()
    chosen = set(args.cases.split(","))
    rows = []
    for case in CASES:
        if case.name.split()[0] not in chosen:
            continue
        inputs = case.inputs()
        expected = case.fn(*[x.double() if x.is_floating_point() else x for x in inputs])
        expected = expected if isinstance(expected, tuple) else (expected,)
        row = {"case": case.name}
        for label, backend in (("eager", None), ("inductor", "inductor"), ("fusepass", fusepass.backend(strict=True, graphs=False))):
            torch._dynamo.reset()
            fn = case.fn if backend is None else torch.compile(case.fn, backend=backend)
            out = fn(*inputs)
            out = out if isinstance(out, tuple) else (out,)
            grads = [torch.randn_like(o) for o in out]
            row[f"{label} error"] = max(relative_error(o.double(), e) for o, e in zip(out, expected))
            row[f"{label} fwd call ms"] = median_ms(lambda: fn(*inputs))
            row[f"{label} fwd ms"] = device_ms(lambda: fn(*inputs))

            def step():
                outs = fn(*inputs)
                torch.autograd.backward(outs if isinstance(outs, tuple) else (outs,), grads)

            row[f"{label} fwd+bwd call ms"] = median_ms(step)
            row[f"{label} fwd+bwd ms"] = device_ms(step)
        moved = sum(x.numel() * x.element_size() for x in inputs) + sum(o.numel() * o.element_size() for o in out)
        row["fusepass fwd GB/s"] = moved / row["fusepass fwd ms"] / 1e6
        row["fwd vs inductor"] = row["inductor fwd ms"] / row["fusepass fwd ms"]
        row["fwd+bwd vs inductor"] = row["inductor fwd+bwd ms"] / row["fusepass fwd+bwd ms"]
        rows.append(row)
    columns = ["case", "eager fwd ms", "inductor fwd ms", "fusepass fwd ms", "fusepass fwd GB/s", "fwd vs inductor",
               "eager fwd+bwd ms", "inductor fwd+bwd ms", "fusepass fwd+bwd ms", "fwd+bwd vs inductor",
               "eager error", "inductor error", "fusepass error"]
    print(keep("reductions", columns, rows, "bf16; device ms per call (kernels' time, torch.profiler); errors "
                                            "against float64, relative (norm)."))


if __name__ == "__main__":
    main()
