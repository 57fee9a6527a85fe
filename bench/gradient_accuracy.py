"""How far attention's bf16 output and gradients sit from float64's, fusepass beside eager bf16 and SDPA bf16, at a
real shape: the trust side of the row term (the backward's delta = dO · O, which must match the weights the backward
recomputes). Cases: random q, k, v (near-uniform weights); keys sharing a common part, as a key projection's bias or
a normed input's mean gives them (a row's gradient sum then reaches dQ times that part); causal and unmasked.

    PYTHONPATH=. python bench/gradient_accuracy.py [--shape 1,4,4096,128] [--out bench/results/...md]

Without a GPU it runs on the CPU through Triton's interpreter (`TRITON_INTERPRET=1`, e.g.
`--shape 1,2,300,32`).

Each cell is ‖x − x_float64‖ / ‖x_float64‖ for x in out, dQ, dK, dV, and for Σ_j dK_j (a key bias's gradient, 0
in exact arithmetic) its distance over ‖dK_float64‖. The ratio column is fusepass's against eager's for the same
tensor.
"""
from __future__ import annotations

import argparse
import datetime
import math

import torch
import triton
from harness import relative_error
from torch.nn.functional import scaled_dot_product_attention

import fusepass


def attention(q, k, v, causal: bool):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        n = q.shape[-2]
        i = torch.arange(n, device=q.device)
        s = s.masked_fill(i[None, :] > i[:, None], float("-inf"))
    return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v


def results(fn, q, k, v, grad) -> list[torch.Tensor]:
    """out, dQ, dK, dV and the sum of dK over the keys (a key bias's gradient: 0 in exact arithmetic)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad.to(out.dtype))
    return [out, dq, dk, dv, dk.double().sum(-2)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="1,4,4096,128")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    b, h, n, d = map(int, args.shape.split(","))
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for case in ("random", "common key part"):
        for causal in (True, False):
            q, k, v, grad = (torch.randn(b, h, n, d, device=device, dtype=torch.float64) for _ in range(4))
            if case == "common key part":
                k = k + 3 * torch.randn(d, device=device, dtype=torch.float64)
            wide = results(lambda *t: attention(*t, causal), q, k, v, grad)
            narrow = [x.to(torch.bfloat16) for x in (q, k, v)]
            compiled = torch.compile(lambda *t: attention(*t, causal), backend="fusepass")
            ways = {"eager": lambda *t: attention(*t, causal),
                    "sdpa": lambda *t: scaled_dot_product_attention(*t, is_causal=causal),
                    "fusepass": compiled}
            # the key sum's distance relative to dK's size (its own float64 value is a rounding)
            errors = {name: [relative_error(x, w) for x, w in zip(got[:4], wide)]
                      + [(got[4] - wide[4]).norm().item() / wide[2].norm().item()]
                      for name, got in ((name, results(fn, *narrow, grad)) for name, fn in ways.items())}
            ratio = max(f / e for f, e in zip(errors["fusepass"], errors["eager"]))
            rows.append((case, "causal" if causal else "unmasked", errors, ratio))
            torch._dynamo.reset()
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU (Triton's interpreter)"
    lines = [f"{datetime.date.today()}, {where}, torch {torch.__version__}, triton {triton.__version__}, "
             f"B{b} H{h} N{n} D{d} bf16, fusepass at {fusepass.__file__}", "",
             "| case | mask | tensor | eager | sdpa | fusepass | fusepass / eager |", "|---|---|---|---|---|---|---|"]
    for case, mask, errors, ratio in rows:
        for i, tensor in enumerate(("out", "dQ", "dK", "dV", "Σ_j dK_j")):
            e, s, f = (errors[name][i] for name in ("eager", "sdpa", "fusepass"))
            lines.append(f"| {case} | {mask} | {tensor} | {e:.3g} | {s:.3g} | {f:.3g} | {f / e:.2f} |")
    lines.append("")
    lines.append("worst fusepass / eager: " + ", ".join(f"{c} {m} {r:.2f}" for c, m, _, r in rows))
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write("# gradient accuracy\n\n" + text + "\n")


if __name__ == "__main__":
    main()
