"""Which parameters' gradients set an example model's gradient error: each parameter's distance from the float32
model's gradient, in eager bf16, under fusepass bf16 and under fusepass with its attention rewrite off (which part
of fusepass moves it), largest ratios to eager's first. On the GPU; on the CPU at a small size through Triton's
interpreter (`TRITON_INTERPRET=1`, e.g. `--size tiny --batch 2 --seq 40`).

    PYTHONPATH=. python bench/gradient_by_parameter.py --model bert [--size small] [--batch 8] [--seq 512] [--top 12]
"""
from __future__ import annotations

import argparse
import copy
import importlib
import os
import sys

import torch
from profile_models import EXAMPLES

import fusepass
from fusepass.compare import gradient_distances

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))


def gradients(model: torch.nn.Module, inputs: tuple, loss, backend: object = None) -> dict[str, torch.Tensor]:
    """Each parameter's gradient of a step of `model`, compiled with `backend` where given."""
    model.zero_grad(set_to_none=True)
    loss((model if backend is None else torch.compile(model, backend=backend))(*inputs)).backward()
    return {n: p.grad.detach().double() for n, p in model.named_parameters() if p.grad is not None}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="bert")
    parser.add_argument("--size", default="small")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    example = importlib.import_module(args.model)
    cls, loss_name = EXAMPLES[args.model]
    torch.manual_seed(0)
    wide = getattr(example, cls)(example.SIZES[args.size]).to("cuda" if torch.cuda.is_available() else "cpu")
    inputs = example.inputs(wide, args.batch, args.seq)
    loss = getattr(example, loss_name)
    narrow = copy.deepcopy(wide).to(torch.bfloat16)
    narrow_inputs = tuple(x.to(torch.bfloat16) if x.is_floating_point() else x for x in inputs)
    reference = gradients(wide, inputs, loss)
    eager = gradients(narrow, narrow_inputs, loss)
    fused = gradients(narrow, narrow_inputs, loss, "fusepass")
    torch._dynamo.reset()
    no_attention = gradients(narrow, narrow_inputs, loss, fusepass.backend(attention=False))
    distances = [gradient_distances(g, reference) for g in (eager, fused, no_attention)]
    rows = []
    for name in reference:
        e, f, n = (d[name] for d in distances)
        rows.append((f / max(e, 1e-12), name, e, f, n))
    rows.sort(reverse=True)
    print("| parameter | eager bf16 vs fp32 | fusepass | fusepass, attention off | ratio |\n|---|---|---|---|---|")
    for ratio, name, e, f, n in rows[:args.top]:
        print(f"| {name} | {e:.3g} | {f:.3g} | {n:.3g} | {ratio:.2f} |")
    print(f"worst: eager {max(r[2] for r in rows):.3g}, fusepass {max(r[3] for r in rows):.3g}, "
          f"attention off {max(r[4] for r in rows):.3g}")


if __name__ == "__main__":
    main()
